"""Whole-plan search over pipeline degrees: one stage (per-op ILP) and pipelines (inter-op DP).

Where it sits: solver/, the planner `autopar search` and `autopar.compile` call (through
autopar/api.py `search_plans`, which supplies `trace_at` and a `SearchConfig`:
solver/search_config.py). The pipeline candidates, their stage costs and DP are
solver/pipeline_stages.py's, and a ranked pipeline becomes a Plan in
solver/pipeline_plans.py; this module queues, bounds and ranks. It ranks
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
other than memory (no placement keeps the batch split there: solver/intra_op/restrict.py
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
from autopar.cluster import Cluster
from autopar.config import RECOMPUTE
from autopar.explain import describe_config
from autopar.ir import Graph
from autopar.estimate import CommunicationTime
from autopar.plan import Alternative, InfeasiblePlanError, PipelineInfo, SearchInfo, StageInfo
from autopar.units import GIB
from cost_model import core_share
from solver.comm_time import one_stage_communication, pipeline_communication
from solver.intra_op.backend import CutoffExceeded
from solver.pipeline_plans import pipeline_config, pipeline_estimate, pipeline_plan, repeated_axes
from solver.pipeline_stages import (
    RECOMPUTE_CHOICES,
    PipelineCandidate,
    PipelineResult,
    StageCostCache,
    pipeline_candidates,
    solve_pipeline_candidate,
)
from solver.results import ProgressFn, Ranked, SearchResult
from solver.search_config import SearchConfig
from solver.spmd_search import (
    Solved,
    SpmdCandidate,
    TraceAt,
    candidates as spmd_candidates,
    solve_candidate,
    spmd_plan,
    traced,
    zero_is_uniform,
)
from solver.stage_costs import lower_bound_s, memory_lower_bound_bytes

log = logging.getLogger(__name__)

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


def search(trace_at: TraceAt, cluster: Cluster, config: SearchConfig, *,
           progress: ProgressFn | None = None) -> SearchResult:
    """Rank one-stage plans and pipelines (module docstring); the runnable best as Plans.
    `config.fixed`: price that one configuration (`Fixed`); the result ranks what it allows.
    `config.min_pp` > 1 searches pipelines only. `progress` is told of each solve."""
    run = _Search(trace_at, cluster, config, progress)
    run.trace_references()
    queue, pruned_memory = run.queue()
    run.solve(queue)
    return run.result(queue, pruned_memory)


class _Search:
    """One search's state, in the order `search` runs its steps: the reference traces and the
    candidates, the queue in lower-bound order, the solves (branch and bound), the plans."""

    def __init__(self, trace_at: TraceAt, cluster: Cluster, config: SearchConfig,
                 progress: ProgressFn | None) -> None:
        self.trace_at, self.cluster, self.config, self.progress = trace_at, cluster, config, progress
        self.t0 = time.perf_counter()
        self.graphs: dict[Any, Graph] = {}
        self.entries: list[_Entry] = []
        self.smallest: list[float] = []
        self.solved_count = self.pruned = self.pruned_lp = self.not_fit = self.pruned_dominated = 0
        self.settled: dict[tuple[tuple[int, int], int], int] = {}
        """(mesh, microbatch) -> the least recompute policy (index) at which a one-stage
        candidate fit or lost on its LP bound."""
        self.unbound: dict[tuple[tuple[int, int], str], list[int]] = {}
        """(mesh, recompute) -> microbatches solved to optimality (or lost on their LP bound)
        that no plan could take over the memory budget, or without any plan for a reason other
        than memory (microbatch dominance, module docstring)."""
        self.complete = True
        self.reasons: list[str] = []  # why a fixed configuration's ILP found no plan

    def trace_references(self) -> None:
        """The reference traces the bounds scale, and the one-stage and pipeline candidates."""
        trace_at, cluster, config, graphs = self.trace_at, self.cluster, self.config, self.graphs
        global_batch, fixed, min_pp, model = config.global_batch, config.fixed, config.min_pp, config.model
        # every microbatch per mesh, largest first: those that pass the memory bound are queued
        # (at most `microbatch_choices` where set; vs_hand_tuned.py found the largest few over
        # memory, or fitting only under heavier layouts, while a smaller one fit and won)
        # the bounds scale one reference trace and the line to its double (stage_costs
        # lower_bound_s, memory_lower_bound_bytes: linear in the rows, so any reference
        # serves): half the global batch, so that the pair is the two largest one-stage
        # microbatches, traced for their solves anyway (a model traced per microbatch pays for
        # no trace only the bounds read)
        self.ref_g = ref_g = global_batch // 2 if global_batch % 2 == 0 else 1
        self.ref = ref = traced(graphs, trace_at, ref_g)
        self.spmd = spmd = [c for c in spmd_candidates(cluster, global_batch, global_batch, heads=ref.model.heads,
                                                       kv_heads=ref.model.kv_heads)
                            if min_pp == 1 and (fixed is None or fixed.spmd(c))]
        if not spmd and min_pp == 1 and fixed is None:
            raise InfeasiblePlanError(f"no microbatch of the global batch {global_batch} splits over {cluster.spec}; "
                                      f"use a global batch that is a multiple of the device count")
        self.L = L = config.num_layers if config.num_layers is not None else ref.model.num_layers
        allow_pp = L >= 2 and config.max_pp != 1  # capabilities.runnable decides which pipelines run
        pipes = [c for c in pipeline_candidates(cluster, global_batch, L, max_pp=config.max_pp) if c.pp >= min_pp] \
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
            raise InfeasiblePlanError(f"no pipeline of {model} splits over {cluster.spec} with at least pp >= "
                                      f"{min_pp}: it needs a model the runtime can cut into stages and a global batch "
                                      "of at least 2 pp microbatches; search with pp 1")
        self.pipes = pipes
        # one-stage recompute: the step traced under each policy (what the runtime traces); a
        # policy that rewrites nothing (no repeated layers) is the same candidate as none
        self.refs = refs = {"none": ref}
        if spmd and L:  # recompute rewrites repeated layers only (autopar/recompute.py): none, nothing to trace
            wanted = RECOMPUTE_CHOICES if fixed is None else (fixed.config.recompute,)
            for rc in (p for p in wanted if p != "none"):
                g_rc = traced(graphs, trace_at, ref_g, rc)
                if len(g_rc.nodes) != len(ref.nodes):
                    refs[rc] = g_rc
        # the memory pre-filter scales each tensor along the line through its sizes at one and
        # two sequences (stage_costs.memory_lower_bound_bytes): weight-sized backward tensors stay
        # fixed
        self.doubled = {rc: traced(graphs, trace_at, 2 * ref_g, rc) for rc in refs} \
            if any(c.microbatch > ref_g for c in spmd) else {}
        self.t_trace = time.perf_counter() - self.t0

    def queue(self) -> tuple[list[tuple[float, int, Any]], int]:
        """(lower bound, order, candidate) for every candidate not ruled out by its memory
        bound, in bound order; and how many were ruled out."""
        cluster, fixed, refs, spmd, ref_g = self.cluster, self.config.fixed, self.refs, self.spmd, self.ref_g
        n, L = cluster.num_devices, self.L
        share = core_share(cluster)
        opt_lb = cost_model.optimizer_time_s(self.ref.model.num_parameters / n, cluster.hardware) * share
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
        policies = list(refs) if fixed is None else [fixed.config.recompute if fixed.config.recompute in refs
                                                     else "none"]
        for i, c in enumerate(replace(c, recompute=rc) for c in spmd for rc in policies):
            key = (c.mesh, c.recompute)
            if self.config.microbatch_choices is not None and kept_per_mesh.get(key, 0) >= self.config.microbatch_choices:
                continue  # smaller microbatches than enough fitting ones: only memory to gain
            if fixed is None and memory_lower_bound_bytes(refs[c.recompute], n, c.microbatch / ref_g,
                                                          self.doubled.get(c.recompute)) \
                    > MEMORY_BOUND_SLACK * cluster.device_memory_bytes:
                pruned_memory += 1
                continue
            kept_per_mesh[key] = kept_per_mesh.get(key, 0) + 1
            queue.append((c.num_microbatches * per_micro_lb(n, c.microbatch, c.recompute) + opt_lb, i, c))
        for j, c in enumerate(self.pipes):
            lb = c.num_microbatches * per_micro_lb(n // c.pp, c.microbatch) / c.pp + opt_lb
            queue.append((lb, len(spmd) * len(refs) + j, c))
        queue.sort(key=lambda q: (q[0], q[1]))
        time_limit_s = self.config.time_limit_s
        self.cache = StageCostCache(self.trace_at, cluster, self.config.global_batch, self.graphs,
                                    None if time_limit_s is None else max(1.0, time_limit_s / max(1, len(queue))))
        return queue, pruned_memory

    def solve(self, queue: list[tuple[float, int, Any]]) -> None:
        """Solve the candidates in bound order until the next bound cannot enter the top, or
        the time limit is spent (branch and bound, module docstring)."""
        top, time_limit_s = self.config.top, self.config.time_limit_s
        for idx, (lb, _i, cand) in enumerate(queue):
            runnable_times = sorted(e.step_time_s for e in self.entries if e.reason is None)
            if len(runnable_times) >= top and lb >= runnable_times[top - 1]:
                self.pruned = len(queue) - idx
                break
            # what a candidate must beat to enter the top: its solve stops once a bound reaches
            # it (the one-stage ILP after its LP relaxation, the DP per schedule); the margin
            # keeps exact ties, which the ranking breaks by memory and label
            cutoff = runnable_times[top - 1] * (1 + 1e-9) if len(runnable_times) >= top else math.inf
            if time_limit_s is not None and time.perf_counter() - self.t0 > time_limit_s and runnable_times:
                self.complete = False
                self.pruned = len(queue) - idx
                break
            if isinstance(cand, SpmdCandidate) and \
                    RECOMPUTE.index(cand.recompute) > self.settled.get((cand.mesh, cand.microbatch), len(RECOMPUTE)):
                # dominance: the same mesh and microbatch with less recomputation fit, or its LP
                # bound already lost; recomputation only adds forward compute (module docstring)
                self.pruned_dominated += 1
                continue
            if isinstance(cand, SpmdCandidate) and _dominated(self.unbound, cand):
                self.pruned_dominated += 1
                continue
            if self.progress:
                self.progress("solve", idx, len(queue))
            self.solved_count += 1
            if isinstance(cand, SpmdCandidate):
                self.solve_one_stage(cand, cutoff)
            else:
                self.solve_pipeline(cand, cutoff)
        if self.progress:
            self.progress("solve", len(queue), len(queue))

    def solve_one_stage(self, cand: SpmdCandidate, cutoff: float) -> None:
        """Solve a one-stage candidate's ILP; record its plan, or why it has none."""
        cluster, graphs, trace_at, fixed = self.cluster, self.graphs, self.trace_at, self.config.fixed
        if fixed is None and _over_memory(traced(graphs, trace_at, cand.microbatch, cand.recompute), cluster):
            self.not_fit += 1
            return
        reasons_before, smallest_before = len(self.reasons), len(self.smallest)
        if fixed is not None and fixed.config.ep > 1:
            cand = replace(cand, ep=fixed.config.ep)
        try:
            s = solve_candidate(trace_at, cand, cluster, self.config.global_batch, graphs=graphs,
                                time_limit_s=self.cache.time_limit_s, smallest=self.smallest,
                                cutoff_step_s=cutoff if math.isfinite(cutoff) else None,
                                zero=fixed.config.zero if fixed is not None and fixed.zero_given else None,
                                reasons=self.reasons)
        except CutoffExceeded as exc:
            log.info("one-stage %s rc-%s: %s x %d microbatches: pruned", cand.mesh, cand.recompute, exc,
                     cand.num_microbatches)
            self.pruned_lp += 1
            self.settled.setdefault((cand.mesh, cand.microbatch), RECOMPUTE.index(cand.recompute))
            _note_unbound(self.unbound, cand, traced(graphs, trace_at, cand.microbatch, cand.recompute), cluster)
            return
        if s is None or not s.estimate.fits:
            self.not_fit += 1
            if s is None and len(self.reasons) > reasons_before and len(self.smallest) == smallest_before:
                # no plan, and not for memory (a memory-bound failure says the smallest need)
                self.unbound.setdefault((cand.mesh, cand.recompute), []).append(cand.microbatch)
            return
        self.settled.setdefault((cand.mesh, cand.microbatch), RECOMPUTE.index(cand.recompute))
        if s.solution.status == "optimal":
            _note_unbound(self.unbound, cand, s.graph, cluster)
        e = s.estimate
        label = describe_config(replace(cand.config, zero=dict(e.config)["zero"]), (self.L,), self.config.global_batch)
        self.entries.append(_Entry(step_time_s=e.step_time_s, peak_memory_bytes=int(e.peak_memory_bytes),
                                   label=label, reason=None, terms=dict(e.time_breakdown), spmd=s, estimate=e))

    def solve_pipeline(self, cand: PipelineCandidate, cutoff: float) -> None:
        """Solve a pipeline candidate's stage ILPs and DP; record every result under the cutoff."""
        results = solve_pipeline_candidate(cand, self.cache, self.cluster, family=self.config.family,
                                           num_layers=self.L, info=self.ref.model, cutoff_s=cutoff,
                                           fixed=self.config.fixed)
        if not results and math.isfinite(cutoff):
            self.pruned_lp += 1  # nothing below the cutoff (or nothing fits: not told apart here)
        elif not results:
            self.not_fit += 1
        for r in results:
            est = pipeline_estimate(r, self.cluster, self.config.global_batch)
            self.entries.append(_Entry(step_time_s=r.step_time_s, peak_memory_bytes=int(est.peak_memory_bytes),
                                       label=r.describe(), reason=r.reason, terms=dict(est.time_breakdown),
                                       pipeline=r, estimate=est))

    def no_plan_error(self) -> InfeasiblePlanError:
        """Why nothing ranked: the fixed configuration's reason, or the smallest memory any
        one-stage plan needs (the leanest candidate solved for it when every one was skipped
        by its memory bound)."""
        cluster, config, refs, smallest = self.cluster, self.config, self.refs, self.smallest
        if not smallest and self.spmd:
            # every one-stage candidate was skipped by its memory bound: solve the leanest one for
            # the exact smallest memory the error message reports
            lean_rc = list(refs)[-1]
            leanest = min((replace(c, recompute=lean_rc) for c in self.spmd),
                          key=lambda c: (memory_lower_bound_bytes(refs[lean_rc], cluster.num_devices,
                                                                  c.microbatch / self.ref_g,
                                                                  self.doubled.get(lean_rc)), c.mesh))
            solve_candidate(self.trace_at, leanest, cluster, config.global_batch, graphs=self.graphs,
                            time_limit_s=self.cache.time_limit_s, smallest=smallest)
        if config.fixed is not None and self.reasons:
            return InfeasiblePlanError(self.reasons[0], min_memory_bytes=min(smallest) if smallest else None)
        need = min(smallest) if smallest else None
        return InfeasiblePlanError(
            f"No plan fits {cluster.device_memory_bytes / GIB:.3g} GiB/device for {config.model} on {cluster.spec} "
            f"(global batch {config.global_batch})" + (f"; the smallest needs {need / GIB:.3g} GiB per device (one "
                                                       "stage, every mesh tried)"
                                                       if need is not None else "")
            + ". Add devices, raise --memory-gb, or use a smaller global batch", min_memory_bytes=need)

    def result(self, queue: list[tuple[float, int, Any]], pruned_memory: int) -> SearchResult:
        """The ranked plans, best first, each with its runners-up and why they lost."""
        config, cluster, entries, L = self.config, self.cluster, self.entries, self.L
        entries.sort(key=_Entry.sort_key)
        ranked_entries = [e for e in entries if e.reason is None]
        if not ranked_entries:
            raise self.no_plan_error()
        info = SearchInfo(cost_model="solver.intra_op ILP per stage + solver.stage_dp inter-op DP",
                          num_candidates=len(queue) + pruned_memory, num_priced=self.solved_count - self.pruned_lp,
                          num_pruned_memory=pruned_memory,
                          num_pruned_dominated=self.pruned + self.pruned_lp + self.pruned_dominated,
                          num_not_fitting=self.not_fit, complete=self.complete, alternatives=())
        ranked = tuple(_ranked(e, L) for e in ranked_entries)
        plans = []
        for i, e in enumerate(ranked_entries[:config.top]):
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
                plan = spmd_plan(e.spmd, ranked[i:], cluster, global_batch=config.global_batch, model=config.model,
                                 fingerprint=config.fingerprint, num_candidates=len(queue), not_fit=self.not_fit)
                stage, pipe = _one_stage_info(e, L, why)
                plan = replace(plan, search=this_info, stages=(stage,), pipeline=pipe)
            else:
                plan = pipeline_plan(e.pipeline, e.estimate, cluster, global_batch=config.global_batch,
                                     model=config.model, fingerprint=config.fingerprint, num_layers=L, info=this_info,
                                     runners_up=why)
            plans.append(plan)
        elapsed = time.perf_counter() - self.t0
        log.info("search: %d candidates (%d one-stage, %d pipelines), %d solved, %d pruned by bound before solving, "
                 "%d while solving; %d stage ILPs; best %s, step %.4g s; %.1f s", len(queue), len(self.spmd),
                 len(self.pipes), self.solved_count - self.pruned_lp, self.pruned, self.pruned_lp,
                 sum(1 for v in self.cache.costs.values() if v is not None), ranked_entries[0].label,
                 ranked_entries[0].step_time_s, elapsed)
        phases = (("trace", self.t_trace), ("solve", elapsed - self.t_trace))
        return SearchResult(ranked=ranked[:config.top], plan=plans[0], phases=phases, search_time_s=elapsed,
                            plans=tuple(plans), communication=_communication(ranked_entries[0]))


