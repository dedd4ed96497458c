"""Whole-plan search over pipeline degrees: one stage (per-op ILP) and pipelines (inter-op DP).

Where it sits: solver/, the planner `autopar search` and `autopar.compile` call (through
autopar/api.py `search_plans`, which supplies `trace_at`). It ranks
- one-stage plans (pp = 1): every (dp, tp) mesh x microbatch x recompute policy (none,
  selective, full: the step traced under the policy, autopar/recompute.py, as the runtime
  traces it; a policy that rewrites nothing is dropped), priced by the intra-op ILP on the
  whole step under the memory limit (solver/spmd_search.py), and
- pipelines (pp = p > 1, p stages of D = N / p devices): per global microbatch g (every
  dp x b with b <= MAX_RANK_MICROBATCH sequences per rank) the
  intra-op ILP is solved once per stage submesh (dp, tp) (dp tp = D, tp inside a node,
  dp | g) and ZeRO layout (parameters replicated over dp, or sharded over it), under the
  rules the runtime solves each chunk by (solver/forced.py solve_stage), memoised, its solution
  split into pre / one layer / post (solver/stage_costs.py); the inter-op DP
  (solver/stage_dp.py) then picks the cuts and each stage's (submesh, ZeRO, recompute)
  per schedule (gpipe, 1f1b, interleaved at every depth v of interleave_depths, zbv).

Every priced candidate is asked `autopar.capabilities.runnable`: only plans the runtime
executes are ranked and returned; the others (e.g. stages on different submeshes, the
zbv schedule) are kept as runners-up with the reason, so `autopar explain` says what
the runtime's limits cost. The DP is run over all options (the priced optimum) and over
each uniform option (one submesh, ZeRO and recompute for every stage: what the runtime
builds today).

Speed (branch and bound): each candidate (pp, g) gets a lower bound from one reference
trace at half the global batch (stage_costs.lower_bound_s: every op's FLOPs and bytes
split perfectly, no communication; for a pipeline m S / p with S the per-microbatch
bound of the whole model on D devices, plus the optimizer over P / N parameters).
Candidates are solved in bound order; the search stops once the next bound reaches the
top-th runnable step time. Tensor-parallel axes stay inside a node on multi-node
clusters (a mesh with tp across nodes is not tried). A one-stage candidate is not solved
when its memory lower bound (stage_costs.memory_lower_bound_bytes, per policy) is over
the budget, nor when the same mesh and microbatch with less recomputation fit or lost on
its LP bound (dominance: recomputation only adds forward compute; the one assumption
here that is not exact, as a memory-bound layout could cost more than recomputing).

Microbatch dominance: once a one-stage candidate (mesh, g) is solved to optimality (within
the ILP's relative gap, REL_GAP), or lost on its LP bound, and no plan of it can reach the
memory budget (its traced step with every tensor whole fits: each ILP memory row counts a
tensor at most whole), a smaller microbatch g' dividing g on the same mesh and policy is
not solved. Any plan P at g' (m' = G / g' microbatches) runs at g too (a batch split that
divides g' divides g), and the cost model is sub-additive in the batch (a kernel's or
collective's time is a fixed part plus parts linear in its sizes, wave counts
ceil(k x) <= k ceil(x)), so m c(P, g) + S(P) + A(m) <= m' c(P, g') + S(P) + A(m')
(S: the once-per-step terms, A: the accumulation, growing with the count): the optimum at
g is at least as fast. By the same argument a mesh on which g has no plan for a reason
other than memory (no placement keeps the batch split there: solver/intra_op/ilp.py
prune_gather_free) has none at g' either, so g' is not solved. What this assumes: the
step traced at g' is the one at g with a smaller batch (a model that branches on its
batch size may trace differently). On an 83k-parameter LSTM on cpu:4 it skips the traces
and solves of every smaller microbatch (bench_search.py --only small).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any

import cost_model
from autopar.capabilities import PlanShape, StageShape, runnable
from autopar.cluster import Cluster
from autopar.config import RECOMPUTE, ParallelConfig
from autopar.ir import Graph
from autopar.placement import Replicate
from autopar.explain import describe_config
from autopar.plan import (
    Alternative,
    InfeasiblePlanError,
    PipelineInfo,
    PipelineStage,
    Plan,
    SearchInfo,
)
from autopar.units import GIB
from cost_model import core_share
from solver.search import ProgressFn, Ranked, SearchResult
from solver.spmd_search import (
    MAX_MICROBATCH_CHOICES,
    AXIS_NAMES,
    Solved,
    SpmdCandidate,
    zero_is_uniform,
    TraceAt,
    _plan as spmd_plan,
    traced,
    candidates as spmd_candidates,
    solve_candidate,
)
from solver.stage_costs import (
    SubmeshCosts,
    lower_bound_s,
    memory_lower_bound_bytes,
    placement_summary,
    split_solution,
)
from solver.intra_op.backend import CutoffExceeded
from solver.intra_op.space import divisibility_signature, enumerate_strategies
from solver.stage_dp import PipelineSolution, Schedule, option_tables, solve_pipeline, stage_memory_parts

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


RECOMPUTE_CHOICES = ("none", "selective", "full")
MAX_RUNNERS_UP = 8
MAX_UNRUNNABLE_SHOWN = 3
"""Of the runners-up a plan lists, at most this many are candidates the runtime cannot run."""

MEMORY_BOUND_SLACK = 1.25
"""A one-stage candidate is not queued when its memory lower bound scaled from the
one- and two-sequence traces (stage_costs.memory_lower_bound_bytes, each tensor on the
line through its two sizes) exceeds the budget by this factor. Scaling the one-sequence
trace alone overshot (weight-sized backward tensors scaled with the batch: MPT-7b at 48
sequences 79.4 GiB where a 70.3 GiB plan exists; MPT-760m at 768 sequences 94.9 GiB, over
even this margin, where a 74.3 GiB plan exists and beats the published one); the margin
covers what is still not linear in the batch. The exact test is the same bound on the
candidate's own trace (`_over_memory`), which no plan of that trace beats."""


