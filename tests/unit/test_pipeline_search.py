"""The pipeline search (solver/pipeline_search.py): stage costs come from the ILP once per
key, only plans the runtime runs are ranked (autopar/capabilities.py), the others are kept
as runners-up with their reason, and a pipeline plan round-trips and explains per stage."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cost_model

from autopar.capabilities import PlanShape, StageShape, runnable
from autopar.cluster import Cluster
from autopar.models import resolve
from autopar.plan import Plan
from autopar.trace import trace_model
from solver import pipeline_search, pipeline_stages
from solver.search_config import SearchConfig
from solver.stage_costs import lower_bound_s

SPEC = "llama:layers=8,hidden=256,heads=8,kv_heads=4,ffn=512,vocab=512,seq=256"


def _stage(n=2, submesh=(2, 2), recompute="none", zero=0):
    return StageShape(num_layers=n, submesh=submesh, recompute=recompute, zero=zero)


def test_runnable_says_exactly_what_runs_today():
    one = PlanShape(family="", num_layers=4, stages=(_stage(4),))
    assert runnable(one) is None  # one stage: the per-op program runs any model
    pipe = dict(family="llama", heads=8, kv_heads=4, num_layers=4)
    assert runnable(PlanShape(**pipe, stages=(_stage(), _stage()))) is None
    # any other model with a repeated stack: per-op stages cut at its layers (pipe_spmd), tp included
    assert runnable(PlanShape(**{**pipe, "family": ""}, stages=(_stage(submesh=(2, 1)),) * 2)) is None
    assert runnable(PlanShape(**{**pipe, "family": ""}, stages=(_stage(), _stage()))) is None
    assert "repeated layer stack" in runnable(PlanShape(**{**pipe, "family": "", "num_layers": 0},
                                                        stages=(_stage(0), _stage(0))))
    assert "different submeshes" in runnable(PlanShape(**pipe, stages=(_stage(), _stage(submesh=(4, 1)))))
    assert "recompute" in runnable(PlanShape(**pipe, stages=(_stage(), _stage(recompute="full"))))
    assert "ZeRO" in runnable(PlanShape(**pipe, stages=(_stage(), _stage(zero=3))))
    assert "zbv" in runnable(PlanShape(**pipe, schedule="zbv", chunks=2, stages=(_stage(), _stage())))
    assert "non-uniform" in runnable(PlanShape(**pipe, schedule="interleaved", chunks=2,
                                               stages=(_stage(1), _stage(3))))
    # stages of different sizes interleave when each splits evenly over its chunks
    # (pipe_spmd.chunk_layers: 2/4 layers -> chunks of 1, 2, 1, 2)
    assert runnable(PlanShape(**{**pipe, "num_layers": 6}, schedule="interleaved", chunks=2,
                              stages=(_stage(2), _stage(4)))) is None
    # per-op stages: the ILP splits what divides, heads need not divide tp
    assert runnable(PlanShape(**{**pipe, "kv_heads": 2}, stages=(_stage(submesh=(1, 4)),) * 2)) is None


@pytest.fixture(scope="module")
def searched():
    source = resolve(SPEC)
    traces = []

    def trace_at(g, recompute="none"):
        traces.append(g)
        return trace_model(source, batch=g, dtype="bfloat16", layers_traced=2, recompute=recompute)

    cluster = Cluster.parse("h100:1x4")
    result = pipeline_search.search(trace_at, cluster, SearchConfig(global_batch=16, model=SPEC, fingerprint="f",
                                                                    family="llama", top=5, num_layers=8, min_pp=2))
    return result, traces, cluster


def test_only_runnable_plans_are_ranked(searched):
    result, _, _ = searched
    assert result.plans and len(result.plans) == len(result.ranked[:5])
    assert all(p.config.pp > 1 for p in result.plans)
    for plan, r in zip(result.plans, result.ranked):
        assert plan.config == r.config
        stages = plan.stages
        shape = PlanShape(family="llama", heads=8, kv_heads=4, num_layers=8, schedule=plan.config.schedule
                          if plan.config.pp > 1 else "1f1b", chunks=plan.config.interleave,
                          stages=tuple(StageShape(num_layers=s.num_layers, submesh=s.submesh, recompute=s.recompute,
                                                  zero=s.zero) for s in stages))
        assert runnable(shape) is None, (plan.config, shape)
    times = [r.estimate.step_time_s for r in result.ranked]
    assert times == sorted(times)


def test_pipeline_plan_round_trips_and_explains(searched):
    result, _, _ = searched
    pipes = [p for p in result.plans if p.config.pp > 1]
    assert pipes, [p.config for p in result.plans]
    plan = pipes[0]
    assert Plan.loads(plan.dumps()) == plan
    text = plan.explain()
    assert "pipeline:" in text and "stage 0: embedding, layers 0-" in text and "on submesh (dp, tp)" in text
    assert "why the runners-up lost" in text
    assert any(word in text for word in ("attention (", "MLP ("))
    # runners-up the runtime cannot run are named with the reason
    reasons = [why for _, _, why in plan.pipeline.runners_up]
    assert all(why for why in reasons)


def test_unrunnable_candidates_are_kept_with_reasons():
    """A candidate's DP solutions the runtime cannot run (zbv, mixed stages) carry the reason;
    the uniform ones on a runtime schedule carry none."""
    source = resolve(SPEC)
    cluster = Cluster.parse("h100:1x4")
    cache = pipeline_stages.StageCostCache(lambda g: trace_model(source, batch=g, dtype="bfloat16",
                                                                  layers_traced=2), cluster, 16, {}, None)
    cand = pipeline_stages.PipelineCandidate(pp=2, microbatch=4, num_microbatches=4)
    results = pipeline_stages.solve_pipeline_candidate(cand, cache, cluster, family="llama", num_layers=8,
                                                       info=cache.graph(1).model)
    reasons = {r.schedule.name: r.reason for r in results if len({(s.mesh, s.zero, rc) for s, rc in r.stages}) == 1}
    assert "zbv" in (reasons.get("zbv") or "") and reasons["1f1b"] is None and reasons["gpipe"] is None


def test_stage_ilps_are_memoised(searched, monkeypatch):
    """Every (submesh, global microbatch, ZeRO layout) solves one stage ILP, whatever the
    pipeline degree or cut."""
    from solver import forced

    calls = []
    real = forced.solve_stage

    def counting(graph, config, cluster, **kw):
        calls.append((config.dp, config.tp, config.zero, graph.model.batch))
        return real(graph, config, cluster, **kw)

    monkeypatch.setattr(forced, "solve_stage", counting)
    source = resolve(SPEC)
    cluster = Cluster.parse("h100:1x4")
    cache = pipeline_stages.StageCostCache(lambda g: trace_model(source, batch=g, dtype="bfloat16",
                                                                  layers_traced=2), cluster, 16, {}, None)
    ref = cache.graph(1)
    cands = pipeline_stages.pipeline_candidates(cluster, 16, 8)
    assert {c.pp for c in cands} == {2, 4}, cands
    for cand in cands:
        pipeline_stages.solve_pipeline_candidate(cand, cache, cluster, family="llama", num_layers=8, info=ref.model)
    assert calls and len(calls) == len(set(calls)), calls


def test_a_stage_is_priced_by_the_solve_its_chunks_run():
    """Price = run for pipeline stages: the search's stage ILP (the whole traced step on the
    stage's (dp, tp) submesh) performs, per step, the collectives the runtime's chunk ILPs
    perform together (autopar/placing.py solve_stage on each chunk, as a run
    traces it): the same kinds on the same axes, and the bytes each axis moves, and each
    kind that carries a tenth of them, within 10% (the chunks' boundaries add a few small
    collectives; the chunks sync their gradients in buckets of their own, so calls differ)."""
    import torch

    from autopar.config import ParallelConfig
    from autopar.build.chunks import trace_chunks
    from autopar.placing import solve_stage
    from autopar.placing import priced_per_step

    spec = "llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32"
    source = resolve(spec)
    cluster = Cluster.parse("cpu:1x8")
    global_batch, dp, tp, pp, micro = 8, 2, 2, 2, 1
    rows = dp * micro
    m = global_batch // rows
    config = ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batch=micro)
    torch.manual_seed(0)
    model, example = source.build(), source.example_inputs(global_batch)
    run: dict[tuple[str, str], list[int]] = {}
    for stage in trace_chunks(model, config, example):
        sol = solve_stage(stage.graph, config, cluster, num_microbatches=m, rows=rows)
        for key, (calls, nbytes) in priced_per_step(sol, m, ("dp", "tp")).items():
            entry = run.setdefault(key, [0, 0])
            entry[0] += calls
            entry[1] += nbytes
    cache = pipeline_stages.StageCostCache(lambda g: trace_model(source, batch=g, dtype="float32"), cluster,
                                            global_batch, {}, None)
    priced = priced_per_step(cache.get((dp, tp), rows, 0).solution, m, ("dp", "tp"))
    assert ("all_reduce", "dp") in priced and any(axis == "tp" for _, axis in priced), priced
    assert set(priced) == set(run), (priced, run)
    for axis in ("dp", "tp"):
        total = sum(b for (_, a), (_, b) in priced.items() if a == axis)
        assert total == pytest.approx(sum(b for (_, a), (_, b) in run.items() if a == axis), rel=0.1), (priced, run)
        for key, (_, nbytes) in priced.items():  # every collective kind that carries a tenth of the axis's bytes
            if key[1] == axis and max(nbytes, run[key][1]) >= 0.1 * total:
                assert nbytes == pytest.approx(run[key][1], rel=0.1), (key, priced, run)


def test_lower_bound_is_below_the_ilp():
    """The branch-and-bound's bounds (time from a one-sequence trace scaled up, memory)
    never exceed what the ILP finds for a one-stage plan."""
    from solver.intra_op.ilp import solve_intra_op
    from solver.stage_costs import memory_lower_bound_bytes

    source = resolve(SPEC)
    cluster = Cluster.parse("h100:1x4")
    for rc in ("none", "selective", "full"):
        ref = trace_model(source, batch=1, dtype="bfloat16", layers_traced=2, recompute=rc)
        doubled = trace_model(source, batch=2, dtype="bfloat16", layers_traced=2, recompute=rc)
        graph = trace_model(source, batch=8, dtype="bfloat16", layers_traced=2, recompute=rc)
        # scaled along each tensor's line through its one- and two-sequence sizes, the
        # pre-filter's bound is the candidate's own-trace bound (sizes are linear in the rows)
        assert memory_lower_bound_bytes(ref, 4, 8.0, doubled) == pytest.approx(memory_lower_bound_bytes(graph, 4),
                                                                                rel=1e-9), rc
        for mesh in ((4, 1), (2, 2)):
            sol = solve_intra_op(graph, cluster, mesh)
            lb = lower_bound_s(ref, cluster, 4, 8.0)
            assert lb["pre"] + 8 * lb["layer"] + lb["post"] <= sol.cost.total_s
            bound = memory_lower_bound_bytes(ref, 4, 8.0, doubled)
            assert bound <= pipeline_search.MEMORY_BOUND_SLACK * sol.cost.peak_memory_bytes, (rc, mesh)
            # on the candidate's own trace the bound is exact: no plan beats it
            assert memory_lower_bound_bytes(graph, 4) <= sol.cost.peak_memory_bytes, (rc, mesh)


def test_a_trace_of_two_layers_prices_the_memory_of_all():
    """Two traced layers standing for eight: the ILP's peak and the search's memory bound
    equal those of the trace of all eight, under every recompute policy. A traced layer's
    tensor counts its eight copies only when held across the forward/backward turn
    (solver/intra_op/liveness.py `live_copies`); counting them for the recomputed values
    of one layer's backward too priced full recompute 22% above the full trace here (and a
    126-layer model 63 times its one layer's recompute)."""
    from solver.intra_op.ilp import solve_intra_op
    from solver.stage_costs import memory_lower_bound_bytes

    source = resolve("llama:layers=8,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=32")
    cluster = Cluster.parse("h100:1x4")
    for rc in ("none", "selective", "full"):
        every = trace_model(source, batch=8, dtype="bfloat16", recompute=rc)
        two = trace_model(source, batch=8, dtype="bfloat16", layers_traced=2, recompute=rc)
        assert two.layer_groups[0].multiplicity == 8 and len(two.layer_groups[0].layers) == 2
        assert solve_intra_op(two, cluster, (4, 1)).cost.peak_memory_bytes == pytest.approx(
            solve_intra_op(every, cluster, (4, 1)).cost.peak_memory_bytes, rel=1e-6), rc
        assert memory_lower_bound_bytes(two, 4) == pytest.approx(memory_lower_bound_bytes(every, 4), rel=0.02), rc