def _communication(entry: _Entry) -> tuple[CommunicationTime, ...]:
    """The entry's communication per step by collective kind (solver/comm_time.py)."""
    if entry.spmd is not None:
        return one_stage_communication(entry.spmd.solution, entry.spmd.candidate.num_microbatches)
    return pipeline_communication(entry.pipeline, dict(entry.estimate.time_breakdown)["p2p_s"])


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


def _ranked(e: _Entry, num_layers: int) -> Ranked:
    if e.spmd is not None:
        s = e.spmd
        config = replace(s.candidate.config, zero=dict(s.estimate.config)["zero"])
        return Ranked(config=config, stage_layers=(num_layers,), estimate=s.estimate, bubble_fraction=0.0,
                      repeated_axes=repeated_axes(s.solution),
                      zero_mixed=not zero_is_uniform(s.graph, s.solution, config))
    r = e.pipeline
    return Ranked(config=pipeline_config(r), stage_layers=r.solution.stage_layers, estimate=e.estimate,
                  bubble_fraction=r.solution.bubble_s / r.step_time_s if r.step_time_s else 0.0,
                  zero_mixed=len({(sc.zero, sc.ep) for sc, _ in r.stages}) > 1)


def _one_stage_info(e: _Entry, num_layers: int, why: tuple[tuple[str, float, str], ...]
                    ) -> tuple[StageInfo, PipelineInfo]:
    """A one-stage plan's stage record and its inter-op decision (no schedule: "none")."""
    s = e.spmd
    c = s.candidate
    stage = StageInfo(index=0, first_layer=0, num_layers=num_layers, has_embedding=True, has_head=True,
                      submesh=c.mesh, recompute=c.recompute, zero=dict(s.estimate.config)["zero"],
                      time_per_microbatch_s=s.solution.cost.total_s, memory_bytes=int(s.estimate.peak_memory_bytes),
                      inflight_microbatches=1.0, placements=(), collectives=())
    return stage, PipelineInfo(schedule="none", chunks=1, microbatch=c.microbatch,
                               num_microbatches=c.num_microbatches, bubble_s=0.0, p2p_s=0.0, runners_up=why)


__all__ = ["search"]
