"""The zoo's mixture of experts (autopar/models/moe.py): routing, presets, and expert
parallelism as a placement the ILP chooses and prices.

Oracles: the static GShard routing equals a token-by-token loop over the same priority
order; Mixtral 8x7B's published parameter count (46.7B, arXiv 2401.04088); the ILP's
dispatch and combine reshards are DTensor's all-to-alls, priced as such on a GPU
profile and as the all-gather + chunk DTensor runs on gloo.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from autopar.cluster import HARDWARE, Cluster
from autopar.config import ParallelConfig
from autopar.models import parse_spec, resolve
from autopar.models.moe import MoEConfig, capacity, route
from autopar.placement import Replicate, Shard
from autopar.trace import trace_model
from cost_model.table import reshard_collectives
from solver.forced import solve_one_stage

TINY = "moe:layers=2,hidden=64,heads=4,kv_heads=2,vocab=128,seq=16,experts=4,top_k=2,expert_ffn=64"


def _loop_route(logits: torch.Tensor, top_k: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GShard's Algorithm 1 as a loop: first choices of every token in order, then second
    choices, ...; a choice whose expert already holds `slots` tokens of the group is dropped."""
    g, s, e = logits.shape
    probs = logits.float().softmax(-1)
    top_p, top_i = probs.topk(top_k, dim=-1)
    gates = top_p / top_p.sum(-1, keepdim=True)
    dispatch = torch.zeros(g, s, e, slots)
    combine = torch.zeros(g, s, e, slots)
    for gi in range(g):
        filled = [0] * e
        for k in range(top_k):
            for si in range(s):
                expert = int(top_i[gi, si, k])
                if filled[expert] < slots:
                    dispatch[gi, si, expert, filled[expert]] = 1.0
                    combine[gi, si, expert, filled[expert]] = gates[gi, si, k]
                    filled[expert] += 1
    return dispatch, combine


@pytest.mark.parametrize("top_k, capacity_factor", [(1, 1.0), (2, 1.25), (2, 0.5), (3, 2.0)])
def test_static_routing_equals_the_token_loop(top_k, capacity_factor):
    torch.manual_seed(top_k)
    logits = torch.randn(3, 24, 6) * 3  # skewed: some experts overflow at low capacity
    slots = capacity(24, top_k, 6, capacity_factor)
    dispatch, combine, aux = route(logits, top_k, slots)
    want_dispatch, want_combine = _loop_route(logits, top_k, slots)
    torch.testing.assert_close(dispatch, want_dispatch, rtol=0, atol=0)
    torch.testing.assert_close(combine, want_combine)
    assert dispatch.sum(dim=(1, 3)).max() <= slots  # no expert over capacity in any group
    assert dispatch.sum(dim=(2, 3)).max() <= top_k
    assert aux.item() >= 0.0


def test_balance_loss_is_one_for_a_uniform_router():
    """Switch Transformer eq. 4 (top-k counts, as GShard): E * sum_e f_e * P_e = 1 when
    every expert gets the same share of choices and of probability."""
    e, k = 4, 2
    logits = torch.zeros(1, 8, e)
    # ties broken by topk's order would pick experts 0 and 1 for every token: make each
    # token's pair rotate so counts are uniform, with near-uniform probabilities
    for s in range(8):
        logits[0, s, (2 * s) % e] += 1e-4
        logits[0, s, (2 * s + 1) % e] += 1e-4
    _, _, aux = route(logits, k, capacity(8, k, e, 1.0))
    assert aux.item() == pytest.approx(1.0, abs=1e-3)


def test_capacity_policy():
    assert capacity(4096, 2, 8, 1.25) == 1280  # Mixtral-like: ceil(1.25 * 4096 * 2 / 8)
    assert capacity(16, 2, 4, 1.25) == 10
    assert capacity(4, 8, 2, 4.0) == 4  # never more slots than the group has tokens
    assert capacity(1, 1, 64, 1.0) == 1


def test_specs_and_their_errors():
    cfg = parse_spec(TINY)
    assert isinstance(cfg, MoEConfig) and cfg.experts == 4 and cfg.top_k == 2 and cfg.capacity == 10
    with pytest.raises(ValueError, match="missing experts"):
        parse_spec("moe:layers=2,hidden=64,heads=4,vocab=128,seq=16")
    with pytest.raises(ValueError, match="top_k=5 exceeds experts=4"):
        parse_spec("moe:layers=2,hidden=64,heads=4,vocab=128,seq=16,experts=4,top_k=5")
    with pytest.raises(ValueError, match="group_tokens=5 must divide seq=16"):
        parse_spec(TINY + ",group_tokens=5")
    assert resolve("moe-tiny").family == "moe"