def _over_memory(graph: Graph, cluster: Cluster) -> bool:
    """No one-stage plan of `graph` (traced at the candidate's microbatch and recompute
    policy) fits: the ILP's own largest memory row with every tensor split over all
    devices is over the budget (stage_costs.memory_lower_bound_bytes). On llama3-70b's
    memory-bound candidates it equalled the ILP's smallest need (81.23 GiB) and it saves
    each a solve (5 s or more where the relaxation struggles)."""
    return memory_lower_bound_bytes(graph, cluster.num_devices) > cluster.device_memory_bytes * (1 + 1e-9)


def _note_unbound(unbound: dict[tuple[tuple[int, int], str], list[int]], cand: SpmdCandidate, graph: Graph,
                  cluster: Cluster) -> None:
    """Record `cand`'s microbatch for microbatch dominance (module docstring) when no plan
    of `graph` can reach the memory budget: its largest ILP memory row with every tensor
    whole (memory_lower_bound_bytes on one device) fits."""
    if memory_lower_bound_bytes(graph, 1) <= cluster.device_memory_bytes:
        unbound.setdefault((cand.mesh, cand.recompute), []).append(cand.microbatch)


def _dominated(unbound: dict[tuple[tuple[int, int], str], list[int]], cand: SpmdCandidate) -> bool:
    """Microbatch dominance (module docstring): a larger microbatch that `cand`'s divides
    was settled on the same mesh and policy where memory could not bind."""
    return any(g > cand.microbatch and g % cand.microbatch == 0 for g in unbound.get((cand.mesh, cand.recompute), ()))


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineCandidate:
    pp: int
    microbatch: int
    """Sequences per global microbatch."""
    num_microbatches: int

    def stage_devices(self, cluster: Cluster) -> int:
        return cluster.num_devices // self.pp


