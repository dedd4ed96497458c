"""Intra-op ILP oracles: data parallel, FSDP, Megatron, DP x TP, determinism, infeasibility."""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.cluster import Cluster
from autopar.ir import DTYPE_BYTES, Graph, Phase, Role
from autopar.placement import Partial, Replicate, Shard, local_shape
from autopar.sharding import InfeasiblePlanError, IntraOpSolution
from autopar.precision import policy
from autopar.trace import lower, trace, with_precision
from autopar.buckets import BUCKET_BYTES
from cost_model.collectives import (all_gather_time_s, all_reduce_time_s, collective_latency_s, mesh_axis_links,
                                    reduce_scatter_time_s)
from cost_model.compute import compute_time_s
from solver.intra_op.ilp import solve_intra_op

H100x8 = Cluster.parse("h100:1x8")


class MLP(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, h, bias=False)
        self.fc2 = nn.Linear(h, d, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.fc2(F.gelu(self.fc1(x))) - y) ** 2).sum()


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (proj(x).view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, d))


class AttentionLoss(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.attn = Attention(d, heads)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.attn(x) - y) ** 2).sum()


class Layer(nn.Module):
    """A GPT layer (pre-norm attention + GELU MLP) with separate q/k/v projections."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return ((x - y) ** 2).sum()


def _graph(module_fn, *shapes: tuple[int, ...]) -> Graph:
    with FakeTensorMode():
        model = module_fn()
        inputs = tuple(torch.randn(*s) for s in shapes)
    return lower(trace(model, inputs), name=type(model).__name__, batch=shapes[0][0], seq=1)


@pytest.fixture(scope="module")
def big_mlp() -> Graph:
    return _graph(lambda: MLP(1024, 4096), (65536, 1024), (65536, 1024))


@pytest.fixture(scope="module")
def big_mlp_bf16() -> Graph:
    """`big_mlp` traced in bfloat16 under the bf16-mixed policy (the GPU profiles' default):
    weights 2 bytes, gradients reduced in float32, master and moments float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        graph = _graph(lambda: MLP(1024, 4096), (65536, 1024), (65536, 1024))
    finally:
        torch.set_default_dtype(previous)
    return with_precision(graph, policy("bf16-mixed"))


def _dp_closed_form(graph: Graph, cluster: Cluster, n: int) -> float:
    """Compute of every op on 1/n of the batch + one all-reduce per parameter gradient.

    Written independently of the ILP: a tensor is batch-sharded iff one of its dims is the
    (unique) batch size; an op's FLOPs split n ways iff it touches such a tensor."""
    batch = graph.model.batch
    (link,) = mesh_axis_links(cluster, (n,))

    def local(meta) -> float:
        div = n if batch in meta.shape else 1
        return meta.numel * DTYPE_BYTES[meta.dtype] / div

    total = 0.0
    for node in graph.nodes:
        if node.is_view or node.op == "placeholder" or (node.flops == 0 and node.bytes_moved == 0):
            continue
        metas = [graph[i].output for i in dict.fromkeys(node.inputs)] + list(node.outputs)
        split = n if any(batch in m.shape for m in metas) else 1
        total += compute_time_s(node.flops / split, sum(local(m) for m in metas), cluster.hardware,
                                graph.model.dtype, op_class="gemm" if node.flops else "memory")
    for param, _grad in graph.param_grads:
        size = graph[param].output.size_bytes
        total += _bucketed(all_reduce_time_s, "all_reduce", size, link) + _bucket_copy(size, cluster)
    return total


def _bucket_copy(size: int, cluster: Cluster) -> float:
    """Copying a gradient into its bucket's flat buffer: read it, write the buffer."""
    from cost_model.efficiency import efficiency_for

    hw = cluster.hardware
    return 2 * size / (hw.memory_bandwidth_bytes_per_s * efficiency_for(hw).memory_efficiency)


def _bucketed(time_fn, kind: str, size: int, link) -> float:
    """A gradient's reduction as priced inside a bucket (autopar/buckets.py): its bandwidth
    term plus its share size / (its bucket's bytes) of the collective's latency, so a
    bucket pays one latency. These MLPs' two 16 MiB gradients do not fit one 25 MiB bucket
    (BUCKET_BYTES): each is alone in its bucket and pays its whole collective."""
    assert 2 * size > BUCKET_BYTES
    return time_fn(size, link)


def _data_parallel(graph: Graph) -> IntraOpSolution:
    """The ILP with data parallelism forced (inputs split, parameters replicated over dp)."""
    def keep(node, placements) -> bool:
        if node.role is Role.PARAMETER:
            return placements == (Replicate(),)
        return node.role is not Role.INPUT or placements == (Shard(0),)

    return solve_intra_op(graph, H100x8, (8,), keep_placeholder=keep, keep_update=_update_in_place)


def _update_in_place(node, compute, update) -> bool:
    """No weight-update sharding: every parameter is updated in its compute placement."""
    return update == compute


def test_mlp_data_parallel_matches_closed_form_and_the_free_ilp_is_no_worse(big_mlp: Graph) -> None:
    sol = _data_parallel(big_mlp)
    assert sol.status == "optimal"
    free = solve_intra_op(big_mlp, H100x8, (8,))
    # data parallelism is one of the free ILP's choices: it finds that or better (here the
    # first weight, read only in the forward, is cheaper sharded: one gather + one
    # reduce-scatter move the bytes of one all-reduce, in fewer latency steps)
    assert free.cost.total_s <= sol.cost.total_s * (1 + 1e-9)
    for param, grad in big_mlp.param_grads:
        assert sol.choice(param).outputs == ((Replicate(),),)
    for c in sol.choices:  # every matmul works on 1/8 of the batch
        if c.op == "aten.mm.default":
            assert any(p == (Shard(0),) or p == (Shard(1),) for p in c.inputs), c
    expected = _dp_closed_form(big_mlp, H100x8, 8)
    assert sol.cost.total_s == pytest.approx(expected, rel=1e-6)
    # the reshard part is exactly the gradient all-reduces
    (link,) = mesh_axis_links(H100x8, (8,))
    grads = sum(_bucketed(all_reduce_time_s, "all_reduce", big_mlp[p].output.size_bytes, link)
                + _bucket_copy(big_mlp[p].output.size_bytes, H100x8) for p, _ in big_mlp.param_grads)
    assert sol.cost.reshard_s == pytest.approx(grads, rel=1e-9)
    # the program's gradient sync: one all-reduce per bucket (two 16 MiB gradients: two buckets)
    syncs = [c for c in sol.collectives if c.gradient_sync]
    assert [(c.kind, c.bytes) for c in syncs] == [("all_reduce", 16 * 2**20)] * 2


def test_mlp_under_memory_budget_is_fsdp(big_mlp: Graph) -> None:
    """Where each parameter is updated in its compute placement (no weight-update sharding),
    half the replicated state is saved by sharding the weights: FSDP, priced exactly."""
    dp = _data_parallel(big_mlp)
    replicated_state = sum(16 * big_mlp[p].output.numel for p, _ in big_mlp.param_grads)
    budget = dp.cost.peak_memory_bytes - replicated_state / 2
    sol = solve_intra_op(big_mlp, H100x8, (8,), memory_budget_bytes=budget, keep_update=_update_in_place)
    assert sol.cost.peak_memory_bytes <= budget
    (link,) = mesh_axis_links(H100x8, (8,))
    expected_comm = 0.0
    readers_of = {param: [c for c in sol.choices if c.op == "aten.mm.default" and c.reshard_s > 0
                          and _reads_param(big_mlp, c.node, param)] for param, _ in big_mlp.param_grads}
    # the weights read in one phase (forward, backward) are gathered together: each pays
    # its share of one all-gather latency (autopar/buckets.py)
    phase_bytes: dict[Phase, int] = {}
    for param, readers in readers_of.items():
        for phase in {big_mlp[c.node].phase for c in readers}:
            phase_bytes[phase] = phase_bytes.get(phase, 0) + big_mlp[param].output.size_bytes
    gather_latency = collective_latency_s("all_gather", link)
    for param, _grad in big_mlp.param_grads:
        (placement,) = sol.choice(param).outputs[0]
        assert isinstance(placement, Shard), f"parameter {param} not sharded: {placement}"
        size = big_mlp[param].output.size_bytes
        # one reduce-scatter of the gradient, one all-gather per matmul reading the weight
        readers = readers_of[param]
        assert readers, "the sharded weight must be all-gathered before its matmuls"
        expected_comm += _bucketed(reduce_scatter_time_s, "reduce_scatter", size, link) + _bucket_copy(size, H100x8)
        for c in readers:
            share = size / phase_bytes[big_mlp[c.node].phase]
            expected_comm += all_gather_time_s(size, link) - gather_latency + gather_latency * share
            # the group's copies: the shard packed into its flat buffer (1/8 of the weight),
            # the weight concatenated out of the gathered rows (all of it)
            expected_comm += _bucket_copy(size, H100x8) * (1 + 1 / 8)
    assert sol.cost.reshard_s == pytest.approx(expected_comm, rel=1e-9)
    assert sol.cost.total_s > dp.cost.total_s


def test_mlp_under_memory_budget_shards_the_weight_update(big_mlp_bf16: Graph) -> None:
    """A budget below DP's peak by half its model state, with weight-update sharding in the
    space, under bf16-mixed (18 bytes per element replicated: bf16 weight, fp32 master,
    gradient and two moments). Forced to keep the weights whole and shard their update over
    the 8 ranks (ZeRO-1: the bf16 weight and the fp32 raw gradient whole, 2 + 4 bytes, the
    master and moments sharded, 12/8), the plan pays per step one reduce-scatter of each
    gradient (float32: the policy's reduction dtype) and one all-gather of the updated
    weights (bfloat16: the master shard is cast, then gathered; closed form below), which
    costs less than FSDP's gathers per use and than DP's float32 all-reduce; the free ILP finds that price: a weight read in
    the forward and the backward takes ZeRO-1 (one gather per step, not two), the first
    layer's weight (read in the forward only: one gather either way) ties with FSDP."""
    big_mlp = big_mlp_bf16
    dp = _data_parallel(big_mlp)
    replicated_state = sum(18 * big_mlp[p].output.numel for p, _ in big_mlp.param_grads)
    budget = dp.cost.peak_memory_bytes - replicated_state / 2
    fsdp = solve_intra_op(big_mlp, H100x8, (8,), memory_budget_bytes=budget, keep_update=_update_in_place)
    sol = solve_intra_op(big_mlp, H100x8, (8,), memory_budget_bytes=budget,
                         keep_update=lambda node, compute, update: compute == (Replicate(),) and update != compute)
    (link,) = mesh_axis_links(H100x8, (8,))
    gather_latency = collective_latency_s("all_gather", link)
    # the updated weights of one layer (here: all of them) are gathered in one flat
    # all-gather: each pays its share of one latency, and the copies in and out of the buffer
    layer_bytes: dict = {}
    for param, _grad in big_mlp.param_grads:
        layer = big_mlp[param].layer
        layer_bytes[layer] = layer_bytes.get(layer, 0) + big_mlp[param].output.size_bytes
    expected_comm = 0.0
    for param, grad in big_mlp.param_grads:
        choice = sol.choice(param)
        assert isinstance(choice.update[0], Shard), (choice.outputs, choice.update)
        size = big_mlp[param].output.size_bytes
        grad_size = 4 * big_mlp[grad].output.numel
        assert size == 2 * big_mlp[param].output.numel
        # the parameter charges its weight and sharded master and moments, its gradient node
        # the raw float32 gradient, whole (a pending sum over dp until the step's sync)
        assert choice.memory_bytes == pytest.approx(big_mlp[param].output.numel * (2 + 12 / 8))
        assert sol.choice(grad).memory_bytes == pytest.approx(grad_size)
        expected_comm += _bucketed(reduce_scatter_time_s, "reduce_scatter", grad_size, link) \
            + _bucket_copy(grad_size, H100x8)
        share = size / layer_bytes[big_mlp[param].layer]
        expected_comm += all_gather_time_s(size, link) - gather_latency + gather_latency * share \
            + _bucket_copy(size, H100x8) * (1 + 1 / 8)
    assert sol.cost.reshard_s == pytest.approx(expected_comm, rel=1e-9)
    assert sol.cost.peak_memory_bytes <= budget
    # cheaper than FSDP (one gather per step, not one per use), and under bf16-mixed cheaper
    # than DP too: DP's all-reduce moves the fp32 gradient twice (a reduce-scatter and an
    # all-gather of fp32), ZeRO-1 gathers the bf16 weights
    assert sol.cost.total_s < dp.cost.total_s < fsdp.cost.total_s
    once = sorted((c.kind, c.bytes) for c in sol.collectives if c.gradient_sync)
    gathers = [("all_gather", nbytes) for nbytes in layer_bytes.values()]
    assert once == sorted([("reduce_scatter", 16 * 2**20)] * 2 + gathers)
    assert not [c for c in sol.collectives if not c.gradient_sync and c.kind == "all_gather"]
    free = solve_intra_op(big_mlp, H100x8, (8,), memory_budget_bytes=budget)
    assert free.cost.total_s == pytest.approx(sol.cost.total_s, rel=1e-9)
    read_twice = [p for p, _ in big_mlp.param_grads
                  if len({big_mlp[c.node].phase for c in free.choices if c.op == "aten.mm.default"
                          and _reads_param(big_mlp, c.node, p)}) == 2]
    assert read_twice
    for p in read_twice:
        assert free.choice(p).outputs[0] == (Replicate(),) and isinstance(free.choice(p).update[0], Shard)


def _reads_param(graph: Graph, node_id: int, param: int) -> bool:
    """True if `node_id` consumes `param` through a chain of views."""
    for src in graph[node_id].inputs:
        while graph[src].is_view and graph[src].op != "placeholder":
            src = graph[src].inputs[0]
        if src == param:
            return True
    return False


def _forward_reductions(graph: Graph, sol: IntraOpSolution) -> list[int]:
    """Forward nodes that read a Partial input as non-Partial (a reduction collective)."""
    found = []
    for c in sol.choices:
        node = graph[c.node]
        if node.phase is not Phase.FORWARD:
            continue
        for src, want in zip(node.inputs, c.inputs):
            have = sol.choice(src).outputs[0] if len(graph[src].outputs) == 1 else None
            if have is not None and any(isinstance(a, Partial) and not isinstance(b, Partial)
                                        for a, b in zip(have, want)):
                found.append(c.node)
    return found


def _param(graph: Graph, name: str) -> int:
    return next(n.id for n in graph.by_role(Role.PARAMETER) if n.param_name == name)


def test_transformer_mlp_is_megatron_on_tp_axis() -> None:
    # few tokens, wide layers: the weights are much bigger than the activations
    graph = _graph(lambda: MLP(4096, 16384), (256, 4096), (256, 4096))
    sol = solve_intra_op(graph, H100x8, (8,))
    assert sol.choice(_param(graph, "fc1.weight")).outputs[0] == (Shard(0),)  # column parallel
    assert sol.choice(_param(graph, "fc2.weight")).outputs[0] == (Shard(1),)  # row parallel
    assert len(_forward_reductions(graph, sol)) == 1


def test_attention_shards_heads_on_tp_axis() -> None:
    graph = _graph(lambda: AttentionLoss(4096, 32), (1, 256, 4096), (1, 256, 4096))
    sol = solve_intra_op(graph, H100x8, (8,))
    for name in ("attn.q.weight", "attn.k.weight", "attn.v.weight"):
        assert sol.choice(_param(graph, name)).outputs[0] == (Shard(0),), name
    sdpa = [c for c in sol.choices if "scaled_dot_product" in c.op and "backward" not in c.op]
    assert sdpa and all(p == (Shard(1),) for p in sdpa[0].inputs)  # heads
    # after attention the heads meet the out-projection: Megatron's row-parallel split
    # (one all-reduce of the output) or, cheaper here where the elementwise loss keeps the
    # hidden dim split, a column-parallel one after an all-gather of the heads (half the
    # ring traffic). Either way one forward collective, and the weight stays sharded.
    assert isinstance(sol.choice(_param(graph, "attn.o.weight")).outputs[0][0], Shard)
    forward = [c for c in sol.collectives if graph[c.dst].phase is Phase.FORWARD and not c.gradient_sync]
    assert len(forward) == 1 and forward[0].kind in ("all_reduce", "all_gather"), forward


def test_gpt_layer_on_2d_mesh_is_dp_times_tp() -> None:
    # 4 nodes x 8: mesh axis 1 is a node's NVLink, axis 0 crosses the network. With 16k
    # tokens of d=4096 the activations are too big to all-reduce across nodes (TP there
    # loses) and the weights too big to all-reduce whole (pure DP loses): Megatron TP
    # inside a node, DP across nodes. (On h100:1x16 (2, 8) both axes are NVLink and the
    # attention, with half the MLP's weights per reduction, genuinely prefers the 8-way
    # axis for the batch: no single TP axis is optimal there.)
    cluster = Cluster.parse("h100:4x8")
    batch, seq = 8, 2048
    graph = _graph(lambda: Layer(4096, 32), (batch, seq, 4096), (batch, seq, 4096))
    sol = solve_intra_op(graph, cluster, (4, 8))
    assert sol.status == "optimal"
    dp, tp = 0, 1

    def dp_ok(p) -> bool:
        return p == Replicate() or isinstance(p, Shard)  # DP, or ZeRO/FSDP on the DP axis

    for name in ("attn.q.weight", "attn.k.weight", "attn.v.weight", "fc1.weight"):
        pl = sol.choice(_param(graph, name)).outputs[0]
        assert pl[tp] == Shard(0) and dp_ok(pl[dp]), (name, pl)  # column parallel
    for name in ("attn.o.weight", "fc2.weight"):
        pl = sol.choice(_param(graph, name)).outputs[0]
        assert pl[tp] == Shard(1) and dp_ok(pl[dp]), (name, pl)  # row parallel
    for c in sol.choices:
        node = graph[c.node]
        if node.phase is not Phase.FORWARD or node.role is not Role.ACTIVATION:
            continue
        if node.op in ("aten.mm.default", "aten.addmm.default"):  # every matmul reads its weight TP-sharded
            weight = c.inputs[-1]
            assert isinstance(weight[tp], Shard) and dp_ok(weight[dp]), (node.name, weight)
        if node.op != "aten.t.default" and node.outputs[0].shape[:1] in ((batch,), (batch * seq,)):
            assert c.outputs[0][dp] == Shard(0), (node.name, c.outputs[0])  # batch on the DP axis
    sdpa = next(c for c in sol.choices if "scaled_dot_product" in c.op)
    assert all(p == (Shard(0), Shard(1)) for p in sdpa.inputs)  # batch x heads
    # one forward reduction per block (attention out-projection, fc2), on the TP axis only
    reductions = _forward_reductions(graph, sol)
    assert len(reductions) == 2, reductions
    for nid in reductions:
        for src, want in zip(graph[nid].inputs, sol.choice(nid).inputs):
            have = sol.choice(src).outputs[0]
            assert not isinstance(have[dp], Partial) or isinstance(want[dp], Partial)


def test_same_inputs_give_byte_identical_json() -> None:
    graph = _graph(lambda: MLP(256, 1024), (4096, 256), (4096, 256))
    first = solve_intra_op(graph, H100x8, (2, 4))
    second = solve_intra_op(graph, H100x8, (2, 4))
    assert first.to_json() == second.to_json()
    again = IntraOpSolution.from_json(first.to_json())
    assert again == first and again.to_json() == first.to_json()
    assert "aten.mm.default" in first.explain()


def test_cbc_agrees_with_highs() -> None:
    graph = _graph(lambda: MLP(256, 1024), (4096, 256), (4096, 256))
    highs = solve_intra_op(graph, H100x8, (8,), solver="highs")
    cbc = solve_intra_op(graph, H100x8, (8,), solver="cbc")
    assert cbc.cost.total_s == pytest.approx(highs.cost.total_s, rel=1e-6)


def test_infeasible_budget_names_the_smallest_memory(big_mlp: Graph) -> None:
    with pytest.raises(InfeasiblePlanError) as info:
        solve_intra_op(big_mlp, H100x8, (8,), memory_budget_bytes=1e6)
    need = info.value.min_memory_bytes
    assert isinstance(info.value, ValueError) and "smallest needs" in str(info.value)
    # the smallest plan shards every tensor 8 ways; a budget just above it is feasible
    sol = solve_intra_op(big_mlp, H100x8, (8,), memory_budget_bytes=need * 1.001)
    assert sol.cost.peak_memory_bytes <= need * 1.001
    with pytest.raises(InfeasiblePlanError):
        solve_intra_op(big_mlp, H100x8, (8,), memory_budget_bytes=need * 0.99)
    params = sum(16 * big_mlp[p].output.numel for p, _ in big_mlp.param_grads)
    assert need >= params / 8


def test_a_configuration_leaving_a_parameter_no_layout_is_infeasible(big_mlp: Graph) -> None:
    """A forced configuration that no layout of some parameter obeys has no plan: an
    InfeasiblePlanError (which a search skips, as any other infeasible stage layout) that
    names the parameter, still a ValueError for the commands that exit 2 on it."""
    def keep(node, placements) -> bool:
        return node.role is not Role.PARAMETER

    with pytest.raises(InfeasiblePlanError, match="leaves no layout for parameter") as info:
        solve_intra_op(big_mlp, H100x8, (8,), keep_placeholder=keep)
    assert isinstance(info.value, ValueError)


def test_unknown_solver_is_a_value_error(big_mlp: Graph) -> None:
    with pytest.raises(ValueError, match="unknown solver"):
        solve_intra_op(big_mlp, H100x8, (8,), solver="gurobi")


def test_subgraph_restriction_only_reports_those_nodes(big_mlp: Graph) -> None:
    nodes = tuple(range(0, len(big_mlp) // 2))
    sol = solve_intra_op(big_mlp, H100x8, (8,), nodes=nodes)
    assert tuple(c.node for c in sol.choices) == nodes
    assert math.isfinite(sol.cost.total_s)
    assert local_shape((8, 8), (Shard(0),), (8,)) == (1, 8)


def test_ilp_objective_is_the_reported_cost(caplog, monkeypatch) -> None:
    # a repeated objective term once overwrote instead of adding (PuLP keeps the last
    # coefficient of a repeated variable in LpAffineExpression(list)): the ILP minimised
    # a different function than the plan's cost (1.3158 vs 1.3238 ms here). The objective
    # charges a gradient its share of an expected bucket's latency, the report its share of
    # its real bucket's (they differ where gradients of one graph sync over different mesh
    # axes, as here): both charge the same share here, so the two must agree exactly.
    import solver.intra_op.edges as edges
    import solver.intra_op.solution as solution

    def shares(graph, syncs, pricer):
        return {g: graph[g].output.size_bytes / BUCKET_BYTES for g, _s, _d in syncs}

    monkeypatch.setattr(solution, "gradient_bucket_shares", shares)
    monkeypatch.setattr(edges, "expected_bucket_bytes",
                        lambda graph: {g: (float(BUCKET_BYTES),) * 2 for _p, g in graph.param_grads})
    graph = _graph(lambda: Layer(1024, 4), (16, 512, 1024), (16, 512, 1024))
    with caplog.at_level(logging.INFO, logger="solver.intra_op.ilp"):
        sol = solve_intra_op(graph, Cluster.parse("h100:1x16"), (2, 8))
    (line,) = [r.getMessage() for r in caplog.records if "extracted" in r.getMessage()]
    objective_s, extracted_s = (float(x) for x in re.search(r"objective (\S+) s \(extracted (\S+) s\)", line).groups())
    assert extracted_s == pytest.approx(sol.cost.total_s, rel=1e-5)
    assert objective_s == pytest.approx(sol.cost.total_s, rel=1e-5)  # tie-breaks are ~1e-10 s


def test_a_small_gradient_bucket_pays_one_whole_latency(caplog) -> None:
    """A model whose gradients fill less than one bucket still runs one all-reduce for them
    (autopar/buckets.py): the plan's price charges that collective's whole latency, once,
    not bytes / BUCKET_BYTES of it (which priced a small model's data parallelism, and more
    so ZeRO's one reduce-scatter per layer, as if its gradient sync had almost no latency).
    On a 1-D data-parallel mesh every gradient shares one bucket, so the ILP's expected
    bucket is the real one and its objective is the reported cost."""
    graph = _graph(lambda: MLP(64, 256), (512, 64), (512, 64))
    cluster = Cluster.parse("cpu:4")

    def keep(node, placements) -> bool:
        if node.role is Role.PARAMETER:
            return placements == (Replicate(),)
        return node.role is not Role.INPUT or placements == (Shard(0),)

    with caplog.at_level(logging.INFO, logger="solver.intra_op.ilp"):
        sol = solve_intra_op(graph, cluster, (4,), keep_placeholder=keep)
    syncs = [c for c in sol.collectives if c.gradient_sync]
    total = sum(graph[p].output.size_bytes for p, _ in graph.param_grads)
    assert total < BUCKET_BYTES / 100
    assert [(c.kind, c.bytes) for c in syncs] == [("all_reduce", total)]
    from cost_model import bucket_copy_s_per_byte

    (link,) = mesh_axis_links(cluster, (4,))
    latency = collective_latency_s("all_reduce", link)
    expected = latency + sum(all_reduce_time_s(graph[p].output.size_bytes, link) - latency
                             + bucket_copy_s_per_byte(cluster) * graph[p].output.size_bytes for p, _ in graph.param_grads)
    grad_sync = sum(c.reshard_s * c.weight for c in sol.choices if graph[c.node].role is Role.PARAMETER)
    assert grad_sync == pytest.approx(expected, rel=1e-9)
    assert latency > 0.5 * expected  # the latency is most of it: the old share left 99% out
    (line,) = [r.getMessage() for r in caplog.records if "extracted" in r.getMessage()]
    objective_s, extracted_s = (float(x) for x in re.search(r"objective (\S+) s \(extracted (\S+) s\)", line).groups())
    assert extracted_s == pytest.approx(sol.cost.total_s, rel=1e-5)
    assert objective_s == pytest.approx(sol.cost.total_s, rel=1e-5)


_NATIVE_PRINT_SCRIPT = """
import ctypes, sys
from solver.intra_op.backend import native_stdout_to_stderr
libc = ctypes.CDLL(None)
print("before", flush=True)
with native_stdout_to_stderr():
    libc.printf(b"banner from native code\\n")  # as HiGHS >= 1.16 prints from its constructor
print("after", flush=True)
import pulp
prob = pulp.LpProblem("p", pulp.LpMinimize)
x = pulp.LpVariable("x", 0, 1, cat="Binary")
prob += x
prob += x >= 0
with native_stdout_to_stderr():
    prob.solve(pulp.HiGHS(msg=False))  # the process's first Highs object: HiGHS's banner
"""


def test_native_solver_output_stays_off_stdout() -> None:
    """A solver's native banner must not reach stdout (where `search --json` and plans go),
    even when stdout is a pipe (C stdio buffers it): it goes to stderr; HiGHS's own banner
    (printed by the first Highs object a process makes) appears nowhere."""
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-c", _NATIVE_PRINT_SCRIPT], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "before\nafter\n"
    assert "banner from native code" in proc.stderr
    assert "HiGHS" not in proc.stdout + proc.stderr, proc.stderr


@pytest.mark.parametrize("spec,mesh,zero", [
    ("llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32", (2, 2), 0),
    ("llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32", (4, 2), 3),
    ("gpt:layers=4,hidden=64,heads=4,vocab=128,seq=32", (2, 2), 0),
    ("moe:layers=2,hidden=64,heads=4,kv_heads=2,vocab=128,seq=16,experts=4,top_k=2,expert_ffn=64", (4, 1), 3),
])
def test_gather_free_pruning_keeps_every_usable_strategy(spec, mesh, zero, monkeypatch) -> None:
    """prune_gather_free drops only strategies no plan can use on a data-parallel axis: the
    unpruned ILP's every choice survives it, the space shrinks by more than half, and on these
    models the optimum is the same with and without it."""
    from autopar.config import ParallelConfig
    from autopar.models import resolve
    from autopar.trace import trace_model
    from solver import forced
    from solver.intra_op import ilp
    from solver.intra_op.space import enumerate_strategies

    graph = trace_model(resolve(spec), batch=2 * mesh[0], dtype="float32", layers_traced=2)
    config = ParallelConfig(dp=mesh[0], tp=mesh[1], zero=zero)
    cluster = Cluster.parse(f"cpu:1x{mesh[0] * mesh[1]}")
    whole = ilp.restrict_placeholders(graph, enumerate_strategies(graph, mesh), forced.keep_placeholder(config))
    pruned = ilp.prune_gather_free(graph, whole, forced.gather_free_axes(config), gloo=True)
    assert pruned.num_strategies * 2 < whole.num_strategies, (pruned.num_strategies, whole.num_strategies)
    with_pruning = forced.solve_stage(graph, config, cluster, num_microbatches=2)
    monkeypatch.setattr(ilp, "prune_gather_free", lambda graph, space, axes, gloo, memo=None, exchange=None: space)
    without = forced.solve_stage(graph, config, cluster, num_microbatches=2)
    for c in without.choices:
        assert any(s.outputs == c.outputs and s.inputs == c.inputs for s in pruned[c.node]), graph[c.node]
    assert with_pruning.cost.total_s == pytest.approx(without.cost.total_s, rel=1e-9)
    assert with_pruning.num_variables < without.num_variables


def test_equal_divisibility_signatures_give_equal_strategy_spaces() -> None:
    """The pipeline search enumerates strategies once per divisibility signature, not per
    microbatch (solver/pipeline_search.py): wherever two microbatches' signatures match on a
    mesh, the enumerations match; where they differ the test sees both kinds."""
    from autopar.ir import extrapolate_batch
    from autopar.models import resolve
    from autopar.trace import trace_model
    from solver.intra_op.space import divisibility_signature, enumerate_strategies

    src = resolve("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=32")
    two, four = (trace_model(src, batch=b) for b in (2, 4))
    graphs = {g: extrapolate_batch(two, four, g) for g in (2, 4, 8, 16)}
    shared = distinct = 0
    for mesh in ((2, 2), (4, 1), (2, 4)):
        seen: dict[tuple, object] = {}
        for g, graph in graphs.items():
            if g % mesh[0]:
                continue
            sig = divisibility_signature(graph, mesh)
            space = enumerate_strategies(graph, mesh)
            if sig in seen:
                shared += 1
                assert space == seen[sig], (mesh, g)
            else:
                distinct += 1
                seen[sig] = space
    assert shared >= 3 and distinct >= 4


def test_candidates_memoised_across_microbatches_equal_a_fresh_enumeration() -> None:
    """The enumeration memo (solver/intra_op/space.py `_Enumerator.key`: sizes keyed by their
    divisibility, shared across graphs) gives each graph what a cold enumeration gives it,
    for the microbatches a search traces one model at (a Llama, 2- and 3-axis meshes)."""
    from autopar.ir import extrapolate_batch
    from autopar.models import resolve
    from autopar.trace import trace_model
    from solver.intra_op import space as sp

    for spec in ("llama:layers=1,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=32",):
        src = resolve(spec)
        two, four = (trace_model(src, batch=b) for b in (2, 4))
        graphs = [two, four] + [extrapolate_batch(two, four, g) for g in (24, 32)]
        for mesh in ((4, 2), (2, 2, 2)):
            sp._CANDIDATES.clear()
            warm = [sp.enumerate_strategies(graph, mesh) for graph in graphs]  # each after the others' nodes
            hits = len(sp._CANDIDATES[sp.mesh_class(mesh)])
            for graph, got in zip(graphs, warm):
                sp._CANDIDATES.clear()
                assert sp.enumerate_strategies(graph, mesh) == got, (spec, mesh, graph.model.batch)
            assert hits < sum(len(g.nodes) for g in graphs) / 4  # the memo is shared, not per graph
        # one memo across the submeshes of one class (a pipeline search's stages): each space
        # is what a cold enumeration on that mesh gives
        meshes = ((4, 2), (2, 4), (16, 8), (3, 2), (32, 1))
        sp._CANDIDATES.clear()
        warm = {(mesh, i): sp.enumerate_strategies(graph, mesh) for mesh in meshes for i, graph in enumerate(graphs)
                if i in (0, 3)}
        for (mesh, i), got in warm.items():
            sp._CANDIDATES.clear()
            assert sp.enumerate_strategies(graphs[i], mesh) == got, (spec, mesh, graphs[i].model.batch)


def test_memoised_gather_free_pruning_is_the_pass_it_stands_for() -> None:
    """prune_gather_free's memo (the pipeline search shares one pass between the ZeRO
    layouts of a stage and the microbatches of one divisibility signature) returns what
    the pass itself returns for each of them, and it is shared."""
    from autopar.config import ParallelConfig
    from autopar.ir import extrapolate_batch
    from autopar.models import resolve
    from autopar.trace import trace_model
    from solver import forced
    from solver.intra_op.restrict import prune_gather_free, restrict_placeholders
    from solver.intra_op.space import enumerate_strategies

    src = resolve("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=32")
    two, four = (trace_model(src, batch=b) for b in (2, 4))
    g8, g16 = extrapolate_batch(two, four, 8), extrapolate_batch(two, four, 16)
    space = enumerate_strategies(g8, (2, 2))  # g16 has the same divisibility signature on (2, 2)
    memo: dict = {}
    calls = 0
    for graph in (g8, g16):
        got_by_zero = {}
        for zero in (0, 3):
            config = ParallelConfig(dp=2, tp=2, zero=zero)
            restricted = restrict_placeholders(graph, space, forced.keep_placeholder(config))
            axes = forced.gather_free_axes(config)
            want = prune_gather_free(graph, restricted, axes, gloo=True)
            got = got_by_zero[zero] = prune_gather_free(graph, restricted, axes, gloo=True, memo=memo)
            calls += 1
            assert got == want, (graph.model.batch, zero)
            assert sum(map(len, want.strategies)) < sum(map(len, restricted.strategies))  # it prunes
        # the layouts' spaces share every non-placeholder list object (what cost_table's memo keys by)
        zero0, zero3 = got_by_zero[0].strategies, got_by_zero[3].strategies
        assert all(zero0[n.id] is zero3[n.id] for n in graph.nodes if n.op != "placeholder")
    passes = [k for k in memo if not isinstance(k[0], str)]  # beside the shared reshards and sublists
    assert 1 <= len(passes) < calls
    # cost_table's rows memoised by list identity: each table is the one a fresh call gives
    from cost_model.table import cost_table

    cluster = Cluster.parse("h100:1x4")
    for zero in (0, 3, 0):
        restricted = restrict_placeholders(g8, space, forced.keep_placeholder(ParallelConfig(dp=2, tp=2, zero=zero)))
        pruned = prune_gather_free(g8, restricted, (0,), gloo=True, memo=memo)
        assert cost_table(g8, pruned, cluster, memo=memo) == cost_table(g8, pruned, cluster), zero


class SquareTwice(nn.Module):
    """One weight read by two matmuls of the same phase (x @ w, then h @ w)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(d, d))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (((F.gelu(x @ self.w) @ self.w) - y) ** 2).sum()


def test_a_weight_read_twice_in_one_phase_pays_one_gather() -> None:
    """The runtime gathers each parameter-derived tensor once per group (codegen/apply.py
    `_gather_groups`); the solution's price charges it once too, not once per reader."""
    from cost_model.table import ReshardPricer, bucket_copy_s_per_byte

    graph = _graph(lambda: SquareTwice(2048), (8192, 2048), (8192, 2048))

    def keep(node, placements) -> bool:  # ZeRO-3-like: the weight sharded, the batch split
        if node.role is Role.TANGENT:
            return True
        return placements == (Shard(0),)

    sol = solve_intra_op(graph, H100x8, (8,), keep_placeholder=keep)
    assert sol.status == "optimal"
    (param, _), = graph.param_grads
    readers = [v for v in graph.nodes if v.op == "aten.mm.default" and param in v.inputs]
    assert len(readers) == 2 and len({v.phase for v in readers}) == 1
    dsts = {sol.choice(v.id).inputs[v.inputs.index(param)] for v in readers}
    src = sol.choice(param).outputs[0]
    # both read the whole weight (one gather serves both), not a shard of it
    assert dsts == {(Replicate(),)} and src == (Shard(0),), (src, dsts)
    (link,) = mesh_axis_links(H100x8, (8,))
    pricer = ReshardPricer((link,), copy_s_per_byte=bucket_copy_s_per_byte(H100x8))
    meta = graph[param].output
    once = pricer.gather_time(meta, src, (Replicate(),), 1.0)  # the group's one member: one whole latency
    assert once is not None and once > 0
    charged = [sol.choice(v.id).reshard_s for v in readers]
    assert sum(charged) == pytest.approx(once, rel=1e-9), charged
    gathers = [c for c in sol.collectives if c.kind == "all_gather" and c.src == param]
    assert len(gathers) == 1 and gathers[0].bytes == meta.size_bytes


def test_zero_2_syncs_every_microbatch_into_zero_1_layout() -> None:
    """`--zero 1` and `--zero 2` place every weight alike (whole over dp, its update sharded
    over it); zero 1 accumulates the gradients whole and reduce-scatters them once per step,
    zero 2 reduce-scatters every microbatch's and accumulates the shards: the same
    collectives m times per step, a quarter of the gradient bytes, and the gradient edges
    priced per microbatch. `--zero 0` updates every weight whole and `--zero 3` computes
    with sharded weights."""
    from autopar.config import ParallelConfig
    from autopar.models import resolve
    from autopar.placing import priced_per_step
    from autopar.sharding import raw_gradient_bytes
    from autopar.trace import trace_model
    from solver.forced import solve_one_stage

    graph = trace_model(resolve("llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,vocab=64,seq=16"), batch=4,
                        dtype="float32")
    cpu4 = Cluster.parse("cpu:4")
    m = 2
    solved = {z: solve_one_stage(graph, ParallelConfig(dp=4, zero=z), cpu4, num_microbatches=m) for z in (0, 1, 2, 3)}
    one, two = solved[1], solved[2]
    assert [(c.outputs, c.inputs, c.update) for c in one.choices] == [(c.outputs, c.inputs, c.update)
                                                                        for c in two.choices]
    assert not one.grads_each_microbatch and two.grads_each_microbatch
    assert one.grad_sync_weight == 1 / m and two.grad_sync_weight == 1
    ran1, ran2 = priced_per_step(one, m, ("dp", "tp")), priced_per_step(two, m, ("dp", "tp"))
    calls1, bytes1 = ran1[("reduce_scatter", "dp")]
    assert ran2[("reduce_scatter", "dp")] == (m * calls1, m * bytes1)
    assert ran2[("all_gather", "dp")] == ran1[("all_gather", "dp")]  # the updated weights, once per step
    assert sum(raw_gradient_bytes(graph, two).values()) == pytest.approx(sum(raw_gradient_bytes(graph, one).values()) / 4,
                                                                         rel=0.05)
    for p, _ in graph.param_grads:
        zero0, zero1, zero3 = (solved[z].choice(p) for z in (0, 1, 3))
        assert zero0.update is None and isinstance(zero0.outputs[0][0], Replicate)
        assert isinstance(zero1.outputs[0][0], Replicate) and isinstance(zero1.update[0], Shard)
        assert isinstance(zero3.outputs[0][0], Shard) and zero3.update is None


def test_importing_the_ilp_keeps_no_stack_alive():
    """PuLP keeps the exceptions of the optional solvers it probed at import (as class
    attributes, e.g. `COPT_DLL.err`); each traceback held the whole stack of the first
    `import pulp`, a solving rank's build included. After the ILP's import none is left
    with its frames, and the messages PuLP shows stay."""
    import sys

    import pulp

    import solver.intra_op.ilp  # noqa: F401 (its import releases the frames)
    from solver.intra_op import backend

    kept = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "pulp" or name.startswith("pulp.")):
            continue
        for value in vars(module).values():
            found = [value] if isinstance(value, BaseException) else \
                [v for v in vars(value).values() if isinstance(v, BaseException)] if isinstance(value, type) else []
            kept += [(name, exc) for exc in found]
    assert all(exc.__traceback__ is None for _, exc in kept), [n for n, e in kept if e.__traceback__ is not None]
    assert all(str(exc) for _, exc in kept)

    class Probe(Exception):
        pass

    def probe():  # a stored exception with a traceback, as PuLP stores them
        try:
            raise Probe("not available")
        except Probe as exc:
            return exc

    pulp.apis.Probe = type("ProbeSolver", (), {"err": probe()})
    try:
        assert backend._release_import_frames(pulp) == 1
        assert pulp.apis.Probe.err.__traceback__ is None and str(pulp.apis.Probe.err) == "not available"
    finally:
        del pulp.apis.Probe