def test_routing_groups_are_runs_of_a_sequence():
    """Groups of the whole sequence (group_tokens=0 or seq) route alike; groups of 4 tokens
    route each run of 4 on its own: the same as a batch of those runs."""
    torch.manual_seed(0)
    whole = resolve(TINY).build()
    same = resolve(TINY + ",group_tokens=16").build()
    runs = resolve(TINY + ",group_tokens=4").build()
    same.load_state_dict(whole.state_dict())
    runs.load_state_dict(whole.state_dict())
    x = torch.randn(2, 16, 64)
    y, aux = whole.layers[0].moe(x)
    y_same, aux_same = same.layers[0].moe(x)
    torch.testing.assert_close((y_same, aux_same), (y, aux), rtol=0, atol=0)
    y_runs, aux_runs = runs.layers[0].moe(x)
    y_batch, aux_batch = whole.layers[0].moe(x.reshape(8, 4, 64))  # 8 sequences of 4 tokens
    torch.testing.assert_close(y_runs, y_batch.reshape(2, 16, 64))
    torch.testing.assert_close(aux_runs, aux_batch)
    assert not torch.equal(y_runs, y)  # capacity 3 per run of 4 tokens, 10 per 16: other drops


def test_mixtral_preset_has_the_published_parameter_count():
    graph = trace_model(resolve("mixtral-8x7b").with_overrides(seq=128), batch=1, layers_traced=2)
    assert abs(graph.model.num_parameters - 46.7e9) / 46.7e9 < 0.01, graph.model.num_parameters


def test_deepseek_v3_like_preset_counts_its_own_formula():
    """V3's widths with grouped-query attention in place of MLA and every layer MoE (module
    docstring): per layer 4 d^2 (attention) + 3 d f (E + shared) + d E (router) + 2 d
    (norms), plus embedding, head and final norm."""
    cfg = resolve("deepseek-v3-like").config
    d, f, e = cfg.hidden, cfg.ffn_hidden, cfg.experts
    per_layer = 4 * d * d + 3 * d * f * (e + cfg.shared_experts) + d * e + 2 * d
    want = cfg.layers * per_layer + 2 * cfg.vocab * d + d
    graph = trace_model(resolve("deepseek-v3-like").with_overrides(seq=64), batch=1, layers_traced=2)
    assert graph.model.num_parameters == pytest.approx(want, rel=1e-6)
    assert 0.95 < graph.model.num_parameters / 671e9 < 1.1  # near V3's 671B, not equal to it


