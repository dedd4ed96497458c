"""Priced pipelines as plans: a DP result's estimate, configuration and Plan.

Where it sits: under solver/pipeline_search.py `search`, after the ranking: a pipeline
result (solver/pipeline_stages.py `PipelineResult`) is turned into the `Estimate` that
`autopar price` and the ranking report, and into the `Plan` that is saved and replayed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import cost_model
from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.placement import Replicate
from autopar.plan import PipelineInfo, Plan, SearchInfo, StageInfo
from solver.comm_time import piece_factors
from solver.pipeline_stages import PipelineResult
from solver.spmd_search import AXIS_NAMES
from solver.stage_costs import SubmeshCosts, placement_summary
from solver.stage_dp import stage_memory_parts


def pipeline_estimate(r: PipelineResult, cluster: Cluster, global_batch: int) -> cost_model.Estimate:
    sol, cand = r.solution, r.candidate
    graph = r.stages[0][0].graph
    m = cand.num_microbatches
    step = r.step_time_s
    devices = cluster.num_devices
    tokens = global_batch * graph.model.seq
    flops = graph.flops_per_step * cand.microbatch / graph.model.batch * m
    peak_flops = cluster.hardware.peak_flops(graph.model.dtype)
    tflops = flops / step / devices / 1e12 if step else 0.0
    peak = int(max(sol.stage_memory_bytes))
    budget = cluster.device_memory_bytes
    k = max(range(len(sol.stage_times_s)), key=lambda i: sol.stage_times_s[i])
    # ranks sharing cores (stage_dp): the step may be under m x the slowest stage
    critical = min(m * sol.stage_times_s[k], sol.step_time_s)
    p2p = min(critical, m * r.p2p_s[k] * r.schedule.chunks * ((k > 0) + (k < cand.pp - 1)))
    cfg = pipeline_config(r)
    top = max(range(len(sol.stage_memory_bytes)), key=lambda i: sol.stage_memory_bytes[i])
    sc, rc = r.stages[top]
    state, acts, temp = stage_memory_parts(sc.option(rc, r.p2p_s[top], key=None), sol.stage_layers[top], top,
                                           cand.pp, m, r.schedule)
    return cost_model.Estimate(
        step_time_s=step, tokens_per_s=tokens / step, tokens_per_s_per_device=tokens / step / devices,
        model_tflops_per_device=tflops, mfu=tflops * 1e12 / peak_flops if peak_flops else 0.0,
        peak_memory_bytes=peak, fits=peak <= budget, memory_limit_bytes=int(budget),
        time_breakdown=(("critical_stage_s", critical - p2p), ("p2p_s", p2p), ("bubble_s", sol.bubble_s),
                        ("loss_report_s", r.loss_report_s)),
        memory_breakdown=(("model_state_bytes", state), ("activations_bytes", acts), ("temporaries_bytes", temp)),
        config=tuple(sorted(dict(cfg.to_json(), num_microbatches=m).items())), hardware_tflops_per_device=tflops,
        peak_stage=top)


def pipeline_config(r: PipelineResult) -> ParallelConfig:
    """The ParallelConfig of a uniform pipeline (stage 0's choices for a mixed one)."""
    sc, rc = r.stages[0]
    dp, tp = sc.mesh
    sched = r.schedule.name if r.schedule.name in ("gpipe", "1f1b", "interleaved") else "1f1b"
    return ParallelConfig(tp=tp, pp=r.candidate.pp, dp=dp, zero=sc.zero, ep=sc.ep,
                          micro_batch=r.candidate.microbatch // dp,
                          schedule=sched,  # type: ignore[arg-type]
                          interleave=r.schedule.chunks if sched == "interleaved" else 1,
                          recompute=rc)  # type: ignore[arg-type]


def _collectives_per_microbatch(sc: SubmeshCosts, factor: dict[int, float]) -> tuple[tuple[str, str, int, int], ...]:
    """(kind, axis, calls, bytes) per microbatch of the stage that runs `factor` of each node
    of the traced graph (solver/comm_time.py `piece_factors`: its pieces), as the
    communication rows attribute them: a record counts in the piece of the node that reads
    it, a gradient sync's once per step over m."""
    calls: Counter = Counter()
    volume: Counter = Counter()
    m = sc.num_microbatches
    for c in sc.solution.collectives:
        times = c.weight / (m if c.gradient_sync else 1) * factor[c.dst]
        if times == 0:
            continue
        key = (c.kind, AXIS_NAMES[c.axis])
        calls[key] += times
        volume[key] += times * c.bytes
    return tuple((k, a, int(round(calls[(k, a)])), int(round(volume[(k, a)]))) for k, a in sorted(calls))


def pipeline_plan(r: PipelineResult, est: cost_model.Estimate, cluster: Cluster, *, global_batch: int, model: str,
                   fingerprint: str, num_layers: int, info: SearchInfo,
                   runners_up: tuple[tuple[str, float, str], ...]) -> Plan:
    sol = r.solution
    stages = []
    first = 0
    for k, (n, (sc, rc)) in enumerate(zip(sol.stage_layers, r.stages)):
        stages.append(StageInfo(
            index=k, first_layer=first, num_layers=n, has_embedding=k == 0, has_head=k == len(sol.stage_layers) - 1,
            submesh=sc.mesh, recompute=rc, zero=sc.zero, time_per_microbatch_s=sol.stage_times_s[k],
            memory_bytes=int(sol.stage_memory_bytes[k]),
            inflight_microbatches=r.schedule.inflight(k, len(sol.stage_layers), r.candidate.num_microbatches),
            placements=placement_summary(sc.graph, sc.solution, ("pre",) * (k == 0) + ("layer",) + (
                ("post",) if k == len(sol.stage_layers) - 1 else ())),
            collectives=_collectives_per_microbatch(sc, piece_factors(sc.graph, k, len(sol.stage_layers), n))))
        first += n
    cfg = pipeline_config(r)
    pipe = PipelineInfo(schedule=r.schedule.name, chunks=r.schedule.chunks, microbatch=r.candidate.microbatch,
                        num_microbatches=r.candidate.num_microbatches, bubble_s=sol.bubble_s,
                        p2p_s=dict(est.time_breakdown)["p2p_s"], runners_up=runners_up)
    seq = r.stages[0][0].graph.model.seq
    return Plan(model=model, model_fingerprint=fingerprint, num_layers=num_layers, seq=seq, global_batch=global_batch,
                cluster=cluster.spec, memory_limit_bytes=int(cluster.device_memory_bytes), config=cfg,
                stage_layers=sol.stage_layers, mesh_shape=(cfg.pp, cfg.dp, cfg.tp), stages=tuple(stages),
                predicted=est, bubble_fraction=sol.bubble_s / r.step_time_s if r.step_time_s else 0.0,
                search=info, placements=(), intra_op_info=None, pipeline=pipe)


def repeated_axes(solution: Any) -> tuple[str, ...]:
    """The (dp, tp) axes of size > 1 on which no node of a one-stage solution is sharded or a
    pending sum, so every rank of the axis runs the same step (Ranked.repeated_axes)."""
    names = ("dp", "tp")
    out = []
    for k, size in enumerate(solution.mesh_shape):
        if size > 1 and all(isinstance(p[k], Replicate) for c in solution.choices
                            for p in (*c.outputs, *c.inputs) if p is not None):
            out.append(names[k] if k < len(names) else f"axis {k}")
    return tuple(out)
