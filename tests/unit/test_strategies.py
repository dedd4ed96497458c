"""Strategy rules against brute force: view dim maps, divisibility, matmul and N-D products."""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest

from autopar.ir import Graph, ModelInfo, Node, Phase, Ref, Role, TensorMeta
from autopar.models import resolve
from autopar.placement import Partial, Replicate, Shard, evenly_divisible
from autopar.trace import trace_model
from solver.strategies import _view_dim_map, enumerate_strategies


def _chunks_match(src: tuple[int, ...], dst: tuple[int, ...], i: int, j: int, k: int) -> bool:
    """Brute force: does chunk r of dim i of x equal chunk r of dim j of x.reshape(dst)?"""
    x = np.arange(int(np.prod(src))).reshape(src)
    y = x.reshape(dst)
    if src[i] % k or dst[j] % k:
        return False
    return all(np.array_equal(np.array_split(x, k, axis=i)[r].reshape(-1),
                              np.sort(np.array_split(y, k, axis=j)[r].reshape(-1)))
               and np.array_equal(np.sort(np.array_split(x, k, axis=i)[r].reshape(-1)),
                                  np.sort(np.array_split(y, k, axis=j)[r].reshape(-1)))
               for r in range(k))


@pytest.mark.parametrize("src,dst", [
    ((4, 6, 8), (24, 8)), ((24, 8), (4, 6, 8)), ((4, 6, 8), (4, 48)), ((2, 4, 6, 8), (8, 6, 8)),
    ((4, 6, 8), (4, 6, 2, 4)), ((2, 3, 4), (6, 4)),
])
def test_view_dim_map_matches_brute_force(src, dst) -> None:
    mapping = _view_dim_map(src, dst)
    for i, j in mapping.items():
        assert _chunks_match(src, dst, i, j, 2), (src, dst, i, j)
    # every pair the brute force accepts with contiguous local data is found
    for i, j in itertools.product(range(len(src)), range(len(dst))):
        if src[i] > 1 and dst[j] > 1 and _chunks_match(src, dst, i, j, 2):
            x = np.arange(int(np.prod(src))).reshape(src)
            local = np.array_split(x, 2, axis=i)[0]
            contiguous = np.array_equal(np.sort(local.reshape(-1)), np.arange(local.size) + local.reshape(-1).min())
            if contiguous and np.prod(src[:i]) == 1:
                assert mapping.get(i) == j


def _graph(nodes: list[Node]) -> Graph:
    info = ModelInfo(name="t", num_parameters=0, num_layers=0, batch=1, seq=1, dtype="float32")
    return Graph(model=info, nodes=tuple(nodes), loss=len(nodes) - 1, param_grads=(), layer_groups=())


def _ph(i: int, shape: tuple[int, ...], role: Role = Role.INPUT) -> Node:
    return Node(id=i, name=f"p{i}", op="placeholder", inputs=(), args=(),
                outputs=(TensorMeta(shape=shape, dtype="float32"),), role=role, phase=Phase.FORWARD, is_view=True)


def test_mm_strategies_on_1d_and_2d_mesh() -> None:
    mm = Node(id=2, name="mm", op="aten.mm.default", inputs=(0, 1), args=(Ref(0), Ref(1)),
              outputs=(TensorMeta(shape=(16, 32), dtype="float32"),), role=Role.ACTIVATION, phase=Phase.FORWARD)
    g = _graph([_ph(0, (16, 8)), _ph(1, (8, 32)), mm])
    one = enumerate_strategies(g, (4,))[2]
    outs = {s.outputs[0] for s in one}
    assert outs == {(Replicate(),), (Shard(0),), (Shard(1),), (Partial(),)}
    two = enumerate_strategies(g, (2, 4))[2]
    assert len(two) == 16  # 4 x 4 per-axis options, all divisible here
    # a non-divisible size drops the strategies sharding it
    g3 = _graph([_ph(0, (6, 8)), _ph(1, (8, 32)), mm])
    three = enumerate_strategies(g3, (4,))[2]
    assert (Shard(0),) not in {s.outputs[0] for s in three}


def test_no_non_divisible_strategy_is_emitted_for_llama() -> None:
    graph = trace_model(resolve("llama-tiny"), batch=2)
    mesh = (2, 4)
    space = enumerate_strategies(graph, mesh)
    assert not space.fallback_ops
    for node, strategies in zip(graph.nodes, space.strategies):
        assert strategies, node.op
        for s in strategies:
            for meta, pl in zip(node.outputs, s.outputs):
                assert evenly_divisible(meta.shape, pl, mesh), (node.op, meta.shape, pl)
        # all-replicated is always available
        if node.op != "getitem":
            assert any(all(p == Replicate() for pls in s.outputs for p in pls) for s in strategies)
    sdpa = next(i for i, n in enumerate(graph.nodes) if "scaled_dot_product" in n.op)
    sharded = {s.inputs[0] for s in space[sdpa]}
    assert (Shard(0), Shard(1)) in sharded and (Replicate(), Shard(1)) in sharded  # batch x heads


def test_unknown_op_is_replicated_with_a_warning(caplog) -> None:
    odd = Node(id=1, name="odd", op="aten.weird_op.default", inputs=(0,), args=(Ref(0),),
               outputs=(TensorMeta(shape=(8, 8), dtype="float32"),), role=Role.ACTIVATION, phase=Phase.FORWARD)
    g = _graph([_ph(0, (8, 8)), odd])
    with caplog.at_level(logging.WARNING):
        space = enumerate_strategies(g, (4,))
    assert space.fallback_ops == ("aten.weird_op.default",)
    assert [s.outputs for s in space[1]] == [((Replicate(),),)]
    assert "aten.weird_op.default" in caplog.text


def test_bad_mesh_is_a_value_error() -> None:
    g = _graph([_ph(0, (8, 8))])
    with pytest.raises(ValueError, match="mesh shape"):
        enumerate_strategies(g, ())


def _local(x: np.ndarray, pl, rank: int, n: int) -> np.ndarray:
    if isinstance(pl, Shard):
        return np.array_split(x, n, axis=pl.dim)[rank]
    if isinstance(pl, Partial):  # Replicate -> Partial: one device keeps the value, the others add zero
        return x if rank == 0 else np.zeros_like(x)
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