def test_one_hot_range_checks_do_not_pin_the_batch():
    """F.one_hot traces to a comparison plus `_assert_async(all(...))` range checks; the
    tracer drops the checks (autopar/trace/capture.py _drop_value_checks), so a model that one-hots
    batch-derived indices (routing) still splits its batch four ways."""
    from torch import nn
    from torch.nn import functional as F

    from autopar.trace import trace_step

    class OneHot(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return (F.one_hot(h.argmax(-1), 4).to(h.dtype) * h).sum()

    _, graph = trace_step(OneHot(), (torch.randn(8, 8),))
    assert not any("assert" in n.op or n.op.startswith("aten.all") for n in graph.nodes)
    solution = solve_one_stage(graph, ParallelConfig(dp=4), Cluster.parse("cpu:1x4"), num_microbatches=1)
    chosen = {c.node: c for c in solution.choices}
    argmax = next(n for n in graph.nodes if n.op == "aten.argmax.default")
    assert chosen[argmax.id].outputs[0] == (Shard(0), Replicate())


def _transforms(graph, solution):
    """(producer, consumer, kind on a GPU, kind on gloo, bytes on gloo, bytes on a GPU) for
    every reshard of the solution that DTensor's planner does with an all-to-all."""
    chosen = {c.node: c for c in solution.choices}
    out = []
    for c in solution.choices:
        node = graph[c.node]
        for position, u in enumerate(node.inputs):
            if u not in chosen or len(graph[u].outputs) != 1:
                continue
            meta, src, dst = graph[u].outputs[0], chosen[u].outputs[0], c.inputs[position]
            gpu = reshard_collectives(meta, src, dst, solution.mesh_shape, gloo=False) or ()
            cpu = reshard_collectives(meta, src, dst, solution.mesh_shape, gloo=True) or ()
            for on_gpu, on_cpu in zip(gpu, cpu):
                if on_gpu.kind == "all_to_all":
                    out.append((u, c.node, on_cpu.kind, on_cpu.bytes, on_gpu.bytes, on_gpu.axis))
    return out


@pytest.fixture(scope="module")
def tiny_dp2_tp2():
    """The tiny model solved on each profile, its gradient sync charged exposed: with one
    microbatch the H100 profile would hide it behind the backward (cost_model
    `exposed_sync_s`), and for this tiny model the hidden data-parallel sync then makes
    tensor-parallel experts (Shard(1)) cheaper than expert-split ones; the oracles here are
    about the dispatch between expert-split layouts."""
    graph = trace_model(resolve(TINY), batch=4)
    config = ParallelConfig(dp=2, tp=2)
    exposed = {hw: replace(HARDWARE[hw], comm_overlap=0.0) for hw in ("cpu", "h100")}
    return graph, {hw: solve_one_stage(graph, config, Cluster.parse(f"{hw}:1x4", hardware=exposed[hw]),
                                       num_microbatches=1)
                   for hw in ("cpu", "h100")}


def test_the_ilp_splits_the_experts_and_dispatches_by_all_to_all(tiny_dp2_tp2):
    """On both profiles the ILP puts the expert weights on their expert dim over an axis; on
    H100s it moves routed tokens between group- and expert-split layouts with DTensor's
    all-to-all, priced as all_to_all (bytes per device: the local shard over the axis
    size); any it uses on a CPU (gloo) mesh is priced as the all-gather + chunk DTensor
    runs there."""
    graph, solutions = tiny_dp2_tp2
    for hw, solution in solutions.items():
        chosen = {c.node: c for c in solution.choices}
        experts = [n for n in graph.nodes if n.op == "placeholder" and (n.param_name or "").endswith(".moe.w1")]
        assert experts and all(Shard(0) in chosen[n.id].outputs[0] for n in experts), hw
        moves = [m for m in _transforms(graph, solution) if graph[m[1]].module_path.endswith(".moe")]
        # on gloo an all-to-all costs the all-gather it runs as, so the ILP may gather instead
        assert moves or hw == "cpu", f"{hw}: no all-to-all between dispatch and experts"
        priced = {(c.src, c.dst, c.kind, c.axis, c.bytes) for c in solution.collectives}
        for u, v, cpu_kind, cpu_bytes, gpu_bytes, axis in moves:
            n = solution.mesh_shape[axis]
            assert cpu_kind == "all_gather" and cpu_bytes == gpu_bytes * n
            want = ("all_to_all", gpu_bytes) if hw == "h100" else ("all_gather", cpu_bytes)
            assert (u, v, *want[:1], axis, want[1]) in priced, (hw, graph[u].name, graph[v].name)



@pytest.mark.parametrize("spec", [TINY, "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=16",
                                  "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=16"])
def test_grouped_ops_are_the_expert_matmuls(spec):
    """The ops on whose edges a split may move over dp (restrict.py exchange_nodes) are the
    routed experts' batched matmuls, forward, input-gradient and weight-gradient (and views
    of a stacked weight's gradient), each with an expert-parallel strategy; a dense model
    has none, so its strategy space is what it was."""
    from solver.forced import keep_placeholder
    from solver.intra_op.restrict import exchange_nodes, restrict_placeholders
    from solver.intra_op.space import enumerate_strategies

    graph = trace_model(resolve(spec), batch=4)
    space = restrict_placeholders(graph, enumerate_strategies(graph, (4, 1)),
                                  keep_placeholder(ParallelConfig(dp=4, zero=3)))
    grouped = exchange_nodes(graph, space, (0,))
    if not spec.startswith("moe"):
        assert grouped == {}
        return
    matmuls = {n.id for n in graph.nodes if n.op == "aten.bmm.default" and any(
        64 in (graph[i].output.shape[1:]) and graph[i].output.shape[0] == 4 for i in n.inputs)
        and n.module_path.endswith(".moe") and "experts" not in n.module_path}
    expert_bmms = {n for n in grouped if graph[n].op == "aten.bmm.default"}
    assert len(expert_bmms) == 2 * 3 * 3, len(expert_bmms)  # 2 layers x (w1, w3, w2) x (fwd, dgrad, wgrad)
    assert expert_bmms <= matmuls
    assert {graph[n].op for n in grouped} <= {"aten.bmm.default", "aten.view.default", "aten.permute.default",
                                               "aten.squeeze.dim", "aten.transpose.int", "aten._unsafe_view.default"}
    for n, flags in grouped.items():
        assert any(flags) and len(flags) == len(space[n])


def _by_kind(counts: dict) -> dict:
    out: dict = {}
    for (kind, _), sizes in counts.items():
        entry = out.setdefault(kind, [0, 0])
        entry[0] += len(sizes)
        entry[1] += sum(sizes)
    return {k: tuple(v) for k, v in out.items()}


WIDE = TINY.replace("expert_ffn=64", "expert_ffn=4096")
"""Experts wide against a step's tokens: gathering them costs more than moving the tokens."""


@pytest.mark.parametrize("spec,config,axis", [
    (TINY, ParallelConfig(dp=2, tp=2, micro_batch=2), "tp"),
    (WIDE, ParallelConfig(dp=4, zero=1, ep=4, micro_batch=1), "dp"),
], ids=["ep-over-tp", "ep-over-dp"])
def test_all_to_alls_in_the_program_equal_those_priced(monkeypatch, spec, config, axis):
    """Price = run for the all-to-alls of a GPU mesh: the ILP's plan for --dp 2 --tp 2 (the
    experts split over tp) and for --dp 4 --zero 1 --ep 4 (split over dp: expert parallelism
    over the data-parallel ranks, solver/intra_op/restrict.py exchange_nodes) on H100s, applied
    on a fake process group of 4 ranks (nothing runs), holds in its per-rank graphs exactly
    the collectives priced, all-to-alls included, by kind, count and bytes.
    DTensor picks its all-to-all by the mesh's device type (a CPU mesh all-gathers and keeps
    a chunk, which gloo prices: tests/dist/test_moe_numerics.py), so the trace takes the
    branch a GPU mesh takes, `_dtensor.shard_dim_alltoall`, on this CPU mesh."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import placement_types
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.placing import priced_per_step, solution_choices, solve_config
    from autopar.trace import trace_step
    from codegen.apply import apply, count_collectives
    from codegen.emit import _clear_dtensor_caches

    def gpu_all_to_all(tensor, gather_dim, shard_dim, mesh, mesh_dim):
        group = funcol._group_or_group_name(funcol._resolve_group((mesh, mesh_dim)))
        return torch.ops._dtensor.shard_dim_alltoall(tensor, gather_dim, shard_dim, group)

    monkeypatch.setattr(placement_types, "shard_dim_alltoall", gpu_all_to_all)
    source = resolve(spec)
    torch.manual_seed(0)
    traced, graph = trace_step(source.build(), list(source.example_inputs(4)))
    solution = solve_config(graph, config, Cluster.parse("h100:1x4"), num_microbatches=1)
    per_axis = priced_per_step(solution, 1, ("dp", "tp"))
    assert any(kind == "all_to_all" and where == axis for kind, where in per_axis), per_axis
    priced: dict = {}
    for (kind, _), (calls, nbytes) in per_axis.items():
        entry = priced.setdefault(kind, [0, 0])
        entry[0] += calls
        entry[1] += nbytes
    priced = {k: tuple(v) for k, v in priced.items()}
    _clear_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (config.dp, config.tp), mesh_dim_names=("dp", "tp"))
        program = apply(traced.gm, graph, solution_choices(graph, solution), mesh, sync_in_step=True)
    finally:
        dist.destroy_process_group()
        _clear_dtensor_caches()
    ran: dict = {}
    for gm in (program.step, program.grad_sync, program.param_gather):
        if gm is not None:
            for kind, (calls, nbytes) in _by_kind(count_collectives(gm)).items():
                entry = ran.setdefault(kind, [0, 0])
                entry[0] += calls
                entry[1] += nbytes
    ran = {k: tuple(v) for k, v in ran.items()}
    assert priced.get("all_to_all", (0, 0))[0] > 0, priced
    assert ran == priced, (ran, priced)


def test_an_expert_parallel_degree_stores_the_experts_split_beside_zero_1():
    """`ep` = dp (ParallelConfig.ep, `--ep`): under ZeRO-1 the routed experts are stored and
    computed split on E over dp, never gathered there, while the dense weights stay whole
    with their updates sharded; without it ZeRO-1 keeps the experts whole over dp."""
    from solver.spmd_search import derived_zero

    graph = trace_model(resolve(WIDE), batch=4)
    cluster = Cluster.parse("h100:1x4")
    by_ep = {}
    for ep in (1, 4):
        solution = solve_one_stage(graph, ParallelConfig(dp=4, zero=1, ep=ep), cluster, num_microbatches=1)
        chosen = {c.node: c for c in solution.choices}
        by_ep[ep] = {n.param_name: chosen[n.id] for n in graph.nodes if n.op == "placeholder" and n.param_name}
        assert derived_zero(graph, solution) == 1  # experts computed where stored are not ZeRO-3
    for name, c in by_ep[4].items():
        if name.endswith((".moe.w1", ".moe.w3", ".moe.w2")):
            assert c.outputs[0][0] == Shard(0) and c.update is None, (name, c)
            assert by_ep[1][name].outputs[0][0] == Replicate(), name
        elif name.endswith("attention.wq.weight"):
            assert c.outputs[0][0] == Replicate() and isinstance(c.update[0], Shard), (name, c)
    with pytest.raises(ValueError, match="--ep must be 1 or equal --dp"):
        ParallelConfig(dp=4, ep=2)
