"""Strategy enumeration from DTensor's registry: divisibility, oracles, coverage, the planner.

Oracles: every enumerated matmul strategy, run shard by shard on simulated devices, gives
the product; the torch-free redistribute planner (autopar/placement.py) takes DTensor's
own steps for every pair of layouts on 1-D, 2-D and 3-D meshes.
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest

from autopar.dtensor_bridge import transforms
from autopar.ir import Graph, ModelInfo, Node, Phase, Ref, Role, TensorMeta
from autopar.models import resolve
from autopar.placement import (
    Partial,
    Replicate,
    Shard,
    evenly_divisible,
    redistribute_plan,
    redistribute_supported,
    transfer_kind,
)
from autopar.trace import trace_model
from solver.intra_op.space import coverage, enumerate_strategies


def _graph(nodes: list[Node]) -> Graph:
    info = ModelInfo(name="t", num_parameters=0, num_layers=0, batch=1, seq=1, dtype="float32")
    return Graph(model=info, nodes=tuple(nodes), loss=len(nodes) - 1, param_grads=(), layer_groups=())


def _ph(i: int, shape: tuple[int, ...], role: Role = Role.INPUT) -> Node:
    return Node(id=i, name=f"p{i}", op="placeholder", inputs=(), args=(),
                outputs=(TensorMeta(shape=shape, dtype="float32"),), role=role, phase=Phase.FORWARD, is_view=True)


def _mm(i: int, shape: tuple[int, ...]) -> Node:
    return Node(id=i, name="mm", op="aten.mm.default", inputs=(0, 1), args=(Ref(0), Ref(1)),
                outputs=(TensorMeta(shape=shape, dtype="float32"),), role=Role.ACTIVATION, phase=Phase.FORWARD)


def test_mm_strategies_on_1d_and_2d_mesh() -> None:
    g = _graph([_ph(0, (16, 8)), _ph(1, (8, 32)), _mm(2, (16, 32))])
    one = enumerate_strategies(g, (4,))[2]
    assert {s.outputs[0] for s in one} == {(Replicate(),), (Shard(0),), (Shard(1),), (Partial(),)}
    two = enumerate_strategies(g, (2, 4))[2]
    classic = {(a, b) for a in ((Replicate(),), (Shard(0),), (Shard(1),), (Partial(),))
               for b in ((Replicate(),), (Shard(0),), (Shard(1),), (Partial(),))}
    # 4 x 4 per-axis options, all divisible here, plus DTensor's linear rules for pending-sum inputs
    assert {(s.outputs[0][:1], s.outputs[0][1:]) for s in two} == classic
    assert len(two) == 36
    # a non-divisible size drops the strategies sharding it
    three = enumerate_strategies(_graph([_ph(0, (6, 8)), _ph(1, (8, 32)), _mm(2, (6, 32))]), (4,))[2]
    assert (Shard(0),) not in {s.outputs[0] for s in three}


def test_llama_strategies_divide_evenly_and_cover_every_op() -> None:
    graph = trace_model(resolve("llama-tiny"), batch=2)
    mesh = (2, 4)
    space = enumerate_strategies(graph, mesh)
    assert not space.fallback_ops
    assert coverage(graph, space) == 1.0
    for node, strategies in zip(graph.nodes, space.strategies):
        assert strategies, node.op
        for s in strategies:
            for meta, pl in zip(node.outputs, s.outputs):
                assert evenly_divisible(meta.shape, pl, mesh), (node.op, meta.shape, pl)
                assert meta.is_floating or not any(isinstance(p, Partial) for p in pl), node.op
            if node.op != "getitem":  # averages are outputs only (a getitem passes its producer's on)
                assert not any(p == Partial("avg") for pl in s.inputs for p in pl)
        if node.op not in ("getitem", "placeholder"):  # all-replicated is always available
            assert any(all(p == Replicate() for pls in s.outputs for p in pls) for s in strategies)
    sdpa = next(i for i, n in enumerate(graph.nodes) if "scaled_dot_product" in n.op)
    sharded = {s.inputs[0] for s in space[sdpa]}
    assert (Shard(0), Shard(1)) in sharded and (Replicate(), Shard(1)) in sharded  # batch x heads (project rule)
    tangent = next(n for n in graph.nodes if n.role is Role.TANGENT)
    assert [s.outputs for s in space[tangent.id]] == [((Replicate(), Replicate()),)]


def test_op_without_strategy_or_decomposition_is_replicated_and_named(caplog) -> None:
    odd = Node(id=1, name="odd", op="aten.weird_op.default", inputs=(0,), args=(Ref(0),),
               outputs=(TensorMeta(shape=(8, 8), dtype="float32"),), role=Role.ACTIVATION, phase=Phase.FORWARD,
               module_path="blocks.3.odd")
    g = _graph([_ph(0, (8, 8)), odd])
    with caplog.at_level(logging.WARNING):
        space = enumerate_strategies(g, (4,))
    assert space.fallback_ops == ("aten.weird_op.default",)
    assert [s.outputs for s in space[1]] == [((Replicate(),),)]
    assert "aten.weird_op.default" in caplog.text and "blocks.3.odd" in caplog.text
    assert coverage(g, space) == 1.0  # no FLOPs at all: bytes stand in, nothing to cover


def test_bad_mesh_is_a_value_error() -> None:
    g = _graph([_ph(0, (8, 8))])
    with pytest.raises(ValueError, match="mesh shape"):
        enumerate_strategies(g, ())


def _local(x: np.ndarray, pl, rank: int, n: int) -> np.ndarray:
    if isinstance(pl, Shard):
        return np.array_split(x, n, axis=pl.dim)[rank]
    if isinstance(pl, Partial):  # Replicate -> Partial: each device holds 1/n, the sum is the value
        return x / n
    return x


def _combine(locals_: list[np.ndarray], pl) -> np.ndarray:
    if isinstance(pl, Shard):
        return np.concatenate(locals_, axis=pl.dim)
    if isinstance(pl, Partial):
        return sum(locals_)
    assert all(np.allclose(x, locals_[0]) for x in locals_)
    return locals_[0]


@pytest.mark.parametrize("op", ["aten.mm.default", "aten.addmm.default"])
def test_matmul_strategies_compute_the_product(op: str) -> None:
    """Every enumerated strategy, run shard by shard on 4 simulated devices, gives A @ B (+ bias)."""
    n, rng = 4, np.random.default_rng(0)
    a, b, bias = rng.standard_normal((8, 12)), rng.standard_normal((12, 16)), rng.standard_normal(16)
    nodes = [_ph(0, (8, 12)), _ph(1, (12, 16))]
    if op == "aten.addmm.default":
        nodes = [_ph(0, (16,)), _ph(1, (8, 12)), _ph(2, (12, 16))]
        args, values, want = (Ref(0), Ref(1), Ref(2)), (bias, a, b), bias + a @ b
    else:
        args, values, want = (Ref(0), Ref(1)), (a, b), a @ b
    k = len(nodes)
    nodes.append(Node(id=k, name="mm", op=op, inputs=tuple(range(k)), args=args,
                      outputs=(TensorMeta(shape=(8, 16), dtype="float32"),), role=Role.ACTIVATION,
                      phase=Phase.FORWARD))
    strategies = enumerate_strategies(_graph(nodes), (n,))[k]
    assert any(s.outputs[0] == (Partial(),) for s in strategies)  # row parallel is there
    for s in strategies:
        outs = []
        for rank in range(n):
            local = [_local(v, pl[0], rank, n) for v, pl in zip(values, s.inputs)]
            outs.append(local[0] + local[1] @ local[2] if k == 3 else local[0] @ local[1])
        np.testing.assert_allclose(_combine(outs, s.outputs[0][0]), want, rtol=1e-9, atol=1e-9, err_msg=str(s))


@pytest.mark.parametrize("mesh", [(4,), (2, 2), (2, 4), (2, 2, 2)])
def test_redistribute_plan_is_dtensors(mesh: tuple[int, ...]) -> None:
    """The pricing's planner takes DTensor's steps (kind, axis, logical shape) for every pair."""
    shape = (8, 16, 4)
    layouts = [c for c in itertools.product([Replicate(), Partial(), Shard(0), Shard(1), Shard(2)], repeat=len(mesh))
               if evenly_divisible(shape, c, mesh)]
    checked = 0
    for src, dst in itertools.product(layouts, layouts):
        if not redistribute_supported(src, dst):
            with pytest.raises(ValueError):
                transforms(shape, (), "float32", src, dst, mesh)
            continue
        mine = [(transfer_kind(a, b), axis, logical) for axis, a, b, logical in redistribute_plan(shape, src, dst, mesh)]
        assert mine == transforms(shape, (), "float32", src, dst, mesh), (src, dst)
        checked += 1
    assert checked > 20