def test_candidate_meshes_and_stages_are_what_the_pricing_can_express():
    """One-stage configurations: every dp x tp (the axes have roles, so (1, 8) and (8, 1) are
    both there at g = 8), tp within a node and dividing the heads, the batch split over dp.
    Pipelines: a stage holds whole nodes or a divisor of one (pp 2 on 315 nodes of 8 would
    put 157.5 nodes in a stage)."""
    from solver.spmd_search import candidates

    one_node = {(c.mesh, c.microbatch) for c in candidates(Cluster.parse("a100-80gb:1x8"), 16, 16)}
    assert ((1, 8), 1) in one_node and ((8, 1), 8) in one_node and ((1, 8), 8) in one_node
    assert all(g % a == 0 for (a, _), g in one_node)
    assert {m for m, _ in one_node} == {(8, 1), (4, 2), (2, 4), (1, 8)}
    six_heads = {c.mesh for c in candidates(Cluster.parse("a100-80gb:1x8"), 16, 16, heads=6)}
    assert six_heads == {(8, 1), (4, 2)}
    two_nodes = {c.mesh for c in candidates(Cluster.parse("a100-80gb:2x8"), 16, 16)}
    assert (1, 16) not in two_nodes and (2, 8) in two_nodes
    big = Cluster.parse("a100-80gb:315x8")
    pps = {c.pp for c in pipeline_stages.pipeline_candidates(big, 2520, 105)}
    assert 2 not in pps and 35 in pps
    assert all(pipeline_stages.whole_nodes(big, big.num_devices // p) for p in pps)
    assert {c.pp for c in pipeline_stages.pipeline_candidates(Cluster.parse("cpu:8"), 16, 4)} == {2, 4}


def test_pipelines_pay_the_reported_loss(searched):
    """Every ranked pipeline carries the loss handed to every rank once per step, in its step
    time (what the search ranks by) and in its estimate's breakdown."""
    from cost_model.collectives import LOSS_BYTES

    result, _, cluster = searched
    world = cost_model.all_reduce_time_s(LOSS_BYTES, cost_model.mesh_axis_links(cluster, (cluster.num_devices,))[0])
    assert world > 0
    for r in result.ranked:
        report = dict(r.estimate.time_breakdown)["loss_report_s"]
        assert report >= world * (1 - 1e-9)


def test_boundary_p2p_pays_core_sharing_once():
    """A pipeline boundary's price carries the ranks' core sharing through the link, as
    every ILP collective in a stage's time does: with 8 ranks on 2 cores it is 4x the price
    with a core per rank under the linear share law, not 16x (a double count of the
    sharing); under the built-in's law (latency x 4 ** g) between 4 ** g and 4x."""
    from dataclasses import replace

    from autopar.cluster import HARDWARE

    hw = HARDWARE["cpu"]
    assert hw.cores_per_node == 2
    messages = ((64 * 1024, True), (8192, False))
    one = cost_model.send_recv_time_s
    g = dict(hw.efficiency)["collective_latency_share_exponent"]
    linear = replace(hw, efficiency=tuple(sorted({**dict(hw.efficiency),
                                                  "collective_latency_share_exponent": 1.0}.items())))
    for profile, low, high in ((linear, 4.0, 4.0), (hw, 4.0 ** g, 4.0)):
        shared = Cluster.parse("cpu:8", hardware=profile)
        dedicated = Cluster.parse("cpu:8", hardware=replace(profile, cores_per_node=8))
        got = pipeline_stages.boundary_p2p_s(shared, 4, 2, messages)
        link = cost_model.mesh_axis_links(shared, (4, 2))[0]
        assert got == pytest.approx(2 * one(64 * 1024, link) + one(8192, link))
        ratio = got / pipeline_stages.boundary_p2p_s(dedicated, 4, 2, messages)
        assert low * (1 - 1e-9) <= ratio <= high * (1 + 1e-9)


def test_a_llama_boundary_sends_the_stream_its_rotary_tables_and_the_labels():
    """What a boundary passes per microbatch, as the runtime sends it: a llama layer reads
    the residual stream (its gradient comes back) and the rotary cos and sin tables
    (computed from buffers: forward only); the loss reads the labels, which ride along
    from the first stage. Each its own message."""
    from solver.intra_op.ilp import solve_intra_op
    from solver.stage_costs import split_solution

    spec = "llama:layers=2,hidden=64,heads=4,kv_heads=4,ffn=128,vocab=128,seq=32"
    graph = trace_model(resolve(spec), batch=4, dtype="float32", layers_traced=2)
    cluster = Cluster.parse("cpu:2")
    sol = solve_intra_op(graph, cluster, mesh_shape=(2, 1))
    sc = split_solution(graph, sol, cluster, microbatch=4, num_microbatches=1, zero=0)
    stream = 4 * 32 * 64 * 4  # (rows, seq, hidden) fp32
    table = 32 * (64 // 4) * 4  # (seq, head_dim) fp32: no batch dim, whole on every rank
    back = [size for size, grad in sc.boundary_messages if grad]
    forward_only = [size for size, grad in sc.boundary_messages if not grad]
    assert back == [stream / 2]  # split over dp 2, as the runtime sends it
    labels = 4 * 32 * 8  # (rows, seq) int64
    assert sorted(forward_only) == sorted([table, table, labels / 2])
    assert sc.boundary_bytes == back[0]


def test_a_gpt_boundary_sends_the_stream_and_the_labels_once():
    """GPT sums its token and position embeddings outside any module (node_pieces counts
    that op as "post"): the sum is the stream, sent once, not again as a head input."""
    from solver.stage_costs import _boundary_messages

    spec = "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=32"
    graph = trace_model(resolve(spec), batch=4, dtype="float32", layers_traced=2)
    messages = _boundary_messages(graph, (2, 2), graph.parameter_derived(), 4)
    # split over dp (dim 0 is the microbatch's rows), whole over tp: as the runtime sends them
    assert sorted(messages) == sorted([(4 * 32 * 64 * 4 / 2, True), (4 * 32 * 8 / 2, False)])


def test_every_stage_option_pays_the_chunk_calls_host_time(monkeypatch):
    """The search prices what the runtime's pipeline runs: every stage option it hands the
    inter-op DP carries `cost_model.pipeline_call_time_s` of the cluster (the cpu profile's
    `pipeline_call_host_s` x ranks per core), so a pipeline pays its chunk calls."""
    from dataclasses import replace

    from autopar.cluster import HARDWARE

    eff = {**dict(HARDWARE["cpu"].efficiency), "pipeline_call_host_s": 3e-4}
    cluster = Cluster.parse("cpu:4", hardware=replace(HARDWARE["cpu"], cores_per_node=2,
                                                      efficiency=tuple(sorted(eff.items()))))
    expected = cost_model.pipeline_call_time_s(cluster)
    assert expected == pytest.approx(2 * 3e-4)
    seen = []
    real = pipeline_stages.solve_pipeline

    def spy(num_layers, pp, m, options, *args, **kw):
        seen.extend(o.call_s for o in options)
        return real(num_layers, pp, m, options, *args, **kw)

    monkeypatch.setattr(pipeline_stages, "solve_pipeline", spy)
    spec = "llama:layers=4,hidden=64,heads=4,kv_heads=4,ffn=128,vocab=128,seq=16"
    source = resolve(spec)
    result = pipeline_search.search(
        lambda g, recompute="none": trace_model(source, batch=g, dtype="float32", layers_traced=2,
                                                recompute=recompute),
        cluster, SearchConfig(global_batch=8, model=spec, fingerprint="f", family="llama", top=3, num_layers=4,
                              min_pp=2))
    assert result.ranked and seen and all(c == pytest.approx(expected) for c in seen)


def test_a_stage_pushed_to_zero_3_is_also_solved_under_zero_2():
    """Under a memory budget between ZeRO-1's peak and the leaner layouts' (llama-small, pp2
    x dp2, cuts 2 + 2), the search's stage choice is the faster of ZeRO-2 and ZeRO-3, each
    priced alone (`price --zero`): ZeRO-2 is solved where a result's stage chose ZeRO-3.
    ZeRO-2 keeps ZeRO-1's placements and syncs every microbatch, so it is slower than
    ZeRO-1 and leaner by the gradient."""
    from dataclasses import replace

    import autopar
    from autopar.config import ParallelConfig

    cluster = Cluster.parse("cpu:4")
    config = ParallelConfig(pp=2, dp=2, schedule="1f1b", micro_batch=1)
    alone = {z: autopar.price("llama-small", cluster, replace(config, zero=z), global_batch=8,
                              stage_layers=(2, 2)).predicted for z in (1, 2, 3)}
    assert alone[2].step_time_s > alone[1].step_time_s
    assert alone[2].peak_memory_bytes < alone[1].peak_memory_bytes
    budget = (alone[1].peak_memory_bytes + max(alone[2].peak_memory_bytes, alone[3].peak_memory_bytes)) / 2
    plan = autopar.price("llama-small", cluster.with_memory_gb(budget / 2**30), config, global_batch=8,
                         stage_layers=(2, 2), choose_zero=True)
    best = min((2, 3), key=lambda z: alone[z].step_time_s)
    assert plan.predicted.fits
    assert plan.config.zero == best
    assert plan.predicted.step_time_s == pytest.approx(alone[best].step_time_s, rel=1e-9)


class _Tokens(torch.nn.Module):
    """A projection, a nonlinearity and a head over (batch, time, 16) inputs; `time_major`
    runs them on (time, batch, 16), as an RNN layer does: nn.Linear then flattens
    (time, batch) with the batch dim inner, which DTensor cannot keep split by batch."""

    def __init__(self, time_major: bool) -> None:
        super().__init__()
        self.time_major = time_major
        self.proj = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x.transpose(0, 1) if self.time_major else x))
        logits = self.head(h.transpose(0, 1) if self.time_major else h)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _tokens_batch(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(rows, 6, 16, generator=gen), torch.randint(0, 8, (rows, 6), generator=gen)


def test_a_batch_split_no_op_can_keep_is_infeasible_before_the_ilp(monkeypatch):
    """The gather-free pruning proves a data-parallel mesh infeasible when a node keeps no
    strategy, names that node, and agrees with the ILP built without the pruning."""
    from autopar.config import ParallelConfig
    from autopar.sharding import InfeasiblePlanError
    from autopar.trace import trace_step
    from solver import forced
    from solver.intra_op import ilp

    torch.manual_seed(0)
    graph = trace_step(_Tokens(time_major=True), _tokens_batch())[1]
    cluster = Cluster.parse("cpu:4")
    config = ParallelConfig(dp=4)
    with pytest.raises(InfeasiblePlanError, match=r"no plan on mesh \(4, 1\) with its batch split over axis 0 "
                                                  r"\(4 devices\): node \d+ \(aten\.") as pruned:
        forced.solve_one_stage(graph, config, cluster, num_microbatches=1)
    assert "proj" in str(pruned.value) and "batch dim outermost" in str(pruned.value)
    monkeypatch.setattr(ilp, "prune_gather_free", lambda graph, space, axes, gloo, memo=None, exchange=None: space)
    with pytest.raises(InfeasiblePlanError, match="No placement of"):
        forced.solve_one_stage(graph, config, cluster, num_microbatches=1)
    # the batch-outer model has its data-parallel plan
    monkeypatch.undo()
    graph = trace_step(_Tokens(time_major=False), _tokens_batch())[1]
    assert forced.solve_one_stage(graph, config, cluster, num_microbatches=1).status == "optimal"


@pytest.mark.parametrize("time_major", [False, True])
def test_smaller_microbatches_are_dominated_where_memory_cannot_bind(monkeypatch, time_major):
    """Microbatch dominance (pipeline_search's docstring): with the memory budget out of
    reach, a smaller microbatch on a mesh already solved (or proven without a plan) is not
    solved, and the search returns the plan it returns when it solves every one."""
    from autopar.api import search_plans

    def run():
        torch.manual_seed(0)
        return search_plans(_Tokens(time_major), "cpu:4", example_inputs=_tokens_batch(), global_batch=8,
                            top=1)

    fast = run()
    with monkeypatch.context() as m:
        m.setattr(pipeline_search, "_dominated", lambda unbound, cand: False)
        every = run()
    assert fast.plan.config == every.plan.config
    assert fast.plan.predicted.step_time_s == pytest.approx(every.plan.predicted.step_time_s, rel=1e-9)
    assert fast.plan.search.num_priced < every.plan.search.num_priced
    # a budget the whole step could reach: no microbatch is dominated
    tight = dataclasses.replace(Cluster.parse("cpu:4"), memory_limit_bytes=1)
    unbound: dict = {}
    cand = pipeline_search.SpmdCandidate(mesh=(4, 1), microbatch=8, num_microbatches=1)
    graph = _trace_tokens(8)
    pipeline_search._note_unbound(unbound, cand, graph, tight)
    assert unbound == {}
    pipeline_search._note_unbound(unbound, cand, graph, Cluster.parse("cpu:4"))
    assert unbound == {((4, 1), "none"): [8]}


def _trace_tokens(rows: int):
    from autopar.trace import trace_step

    torch.manual_seed(0)
    return trace_step(_Tokens(time_major=False), _tokens_batch(rows))[1]


def test_search_config_is_frozen_keyword_only_and_validated():
    """The planner's input: built by keyword only, never changed, nonsense refused with what was given."""
    import dataclasses

    config = SearchConfig(global_batch=8, model="llama-small", fingerprint="f")
    assert (config.top, config.min_pp, config.max_pp, config.fixed, config.family) == (5, 1, None, None, "")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.top = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        SearchConfig(8, "llama-small", "f")  # type: ignore[misc]
    with pytest.raises(ValueError, match="got 8, 0, "):
        SearchConfig(global_batch=8, model="llama-small", fingerprint="f", top=0)
