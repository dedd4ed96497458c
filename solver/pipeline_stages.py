"""Pipeline candidates and their stage costs: what a pipeline of p stages can run, and its DP.

Where it sits: under solver/pipeline_search.py `search`, which queues these candidates beside
the one-stage ones. A candidate is a pipeline degree p and a global microbatch g
(`pipeline_candidates`); its stages are priced by the intra-op ILP once per stage submesh
(dp, tp) and ZeRO layout (`StageCostCache`, under the rules the runtime solves each chunk
by: solver/forced.py solve_stage), and the inter-op DP (solver/stage_dp.py) picks the cuts
and each stage's option per schedule (`solve_pipeline_candidate`). Every result is asked
autopar.capabilities.runnable, so the search can rank what the runtime executes.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any

import cost_model
from autopar.capabilities import PlanShape, StageShape, runnable
from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.ir import Graph
from autopar.sharding import InfeasiblePlanError
from cost_model import core_share
from solver import forced
from solver.intra_op.space import divisibility_signature, enumerate_strategies
from solver.forced import stacked_experts
from solver.search_config import Fixed
from solver.spmd_search import TraceAt, traced
from solver.stage_costs import RECOMPUTE_POLICIES, SubmeshCosts, split_solution
from solver.stage_dp import PipelineSolution, Schedule, option_tables, solve_pipeline

log = logging.getLogger(__name__)

MAX_RANK_MICROBATCH = 4
"""Largest per-rank microbatch (sequences) a pipeline stage's submesh may get. Every global
microbatch g = dp x b (b <= this, for every stage submesh's dp) is a candidate, each a
trace and a stage ILP per (dp, tp) submesh and ZeRO layout, and pipelines want many small
microbatches: the stage
ILP's cost per sequence barely changes with b while the bubble and the in-flight memory
shrink with more microbatches (benchmarks/vs_hand_tuned.py found the template grid's
dp 1 x 168 microbatches beating the three largest g this search used to try)."""

def interleave_depths(num_stages: int, num_layers: int) -> range:
    """Interleaving depths v the search prices: every v >= 2 with num_stages x v <= layers
    (each rank holds v chunks of at least one layer). The bubble of interleaved 1F1B is
    (p - 1) / (v m) of the ideal step (Narayanan et al., SC'21, section 2.2.2) while each
    stage boundary carries v times the point-to-point messages; the stage DP prices both
    (solver/stage_dp.py), so no depth is ruled out in advance."""
    return range(2, num_layers // num_stages + 1) if num_stages > 1 else range(0)


RECOMPUTE_CHOICES = RECOMPUTE_POLICIES
"""The recompute policies the search tries per stage: every one the stage costs price."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineCandidate:
    pp: int
    microbatch: int
    """Sequences per global microbatch."""
    num_microbatches: int

    def stage_devices(self, cluster: Cluster) -> int:
        return cluster.num_devices // self.pp


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineResult:
    """One DP solution: a schedule and per-stage (SubmeshCosts, recompute)."""

    candidate: PipelineCandidate
    schedule: Schedule
    solution: PipelineSolution
    stages: tuple[tuple[SubmeshCosts, str], ...]
    reason: str | None
    """None when the runtime runs it; else why not (autopar/capabilities.py)."""
    p2p_s: tuple[float, ...]
    loss_report_s: float = 0.0
    """Once per step, after the schedule: the loss reduced on the last stage and handed to
    every rank (`pipeline_loss_report_s`)."""

    @property
    def step_time_s(self) -> float:
        return self.solution.step_time_s + self.loss_report_s

    def describe(self) -> str:
        sched = self.schedule.name + (f"/v{self.schedule.chunks}" if self.schedule.name == "interleaved" else "")
        meshes = [f"({s.mesh[0]},{s.mesh[1]})" + (f" z{s.zero}" if s.zero else "") + f" rc-{rc}" for s, rc in self.stages]
        uniform = len(set(meshes)) == 1
        per_stage = meshes[0] if uniform else " | ".join(meshes)
        return (f"pp{self.candidate.pp} {sched} g{self.candidate.microbatch}x{self.candidate.num_microbatches} "
                f"cuts {'/'.join(map(str, self.solution.stage_layers))} (dp,tp) {per_stage}")


def boundary_p2p_s(cluster: Cluster, pp: int, stage_devices: int,
                   messages: tuple[tuple[float, bool], ...]) -> float:
    """One pipeline boundary per microbatch (stage_costs `_boundary_messages`): every value
    sent forward as its own message, and the gradients sent back, each
    cost_model.send_recv_time_s over the pp axis of the (pp, stage devices) mesh.

    Counted as the runtime sends them (S llama pp2 on 2 ranks: 4 sends and 1 receive per
    microbatch on the first stage: the residual stream, the rotary cos and sin, the labels;
    the stream's gradient back), not as one message each way of the largest value. The
    link carries the core sharing of ranks on a node (mesh_axis_links scales latency and
    bandwidth by `core_share`), like every ILP collective in a stage's time: no second
    factor (a second one would price it 4x too high on 8 ranks over 2 cores)."""
    link = cost_model.mesh_axis_links(cluster, (pp, stage_devices))[0]
    return sum(cost_model.send_recv_time_s(size, link) * (2 if grad else 1) for size, grad in messages)


def pipeline_loss_report_s(cluster: Cluster, last: SubmeshCosts) -> float:
    """The reported loss of a pipeline step (cost_model.loss_report_time_s): reduced over
    the last stage's (dp, tp) submesh where its loss is Partial, then all-reduced over
    every rank (autopar/runtime/pipe_spmd.py), the loss placed as the stage's ILP places it."""
    placements = last.solution.choice(last.graph.loss).outputs[0]
    links = cost_model.mesh_axis_links(_stage_cluster(cluster, math.prod(last.mesh)), tuple(last.mesh))
    world = cost_model.mesh_axis_links(cluster, (cluster.num_devices,))[0]
    return cost_model.loss_report_time_s(placements, links, world)


def _stage_cluster(cluster: Cluster, devices: int) -> Cluster:
    """The devices one stage (or its tp group) runs on: `Cluster.stage`, which the
    per-op runtime's stage solves use too (autopar/runtime/pipe_spmd.py)."""
    return cluster.stage(devices)


def whole_nodes(cluster: Cluster, devices: int) -> bool:
    """A stage of `devices` holds whole nodes or a divisor of one (what _stage_cluster prices)."""
    per_node = cluster.devices_per_node
    return devices % per_node == 0 if devices >= per_node else per_node % devices == 0


def pipeline_candidates(cluster: Cluster, global_batch: int, num_layers: int, *,
                        max_pp: int | None = None) -> list[PipelineCandidate]:
    """(p, g) for every pipeline degree p and every global microbatch g = dp b that some
    stage submesh (dp, tp) runs with b <= MAX_RANK_MICROBATCH sequences per rank, with at
    least p microbatches (fewer would leave most of the pipeline idle). A stage holds whole
    nodes or a divisor of one (the stage's costs are priced on that many nodes x devices:
    _stage_cluster; e.g. pp 2 on 315 nodes of 8 would put 157.5 nodes in a stage)."""
    n = cluster.num_devices
    out = []
    for p in range(2, n + 1):
        if n % p or p > num_layers or (max_pp is not None and p > max_pp):
            continue
        D = n // p
        if not whole_nodes(cluster, D):
            continue
        sizes: set[int] = set()
        for tp in range(1, min(D, cluster.devices_per_node) + 1):
            if D % tp or cluster.devices_per_node % tp:
                continue
            sizes.update(D // tp * b for b in range(1, MAX_RANK_MICROBATCH + 1))
        for g in sorted(sizes, reverse=True):
            if global_batch % g == 0 and global_batch // g >= p:
                out.append(PipelineCandidate(pp=p, microbatch=g, num_microbatches=global_batch // g))
    return out


def stage_submeshes(cluster: Cluster, devices: int, microbatch: int, *, heads: int = 0,
                    kv_heads: int = 0, max_rank_microbatch: int | None = MAX_RANK_MICROBATCH) -> list[tuple[int, int]]:
    """(dp, tp) with dp tp = devices, tp inside a node dividing the heads, dp | microbatch
    (at most `max_rank_microbatch` sequences per rank; None: any)."""
    out = []
    for tp in range(1, devices + 1):
        if devices % tp or cluster.devices_per_node % tp or tp > cluster.devices_per_node:
            continue
        if tp > 1 and ((heads and heads % tp) or (kv_heads and kv_heads % tp)):
            continue
        dp = devices // tp
        if microbatch % dp == 0 and (max_rank_microbatch is None or microbatch // dp <= max_rank_microbatch):
            out.append((dp, tp))
    return out


class StageCostCache:
    """SubmeshCosts per (mesh, microbatch, zero), and traces per microbatch: owned by one search."""

    def __init__(self, trace_at: TraceAt, cluster: Cluster, global_batch: int, graphs: dict[Any, Graph],
                 time_limit_s: float | None) -> None:
        self.trace_at, self.cluster, self.global_batch = trace_at, cluster, global_batch
        self.graphs = graphs
        self.time_limit_s = time_limit_s
        self.costs: dict[tuple, SubmeshCosts | None] = {}
        self.spaces: dict[tuple, Any] = {}
        """Strategy enumerations per divisibility signature of (traced step, mesh): shared by
        the ZeRO layouts' solves and by the microbatches whose sizes every mesh product
        divides alike (solver/intra_op/space.py divisibility_signature)."""
        self.signatures: dict[tuple, tuple] = {}
        self.prune_memo: dict[tuple, Any] = {}
        """The stage solves' gather-free pruning passes (solver/intra_op/restrict.py prune_gather_free)."""

    def graph(self, g: int) -> Graph:
        return traced(self.graphs, self.trace_at, g)

    def get(self, mesh: tuple[int, int], g: int, zero: int, ep: int = 1) -> SubmeshCosts | None:
        """The stage costs of submesh `mesh` at global microbatch g (memoised): the ILP the
        runtime solves for each of the stage's chunks (solver/forced.py solve_stage, under
        the (dp, tp, zero) configuration's rules), solved once on the whole traced step
        and split into pieces (stage_costs.split_solution), so a stage is priced by the
        placements it runs."""
        key = (mesh, g, zero, ep)
        if key in self.costs:
            return self.costs[key]

        dp, tp = mesh
        m = self.global_batch // g
        sub = _stage_cluster(self.cluster, dp * tp)
        graph = self.graph(g)
        config = ParallelConfig(dp=dp, tp=tp, zero=zero, ep=ep)
        shape = forced.mesh_shape(config)
        if (mesh, g) not in self.signatures:
            self.signatures[(mesh, g)] = divisibility_signature(graph, shape)
        sig = self.signatures[(mesh, g)]
        if sig not in self.spaces:
            self.spaces[sig] = enumerate_strategies(graph, shape)
        try:
            sol = forced.solve_stage(graph, config, sub, num_microbatches=m, time_limit_s=self.time_limit_s,
                                     space=self.spaces[sig], prune_memo=self.prune_memo)
        except InfeasiblePlanError as exc:
            log.info("stage ILP %s g=%d zero %d ep %d: %s", mesh, g, zero, ep, exc)
            self.costs[key] = None
            return None
        self.costs[key] = split_solution(graph, sol, sub, microbatch=g, num_microbatches=m, zero=zero, ep=ep)
        return self.costs[key]


ZERO_CHOICES = (0, 1, 3)
"""The ZeRO layouts a pipeline stage is solved under (solver/forced.py), each a stage option
of the DP (and, for a model with routed experts E that dp divides, ZeRO-1 with the experts
stored split over dp, `ParallelConfig.ep`: without a memory budget the stage ILP keeps
experts whole where that is faster, so the lean layout is its own option): a stage's memory budget depends on the layers and in-flight microbatches the DP
gives it, which its ILP does not know, so the DP trades time for memory across them.
Solving a stage with each parameter's layout free (`update_free`) instead was measured on
llama3-70b at 1,024 H100s: all 54 stage solves chose ZeRO-0 layouts (23 mixing in whole
norm weights, which the runtime cannot run per stage), so the leaner layouts were solved
beside it anyway and the search got slower (191 stage solves against 168) with the same
plan. ZeRO-2 (each microbatch's gradients reduce-scattered into sharded accumulation) is
solved only for the submeshes where a result's stage chose ZeRO-3 (solve_pipeline_candidate):
it is never faster than ZeRO-1, so it can only win where memory rules ZeRO-1 out."""


def _schedules(p: int, m: int, num_layers: int, fixed: Fixed | None = None) -> list[Schedule]:
    out = [Schedule(name="gpipe"), Schedule(name="1f1b")]
    out += [Schedule(name="interleaved", chunks=v) for v in interleave_depths(p, num_layers) if m % p == 0]
    if num_layers >= 2 * p and m >= 2 * p:
        out.append(Schedule(name="zbv", chunks=2))
    return out if fixed is None else [s for s in out if fixed.schedule(s)]


def solve_pipeline_candidate(cand: PipelineCandidate, cache: StageCostCache, cluster: Cluster, *,
                             family: str, num_layers: int, info: Any,
                             cutoff_s: float = math.inf, fixed: Fixed | None = None) -> list[PipelineResult]:
    """Every schedule x (all options | each uniform option) DP solution of one candidate
    (`info`: the traced model's ModelInfo, for its heads) with a step time below
    `cutoff_s`. The all-options optimum bounds every uniform one from below, so when it
    is not below the cutoff the schedule's uniform DPs are skipped. `fixed`: only its
    submesh, ZeRO layouts, recompute policy, schedule and cuts."""
    D = cand.stage_devices(cluster)
    meshes = stage_submeshes(cluster, D, cand.microbatch, heads=info.heads, kv_heads=info.kv_heads,
                             max_rank_microbatch=MAX_RANK_MICROBATCH if fixed is None else None)
    policies = RECOMPUTE_CHOICES
    if fixed is not None:
        meshes = [m for m in meshes if m == (fixed.config.dp, fixed.config.tp)]
        policies = (fixed.config.recompute,)
    share = core_share(cluster)
    entries: list[tuple[SubmeshCosts, str, float]] = []

    def add(mesh: tuple[int, int], layouts: tuple[tuple[int, int], ...]) -> None:
        for sc in (cache.get(mesh, cand.microbatch, z, ep) for z, ep in layouts):
            if sc is None:
                continue
            p2p = boundary_p2p_s(cluster, cand.pp, D, sc.boundary_messages)
            for rc in policies:
                entries.append((sc, rc, p2p))

    experts = stacked_experts(cache.graph(cand.microbatch))
    for mesh in meshes:
        # ZeRO 0 / 1 / 3 over the stage's dp: weights whole and updated whole, weights whole
        # and their update sharded (gathered once per step), weights sharded (gathered per use);
        # and ZeRO-1 with the routed experts stored split over dp (expert parallelism)
        ep = fixed.config.ep if fixed is not None else 1
        if mesh[0] == 1:
            add(mesh, ((0, 1),))
        elif fixed is not None and fixed.zero_given:
            add(mesh, tuple((z, ep) for z in fixed.zeros()))
        else:
            layouts = [(z, ep) for z in ZERO_CHOICES]
            if ep == 1 and any(e % mesh[0] == 0 for e in experts):
                layouts.append((1, mesh[0]))
            add(mesh, tuple(layouts))
    if not entries:
        return []
    out = _dp_results(cand, entries, cluster, family=family, num_layers=num_layers, info=info, cutoff_s=cutoff_s,
                      fixed=fixed, share=share)
    # ZeRO-2 (module ZERO_CHOICES): where memory pushed a stage of a result to ZeRO-3, its
    # submesh is also solved under ZeRO-2 (weights whole, each microbatch's gradients
    # reduce-scattered into sharded accumulation: slower than ZeRO-1, leaner by the whole
    # gradient, never slower than ZeRO-3) and the DP runs again with those options
    if (fixed is None or not fixed.zero_given) and cand.num_microbatches > 1:
        pushed = sorted({sc.mesh for r in out for sc, _ in r.stages if sc.zero == 3})
        if pushed:
            for mesh in pushed:
                add(mesh, ((2, 1),))
            out = _dp_results(cand, entries, cluster, family=family, num_layers=num_layers, info=info,
                              cutoff_s=cutoff_s, fixed=fixed, share=share)
    return out


def _dp_results(cand: PipelineCandidate, entries: list[tuple[SubmeshCosts, str, float]], cluster: Cluster, *,
                family: str, num_layers: int, info: Any, cutoff_s: float, fixed: Fixed | None,
                share: float) -> list[PipelineResult]:
    """The stage DP over `entries` (submesh costs x recompute policy, with their boundary
    p2p time): every schedule x (all options | each uniform option) solution under
    `cutoff_s` (solve_pipeline_candidate)."""
    call = cost_model.pipeline_call_time_s(cluster)  # host time of a chunk call, every stage
    options = [sc.option(rc, p2p, key=i, call_s=call) for i, (sc, rc, p2p) in enumerate(entries)]
    budget = cluster.device_memory_bytes
    world_report = cost_model.loss_report_time_s((), (), cost_model.mesh_axis_links(cluster, (cluster.num_devices,))[0])
    out: list[PipelineResult] = []
    for schedule in _schedules(cand.pp, cand.num_microbatches, num_layers, fixed):
        if not schedule.allows(cand.pp, cand.num_microbatches):
            continue
        tables = [option_tables(num_layers, cand.pp, cand.num_microbatches, o, schedule, budget) for o in options]
        sets = [list(range(len(options)))] + ([[i] for i in range(len(options))] if len(options) > 1 else [])
        seen: set[tuple] = set()
        for subset in sets:
            # every result pays the world's all-reduce of the loss on top (the last stage's
            # own reduction, where its loss is Partial, is added below)
            sol = solve_pipeline(num_layers, cand.pp, cand.num_microbatches, [options[i] for i in subset], schedule,
                                 budget, tables=[tables[i] for i in subset], cutoff_s=cutoff_s - world_report,
                                 share=share, stage_layers=None if fixed is None else fixed.stage_layers)
            if sol is None:
                if len(subset) == len(options):
                    break  # no uniform option can beat the cutoff (or fit) either
                continue
            chosen = tuple(subset[i] for i in sol.options)
            key = (sol.stage_layers, chosen)
            if key in seen:
                continue
            seen.add(key)
            report = pipeline_loss_report_s(cluster, entries[chosen[-1]][0])
            if sol.step_time_s + report >= cutoff_s:
                continue
            stages = tuple((entries[i][0], entries[i][1]) for i in chosen)
            shape = PlanShape(family=family, name=info.name, heads=info.heads, kv_heads=info.kv_heads,
                              num_layers=num_layers, schedule=schedule.name, chunks=schedule.chunks,
                              stages=tuple(StageShape(num_layers=n, submesh=s.mesh, recompute=rc, zero=s.zero)
                                           for n, (s, rc) in zip(sol.stage_layers, stages)))
            sol = replace(sol, options=chosen)
            out.append(PipelineResult(candidate=cand, schedule=schedule, solution=sol, stages=stages,
                                      reason=runnable(shape), p2p_s=tuple(entries[i][2] for i in chosen),
                                      loss_report_s=report))
    return out