@dataclass(frozen=True, slots=True, kw_only=True)
class Fixed:
    """One configuration to price instead of a space to search (`autopar price`): the search
    restricted to it, so a configuration is priced exactly as the search prices it when it
    ranks it (same traces, ILP rules, stage costs and pipeline terms).

    What `config` leaves to the search stays the search's: per-op placements, and each
    parameter's ZeRO layout where `zero_given` is false (the one-stage ILP chooses per
    parameter; each pipeline stage's layout is the stage DP's pick among ZeRO 0, 1 and 3,
    and 2 where 3 won);
    the stage cuts where `stage_layers` is None."""

    config: ParallelConfig
    zero_given: bool = False
    stage_layers: tuple[int, ...] | None = None

    def spmd(self, c: SpmdCandidate) -> bool:
        k = self.config
        return k.pp == 1 and c.mesh == (k.dp, k.tp) and c.microbatch == k.micro_batch * k.dp

    def zeros(self) -> tuple[int, ...]:
        """A stage's ZeRO layout when given."""
        return (self.config.zero,)

    def schedule(self, sched: Schedule) -> bool:
        k = self.config
        name = {"zb": "zbv"}.get(k.schedule, k.schedule)
        return sched.name == name and sched.chunks == (k.interleave if name in ("interleaved", "zbv") else 1)


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


class _StageCostCache:
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
        """The stage solves' gather-free pruning passes (solver/intra_op/ilp.py prune_gather_free)."""

    def graph(self, g: int) -> Graph:
        return traced(self.graphs, self.trace_at, g)

    def get(self, mesh: tuple[int, int], g: int, zero: int) -> SubmeshCosts | None:
        """The stage costs of submesh `mesh` at global microbatch g (memoised): the ILP the
        runtime solves for each of the stage's chunks (solver/forced.py solve_stage, under
        the (dp, tp, zero) configuration's rules), solved once on the whole traced step
        and split into pieces (stage_costs.split_solution), so a stage is priced by the
        placements it runs."""
        key = (mesh, g, zero)
        if key in self.costs:
            return self.costs[key]
        from solver import forced

        dp, tp = mesh
        m = self.global_batch // g
        sub = _stage_cluster(self.cluster, dp * tp)
        graph = self.graph(g)
        config = ParallelConfig(dp=dp, tp=tp, zero=zero)
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
            log.info("stage ILP %s g=%d zero %d: %s", mesh, g, zero, exc)
            self.costs[key] = None
            return None
        self.costs[key] = split_solution(graph, sol, sub, microbatch=g, num_microbatches=m, zero=zero)
        return self.costs[key]


