"""autopar/dtensor_bridge.py `dispatching`: DTensor's dispatch takes the plan's strategy
when its own single-axis rules match the inputs as they are, and searches every strategy
otherwise (codegen/apply.py runs every op of the per-rank program under it)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial as DPartial, Replicate as DReplicate, Shard as DShard

from autopar import dtensor_bridge as bridge
from autopar.placement import Partial, Replicate, Shard
from tests.conftest import fake_mesh

aten = torch.ops.aten


@pytest.fixture
def mesh():
    with fake_mesh((2, 2)) as m:
        yield m


@pytest.fixture
def searches(monkeypatch):
    """How many times DTensor's full expansion of an op's rules ran."""
    bridge.register_project_rules()
    full = bridge._FULL_EXPANSION[0]
    calls = []

    def counted(*args):
        fn = full(*args)

        def run(*a):
            calls.append(args[1].op)
            return fn(*a)

        return run

    monkeypatch.setattr(bridge, "_FULL_EXPANSION", [counted])
    return calls


def _dt(shape, mesh, placements) -> DTensor:
    global_ = torch.randn(shape)
    return DTensor.from_local(global_, mesh, placements, run_check=False)


def test_the_plans_strategy_is_taken_without_a_search(mesh, searches) -> None:
    # rows sharded over dp, contraction dim over tp: each rank's product is a partial sum
    x = _dt((4, 6), mesh, (DShard(0), DShard(1)))
    w = _dt((6, 5), mesh, (DReplicate(), DShard(0)))
    with bridge.dispatching(aten.mm.default, ((Shard(0), Partial()),)):
        out = aten.mm.default(x, w)
    assert out.placements == (DShard(0), DPartial())
    assert searches == []
    assert out.to_local().shape == (4, 5)


def test_a_strategy_the_rules_do_not_give_directly_is_searched(mesh, searches) -> None:
    x = _dt((4, 7), mesh, (DShard(0), DReplicate()))
    w = _dt((7, 3), mesh, (DReplicate(), DReplicate()))
    # the rules give (Shard(0), Replicate) for these inputs; asking for another output
    # leaves the choice to DTensor's full search (apply's check then names any mismatch)
    with bridge.dispatching(aten.mm.default, ((Replicate(), Replicate()),)):
        out = aten.mm.default(x, w)
    assert searches == [aten.mm.default]
    assert out.placements == (DShard(0), DReplicate())


def test_without_a_plan_or_for_another_op_dtensor_searches(mesh, searches) -> None:
    x = _dt((4, 9), mesh, (DShard(0), DReplicate()))
    y = _dt((4, 9), mesh, (DShard(0), DReplicate()))
    aten.add.Tensor(x, y)
    with bridge.dispatching(aten.mm.default, ((Shard(0), Replicate()),)):
        aten.mul.Tensor(x, y)
    assert searches == [aten.add.Tensor, aten.mul.Tensor]


def test_traced_metadata_records_no_op_into_the_program() -> None:
    """apply hands DTensor the traced output metadata while make_fx records the per-rank
    program: making it (contiguous strides included) must record nothing there. Made from
    a meta tensor, it would put an `aten.empty` into the program per op, run at every step
    (316 per pipeline chunk of the benchmark Llama)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x):
        meta = bridge.tensor_meta((8, 64, 256), (), "float32")
        assert meta.stride == (64 * 256, 256, 1)
        return x + 1

    gm = make_fx(step, tracing_mode="fake")(torch.randn(2))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [aten.add.Tensor]