ZERO_CHOICES = (0, 1, 3)
"""The ZeRO layouts a pipeline stage is solved under (solver/forced.py), each a stage option
of the DP: a stage's memory budget depends on the layers and in-flight microbatches the DP
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


def solve_pipeline_candidate(cand: PipelineCandidate, cache: _StageCostCache, cluster: Cluster, *,
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

    def add(mesh: tuple[int, int], zeros: tuple[int, ...]) -> None:
        for sc in (cache.get(mesh, cand.microbatch, z) for z in zeros):
            if sc is None:
                continue
            p2p = boundary_p2p_s(cluster, cand.pp, D, sc.boundary_messages)
            for rc in policies:
                entries.append((sc, rc, p2p))

    for mesh in meshes:
        # ZeRO 0 / 1 / 3 over the stage's dp: weights whole and updated whole, weights whole
        # and their update sharded (gathered once per step), weights sharded (gathered per use)
        if mesh[0] == 1:
            add(mesh, (0,))
        elif fixed is not None and fixed.zero_given:
            add(mesh, fixed.zeros())
        else:
            add(mesh, ZERO_CHOICES)
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
                add(mesh, (2,))
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


def _pipeline_estimate(r: PipelineResult, cluster: Cluster, global_batch: int) -> cost_model.Estimate:
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
    cfg = _config(r)
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


def _config(r: PipelineResult) -> ParallelConfig:
    """The ParallelConfig of a uniform pipeline (stage 0's choices for a mixed one)."""
    sc, rc = r.stages[0]
    dp, tp = sc.mesh
    sched = r.schedule.name if r.schedule.name in ("gpipe", "1f1b", "interleaved") else "1f1b"
    return ParallelConfig(tp=tp, pp=r.candidate.pp, dp=dp, zero=sc.zero, micro_batch=r.candidate.microbatch // dp,
                          schedule=sched,  # type: ignore[arg-type]
                          interleave=r.schedule.chunks if sched == "interleaved" else 1,
                          recompute=rc)  # type: ignore[arg-type]


def _why(entry_label: str, entry_step: float, entry_terms: dict[str, float], reason: str | None,
         best_step: float, best_terms: dict[str, float]) -> tuple[str, float, str]:
    rel = entry_step / best_step - 1 if best_step else 0.0
    if reason is not None:
        verdict = "faster but" if entry_step < best_step else f"{rel:+.1%} and"
        return (entry_label, entry_step, f"{verdict} not run by the runtime today: {reason}")
    grew = sorted(((entry_terms.get(k, 0.0) - best_terms.get(k, 0.0), k) for k in set(entry_terms) | set(best_terms)),
                  reverse=True)
    parts = [f"{k} +{d:.3g} s" for d, k in grew[:2] if d > 0]
    return (entry_label, entry_step, f"{rel:+.1%}: " + (", ".join(parts) if parts else "equal terms, later in order"))


def _collectives_per_microbatch(sc: SubmeshCosts) -> tuple[tuple[str, str, int, int], ...]:
    from collections import Counter

    calls: Counter = Counter()
    volume: Counter = Counter()
    m = sc.num_microbatches
    for c in sc.solution.collectives:
        times = c.weight / (m if c.gradient_sync else 1)
        key = (c.kind, AXIS_NAMES[c.axis])
        calls[key] += times
        volume[key] += times * c.bytes
    return tuple((k, a, int(round(calls[(k, a)])), int(round(volume[(k, a)]))) for k, a in sorted(calls))


def _pipeline_plan(r: PipelineResult, est: cost_model.Estimate, cluster: Cluster, *, global_batch: int, model: str,
                   fingerprint: str, num_layers: int, info: SearchInfo,
                   runners_up: tuple[tuple[str, float, str], ...]) -> Plan:
    sol = r.solution
    stages = []
    first = 0
    for k, (n, (sc, rc)) in enumerate(zip(sol.stage_layers, r.stages)):
        stages.append(PipelineStage(
            index=k, first_layer=first, num_layers=n, has_embedding=k == 0, has_head=k == len(sol.stage_layers) - 1,
            submesh=sc.mesh, recompute=rc, zero=sc.zero, time_per_microbatch_s=sol.stage_times_s[k],
            memory_bytes=int(sol.stage_memory_bytes[k]),
            inflight_microbatches=r.schedule.inflight(k, len(sol.stage_layers), r.candidate.num_microbatches),
            placements=placement_summary(sc.graph, sc.solution, ("pre",) * (k == 0) + ("layer",) + (
                ("post",) if k == len(sol.stage_layers) - 1 else ())),
            collectives=_collectives_per_microbatch(sc)))
        first += n
    cfg = _config(r)
    pipe = PipelineInfo(schedule=r.schedule.name, chunks=r.schedule.chunks, microbatch=r.candidate.microbatch,
                        num_microbatches=r.candidate.num_microbatches, stages=tuple(stages), bubble_s=sol.bubble_s,
                        p2p_s=dict(est.time_breakdown)["p2p_s"], runners_up=runners_up)
    seq = r.stages[0][0].graph.model.seq
    return Plan(model=model, model_fingerprint=fingerprint, num_layers=num_layers, seq=seq, global_batch=global_batch,
                cluster=cluster.spec, memory_limit_bytes=int(cluster.device_memory_bytes), config=cfg,
                stage_layers=sol.stage_layers, mesh_shape=(cfg.pp, cfg.dp, cfg.tp), stages=(), intra_op=(),
                predicted=est, bubble_fraction=sol.bubble_s / r.step_time_s if r.step_time_s else 0.0,
                search=info, placements=(), intra_op_info=None, pipeline=pipe)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Entry:
    """One priced plan of either kind, for ranking."""

    step_time_s: float
    peak_memory_bytes: int
    label: str
    reason: str | None
    terms: dict
    spmd: Solved | None = None
    pipeline: PipelineResult | None = None
    estimate: Any = None

    def sort_key(self) -> tuple:
        return (self.step_time_s, self.peak_memory_bytes, self.label)


def search(trace_at: TraceAt, cluster: Cluster, *, global_batch: int, model: str, fingerprint: str,
           family: str = "", top: int = 5, time_limit_s: float | None = None, progress: ProgressFn | None = None,
           num_layers: int | None = None, microbatch_choices: int = MAX_MICROBATCH_CHOICES,
           max_pp: int | None = None, min_pp: int = 1, fixed: Fixed | None = None) -> SearchResult:
    """Rank one-stage plans and pipelines (module docstring); the runnable best as Plans.
    `fixed`: price that one configuration (`Fixed`); the result ranks what it allows.
    `family` names the zoo's structures ("gpt", "llama": their pipelines take tp from the
    rule tables); "" for any other model, whose pipelines run data-parallel stages cut at its
    repeated layers (capabilities.runnable says which). `min_pp` > 1 searches pipelines only."""
    t0 = time.perf_counter()
    n = cluster.num_devices
    # every microbatch per mesh, largest first: the first `microbatch_choices` that pass the
    # memory bound are solved (vs_hand_tuned.py found the three largest all over memory while
    # a smaller one fit and won)
    graphs: dict[Any, Graph] = {}
    # the bounds scale one reference trace and the line to its double (stage_costs
    # lower_bound_s, memory_lower_bound_bytes: linear in the rows, so any reference
    # serves): half the global batch, so that the pair is the two largest one-stage
    # microbatches, traced for their solves anyway (a model traced per microbatch pays for
    # no trace only the bounds read)
    ref_g = global_batch // 2 if global_batch % 2 == 0 else 1
    ref = traced(graphs, trace_at, ref_g)
    spmd = [c for c in spmd_candidates(cluster, global_batch, global_batch, heads=ref.model.heads,
                                       kv_heads=ref.model.kv_heads)
            if min_pp == 1 and (fixed is None or fixed.spmd(c))]
    if not spmd and min_pp == 1 and fixed is None:
        raise InfeasiblePlanError(f"no microbatch of the global batch {global_batch} splits over {cluster.spec}; "
                                  f"use a global batch that is a multiple of the device count")
    L = num_layers if num_layers is not None else ref.model.num_layers
    allow_pp = L >= 2 and max_pp != 1  # capabilities.runnable decides which pipelines run
    pipes = [c for c in pipeline_candidates(cluster, global_batch, L, max_pp=max_pp) if c.pp >= min_pp] \
        if allow_pp else []
    if fixed is not None:
        k = fixed.config
        g = k.micro_batch * k.dp
        pipes = [PipelineCandidate(pp=k.pp, microbatch=g, num_microbatches=global_batch // g)] \
            if k.pp > 1 and allow_pp and global_batch % g == 0 else []
    if fixed is not None and not spmd and not pipes:
        raise InfeasiblePlanError(f"{fixed.config} does not split {model} over {cluster.spec} at global batch "
                                  f"{global_batch}: its microbatch must divide the global batch, and a pipeline "
                                  "needs a model the runtime can cut into at least pp stages")
    if not spmd and not pipes:
        raise InfeasiblePlanError(f"no pipeline of {model} splits over {cluster.spec} with at least pp >= {min_pp}: "
                                  "it needs a model the runtime can cut into stages and a global batch of at least "
                                  "2 pp microbatches; search with pp 1")
    # one-stage recompute: the step traced under each policy (what the runtime traces); a
    # policy that rewrites nothing (no repeated layers) is the same candidate as none
    refs = {"none": ref}
    if spmd and L:  # recompute rewrites repeated layers only (autopar/recompute.py): none, nothing to trace
        wanted = RECOMPUTE_CHOICES if fixed is None else (fixed.config.recompute,)
        for rc in (p for p in wanted if p != "none"):
            g_rc = traced(graphs, trace_at, ref_g, rc)
            if len(g_rc.nodes) != len(ref.nodes):
                refs[rc] = g_rc
    # the memory pre-filter scales each tensor along the line through its sizes at one and
    # two sequences (stage_costs.memory_lower_bound_bytes): weight-sized backward tensors stay
    # fixed
    doubled = {rc: traced(graphs, trace_at, 2 * ref_g, rc) for rc in refs} \
        if any(c.microbatch > ref_g for c in spmd) else {}
    t_trace = time.perf_counter() - t0
    share = core_share(cluster)
    opt_lb = cost_model.optimizer_time_s(ref.model.num_parameters / n, cluster.hardware) * share
    bounds: dict[tuple[int, int, str], dict[str, float]] = {}

    def per_micro_lb(devices: int, g: int, rc: str = "none") -> float:
        if (devices, g, rc) not in bounds:
            bounds[(devices, g, rc)] = lower_bound_s(refs[rc], cluster, devices, g / ref_g)
        b = bounds[(devices, g, rc)]
        return b["pre"] + L * b["layer"] + b["post"]

    queue: list[tuple[float, int, Any]] = []
    pruned_memory = 0
    kept_per_mesh: dict[tuple[tuple[int, int], str], int] = {}
    # a fixed policy that rewrites nothing here is priced as none, as the search does
    policies = list(refs) if fixed is None else [fixed.config.recompute if fixed.config.recompute in refs else "none"]
    for i, c in enumerate(replace(c, recompute=rc) for c in spmd for rc in policies):
        key = (c.mesh, c.recompute)
        if kept_per_mesh.get(key, 0) >= microbatch_choices:
            continue  # smaller microbatches than enough fitting ones: only memory to gain
        if fixed is None and memory_lower_bound_bytes(refs[c.recompute], n, c.microbatch / ref_g, doubled.get(c.recompute)) \
                > MEMORY_BOUND_SLACK * cluster.device_memory_bytes:
            pruned_memory += 1
            continue
        kept_per_mesh[key] = kept_per_mesh.get(key, 0) + 1
        queue.append((c.num_microbatches * per_micro_lb(n, c.microbatch, c.recompute) + opt_lb, i, c))
    for j, c in enumerate(pipes):
        lb = c.num_microbatches * per_micro_lb(n // c.pp, c.microbatch) / c.pp + opt_lb
        queue.append((lb, len(spmd) * len(refs) + j, c))
    queue.sort(key=lambda q: (q[0], q[1]))
    cache = _StageCostCache(trace_at, cluster, global_batch, graphs,
                            None if time_limit_s is None else max(1.0, time_limit_s / max(1, len(queue))))
    entries: list[_Entry] = []
    smallest: list[float] = []
    solved_count = pruned = pruned_lp = not_fit = pruned_dominated = 0
    settled: dict[tuple[tuple[int, int], int], int] = {}
    """(mesh, microbatch) -> the least recompute policy (index) at which a one-stage
    candidate fit or lost on its LP bound."""
    unbound: dict[tuple[tuple[int, int], str], list[int]] = {}
    """(mesh, recompute) -> microbatches solved to optimality (or lost on their LP bound)
    that no plan could take over the memory budget, or without any plan for a reason other
    than memory (microbatch dominance, module docstring)."""
    complete = True
    reasons: list[str] = []  # why a fixed configuration's ILP found no plan
    for idx, (lb, _i, cand) in enumerate(queue):
        runnable_times = sorted(e.step_time_s for e in entries if e.reason is None)
        if len(runnable_times) >= top and lb >= runnable_times[top - 1]:
            pruned = len(queue) - idx
            break
        # what a candidate must beat to enter the top: its solve stops once a bound reaches
        # it (the one-stage ILP after its LP relaxation, the DP per schedule); the margin
        # keeps exact ties, which the ranking breaks by memory and label
        cutoff = runnable_times[top - 1] * (1 + 1e-9) if len(runnable_times) >= top else math.inf
        if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s and runnable_times:
            complete = False
            pruned = len(queue) - idx
            break
        if isinstance(cand, SpmdCandidate) and \
                RECOMPUTE.index(cand.recompute) > settled.get((cand.mesh, cand.microbatch), len(RECOMPUTE)):
            # dominance: the same mesh and microbatch with less recomputation fit, or its LP
            # bound already lost; recomputation only adds forward compute (module docstring)
            pruned_dominated += 1
            continue
        if isinstance(cand, SpmdCandidate) and _dominated(unbound, cand):
            pruned_dominated += 1
            continue
        if progress:
            progress("solve", idx, len(queue))
        solved_count += 1
        if isinstance(cand, SpmdCandidate) and fixed is None and \
                _over_memory(traced(graphs, trace_at, cand.microbatch, cand.recompute), cluster):
            not_fit += 1
            continue
        if isinstance(cand, SpmdCandidate):
            reasons_before, smallest_before = len(reasons), len(smallest)
            try:
                s = solve_candidate(trace_at, cand, cluster, global_batch, graphs=graphs,
                                    time_limit_s=cache.time_limit_s, smallest=smallest,
                                    cutoff_step_s=cutoff if math.isfinite(cutoff) else None,
                                    zero=fixed.config.zero if fixed is not None and fixed.zero_given else None,
                                    reasons=reasons)
            except CutoffExceeded as exc:
                log.info("one-stage %s rc-%s: %s x %d microbatches: pruned", cand.mesh, cand.recompute, exc,
                         cand.num_microbatches)
                pruned_lp += 1
                settled.setdefault((cand.mesh, cand.microbatch), RECOMPUTE.index(cand.recompute))
                _note_unbound(unbound, cand, traced(graphs, trace_at, cand.microbatch, cand.recompute), cluster)
                continue
            if s is None or not s.estimate.fits:
                not_fit += 1
                if s is None and len(reasons) > reasons_before and len(smallest) == smallest_before:
                    # no plan, and not for memory (a memory-bound failure says the smallest need)
                    unbound.setdefault((cand.mesh, cand.recompute), []).append(cand.microbatch)
                continue
            settled.setdefault((cand.mesh, cand.microbatch), RECOMPUTE.index(cand.recompute))
            if s.solution.status == "optimal":
                _note_unbound(unbound, cand, s.graph, cluster)
            e = s.estimate
            label = describe_config(replace(cand.config, zero=dict(e.config)["zero"]), (L,), global_batch)
            entries.append(_Entry(step_time_s=e.step_time_s, peak_memory_bytes=int(e.peak_memory_bytes),
                                  label=label, reason=None, terms=dict(e.time_breakdown), spmd=s, estimate=e))
        else:
            results = solve_pipeline_candidate(cand, cache, cluster, family=family, num_layers=L, info=ref.model,
                                               cutoff_s=cutoff, fixed=fixed)
            if not results and math.isfinite(cutoff):
                pruned_lp += 1  # nothing below the cutoff (or nothing fits: not told apart here)
            elif not results:
                not_fit += 1
            for r in results:
                est = _pipeline_estimate(r, cluster, global_batch)
                entries.append(_Entry(step_time_s=r.step_time_s, peak_memory_bytes=int(est.peak_memory_bytes),
                                      label=r.describe(), reason=r.reason, terms=dict(est.time_breakdown),
                                      pipeline=r, estimate=est))
    if progress:
        progress("solve", len(queue), len(queue))
    entries.sort(key=_Entry.sort_key)
    ranked_entries = [e for e in entries if e.reason is None]
    if not ranked_entries and not smallest and spmd:
        # every one-stage candidate was skipped by its memory bound: solve the leanest one for
        # the exact smallest memory the error message reports
        lean_rc = list(refs)[-1]
        leanest = min((replace(c, recompute=lean_rc) for c in spmd),
                      key=lambda c: (memory_lower_bound_bytes(refs[lean_rc], n, c.microbatch / ref_g,
                                                              doubled.get(lean_rc)), c.mesh))
        solve_candidate(trace_at, leanest, cluster, global_batch, graphs=graphs, time_limit_s=cache.time_limit_s,
                        smallest=smallest)
    if not ranked_entries and fixed is not None and reasons:
        raise InfeasiblePlanError(reasons[0], min_memory_bytes=min(smallest) if smallest else None)
    if not ranked_entries:
        need = min(smallest) if smallest else None
        raise InfeasiblePlanError(
            f"No plan fits {cluster.device_memory_bytes / GIB:.3g} GiB/device for {model} on {cluster.spec} "
            f"(global batch {global_batch})" + (f"; the smallest needs {need / GIB:.3g} GiB per device (one stage, "
                                                "every mesh tried)"
                                                if need is not None else "")
            + ". Add devices, raise --memory-gb, or use a smaller global batch", min_memory_bytes=need)
    info = SearchInfo(cost_model="solver.intra_op ILP per stage + solver.stage_dp inter-op DP",
                      num_candidates=len(queue) + pruned_memory, num_priced=solved_count - pruned_lp,
                      num_pruned_memory=pruned_memory,
                      num_pruned_dominated=pruned + pruned_lp + pruned_dominated, num_not_fitting=not_fit, complete=complete, alternatives=())
    ranked = tuple(_ranked(e, L) for e in ranked_entries)
    plans = []
    for i, e in enumerate(ranked_entries[:top]):
        # the nearest runners-up, and the best few the runtime cannot run (what its limits cost)
        unrunnable = [x for x in entries if x.reason is not None][:MAX_UNRUNNABLE_SHOWN]
        others = sorted(unrunnable + [x for x in entries if x is not e and x.reason is None][
            :MAX_RUNNERS_UP - len(unrunnable)], key=_Entry.sort_key)
        why = tuple(_why(x.label, x.step_time_s, x.terms, x.reason, e.step_time_s, e.terms) for x in others)
        alternatives = tuple(Alternative(config=r.config, stage_layers=r.stage_layers,
                                         step_time_s=r.estimate.step_time_s,
                                         peak_memory_bytes=int(r.estimate.peak_memory_bytes), fits=True)
                             for r in ranked[i + 1:i + 9])
        this_info = replace(info, alternatives=alternatives)
        if e.spmd is not None:
            plan = spmd_plan(e.spmd, ranked[i:], cluster, global_batch=global_batch, model=model,
                             fingerprint=fingerprint, num_candidates=len(queue), not_fit=not_fit)
            plan = replace(plan, search=this_info, pipeline=_one_stage_info(e, L, why))
        else:
            plan = _pipeline_plan(e.pipeline, e.estimate, cluster, global_batch=global_batch, model=model,
                                  fingerprint=fingerprint, num_layers=L, info=this_info, runners_up=why)
        plans.append(plan)
    elapsed = time.perf_counter() - t0
    log.info("search: %d candidates (%d one-stage, %d pipelines), %d solved, %d pruned by bound before solving, "
             "%d while solving; %d stage ILPs; best %s, step %.4g s; %.1f s", len(queue), len(spmd), len(pipes),
             solved_count - pruned_lp, pruned, pruned_lp,
             sum(1 for v in cache.costs.values() if v is not None), ranked_entries[0].label,
             ranked_entries[0].step_time_s, elapsed)
    phases = (("trace", t_trace), ("solve", elapsed - t_trace))
    return SearchResult(ranked=ranked[:top], plan=plans[0], phases=phases, search_time_s=elapsed, plans=tuple(plans))


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


def _ranked(e: _Entry, num_layers: int) -> Ranked:
    if e.spmd is not None:
        s = e.spmd
        config = replace(s.candidate.config, zero=dict(s.estimate.config)["zero"])
        return Ranked(config=config, stage_layers=(num_layers,), estimate=s.estimate, bubble_fraction=0.0,
                      repeated_axes=repeated_axes(s.solution),
                      zero_mixed=not zero_is_uniform(s.graph, s.solution, config))
    r = e.pipeline
    return Ranked(config=_config(r), stage_layers=r.solution.stage_layers, estimate=e.estimate,
                  bubble_fraction=r.solution.bubble_s / r.step_time_s if r.step_time_s else 0.0,
                  zero_mixed=len({sc.zero for sc, _ in r.stages}) > 1)


def _one_stage_info(e: _Entry, num_layers: int, why: tuple[tuple[str, float, str], ...]) -> PipelineInfo:
    s = e.spmd
    c = s.candidate
    stage = PipelineStage(index=0, first_layer=0, num_layers=num_layers, has_embedding=True, has_head=True,
                          submesh=c.mesh, recompute=c.recompute, zero=dict(s.estimate.config)["zero"],
                          time_per_microbatch_s=s.solution.cost.total_s, memory_bytes=int(s.estimate.peak_memory_bytes),
                          inflight_microbatches=1.0, placements=(), collectives=())
    return PipelineInfo(schedule="none", chunks=1, microbatch=c.microbatch, num_microbatches=c.num_microbatches,
                        stages=(stage,), bubble_s=0.0, p2p_s=0.0, runners_up=why)


__all__ = ["PipelineCandidate", "PipelineResult", "pipeline_candidates", "search"]
