"""Whole-plan search: mesh shape x stage cuts x ZeRO x microbatching x schedule x recompute.

Where it sits: benchmarks/baselines/template/, the template grid autopar searched before
the per-op compiler, kept as a baseline (benchmarks/plots_results.py draws one of its
plans); the product's planner is solver/pipeline_search.py (intra-op ILP stage costs +
inter-op DP). Input: the frozen Graph (a few traced layers scaled to the real depth), a
Cluster, the global batch and a pricing callable; output: ranked priced candidates and the
best `autopar.plan.Plan`, as the product's types (solver/results.py Ranked, SearchResult;
`TemplateSearchResult` adds the per-layer-group choices, which a product plan does not hold).
Benchmarks wire it to the analytic baseline (benchmarks/baselines/analytic/ `price`);
tests also drive it with tests/toy_price.py.

The space (each axis independent, all under the per-device memory limit):
- mesh (pp, dp, tp): tp divides the devices of a node (tensor parallelism needs NVLink;
  `SearchSpace.tp_within_node=False` lifts this) and the attention heads; pp <= layers;
  dp = devices / (tp * pp) divides the global batch.
- micro-batch b dividing global_batch / dp (optionally b <= max_micro_batch), m = B / (dp b).
- schedule: none for pp = 1; gpipe, 1f1b, interleaved with v chunks (v | L/pp, m % pp = 0).
- stage cuts (inter_op.py here): the even split and the exact min-max balanced cut.
- ZeRO 0-3 and recompute none/selective/full.
- intra-op: the config template (Megatron tp + dp, intra_op.py here) is what is priced;
  `intra_op_fn` (e.g. layer_groups.py here, the per-(layer group, submesh) ILP, memoised)
  adds its choices for the chosen plan beside them, in the result.

Pruning (both exact under stated assumptions; the brute-force test checks them):
1. memory bound: model state per device >= MEMORY_BOUND_SLACK * P_stage / tp * bytes per
   parameter of the ZeRO stage (16 | 4+12/d | 2+14/d | 16/d, ZeRO paper;
   `cost_model.state_bytes_per_param`); a candidate
   whose bound exceeds the budget cannot fit and is not priced.
2. dominance: recomputation only adds compute, so once a candidate fits with recompute r,
   the same candidate with more recomputation is not priced.

Ranking: fitting candidates by (step time, peak memory, config key): a total order, so
the result (and plan.json) is deterministic.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from autopar.cluster import Cluster
from autopar.config import RECOMPUTE, ParallelConfig
from autopar.ir import Graph
from autopar.explain import describe_config
from autopar.plan import (
    Alternative,
    InfeasiblePlanError,
    Plan,
    SearchInfo,
    StageInfo,
)
from autopar.units import GIB
from benchmarks.baselines.template.inter_op import StageWork, cut_candidates, stage_work
from benchmarks.baselines.template.intra_op import IntraOpChoice, layer_group_lines, template_intra_op
from cost_model import Estimate, state_bytes_per_param
from solver.results import ProgressFn, Ranked, SearchResult

log = logging.getLogger(__name__)

MEMORY_BOUND_SLACK = 0.9
"""The memory bound prices only parameter state, from the ZeRO paper's bytes per
parameter; the slack keeps it a true lower bound for cost models that count a little
less (e.g. replicated norms not sharded, rounding)."""
MAX_ALTERNATIVES = 8


PriceFn = Callable[[ParallelConfig, tuple[int, ...]], Estimate]
"""price(config, stage_layers) for the search's fixed graph, cluster and global batch: the
cost model's Estimate (tests/toy_price.py returns one too)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchSpace:
    """Which knobs the search may turn; the defaults are the full space."""

    tp_within_node: bool = True
    max_tp: int | None = None
    """Largest tensor-parallel degree; 1 for models whose structure the runtime cannot split."""
    max_pp: int | None = None
    """Largest pipeline degree; 1 for models without a repeated-layer container."""
    max_micro_batch: int | None = None
    """Largest micro-batch tried; None means any divisor of global_batch / dp."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")
    max_interleave: int = 8
    recompute: tuple[str, ...] = RECOMPUTE
    attention: str = "flash"
    non_uniform_cuts: bool = True
    prune_memory: bool = True
    prune_dominated: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    config: ParallelConfig
    stage_layers: tuple[int, ...]
    memory_bound_bytes: float


def rank_key(ranked: Ranked) -> tuple[Any, ...]:
    """(step time, peak memory, then the configuration): a total order, so the ranking and
    the plan file are deterministic."""
    c = ranked.config
    return (ranked.estimate.step_time_s, ranked.estimate.peak_memory_bytes, c.tp, c.pp, c.zero, c.micro_batch,
            c.schedule, c.interleave, RECOMPUTE.index(c.recompute), ranked.stage_layers)


def bubble_fraction(config: ParallelConfig, num_microbatches: int) -> float:
    """(p - 1) / (v m), SC'21; zero without pipelining."""
    if config.pp == 1:
        return 0.0
    return (config.pp - 1) / (config.interleave * num_microbatches)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def mesh_shapes(graph: Graph, cluster: Cluster, global_batch: int, space: SearchSpace) -> list[tuple[int, int, int]]:
    """(tp, pp, dp) triples allowed by the cluster, the heads, the depth and the batch."""
    info = graph.model
    n = cluster.num_devices
    tp_limit = cluster.devices_per_node if space.tp_within_node else n
    shapes = []
    for tp in _divisors(n):
        if tp_limit % tp or (info.heads and info.heads % tp) or (space.max_tp and tp > space.max_tp):
            continue
        kv = info.kv_heads
        if kv and kv % tp:  # the runtime splits key/value heads; it does not replicate them
            continue
        for pp in _divisors(n // tp):
            dp = n // (tp * pp)
            if (pp == 1 or pp <= info.num_layers) and global_batch % dp == 0 and not (
                    space.max_pp and pp > space.max_pp):
                shapes.append((tp, pp, dp))
    return shapes


def enumerate_candidates(graph: Graph, work: StageWork, cluster: Cluster, global_batch: int,
                         space: SearchSpace) -> list[Candidate]:
    """Every configuration of the space, recompute innermost (none first) for dominance."""
    out: list[Candidate] = []
    L = work.num_layers
    for tp, pp, dp in mesh_shapes(graph, cluster, global_batch, space):
        per_rank = global_batch // dp
        for b in _divisors(per_rank):
            if space.max_micro_batch is not None and b > space.max_micro_batch:
                break
            m = per_rank // b
            schedules: list[tuple[str, int]] = [("1f1b", 1)] if pp == 1 else []
            if pp > 1:
                schedules += [(s, 1) for s in ("gpipe", "1f1b") if s in space.schedules]
                if "interleaved" in space.schedules and m % pp == 0 and L % pp == 0:
                    schedules += [("interleaved", v) for v in _divisors(L // pp)
                                  if 1 < v <= space.max_interleave and L % (pp * v) == 0]
            for schedule, v in schedules:
                for zero in space.zero_stages:
                    if zero and dp == 1 and zero != space.zero_stages[0]:
                        continue  # ZeRO with dp = 1 shards nothing: identical to the first stage listed
                    cuts_by_rc = {rc: cut_candidates(work, pp, recompute=rc, interleave=v) for rc in space.recompute}
                    all_cuts = list(dict.fromkeys(c for rc in space.recompute for c in cuts_by_rc[rc]))
                    if not space.non_uniform_cuts:
                        all_cuts = all_cuts[:1]
                    for cuts in all_cuts:
                        state = max(work.stage_params(cuts, k) for k in range(pp)) / tp
                        bound = MEMORY_BOUND_SLACK * state * state_bytes_per_param(zero, dp)
                        for rc in space.recompute:
                            cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=b, schedule=schedule,
                                                 interleave=v, recompute=rc, attention=space.attention)  # type: ignore[arg-type]
                            out.append(Candidate(config=cfg, stage_layers=cuts, memory_bound_bytes=bound))
    return out


def run_search(graph: Graph, cluster: Cluster, *, global_batch: int, price: PriceFn,
               space: SearchSpace = SearchSpace(), time_limit_s: float | None = None,
               progress: ProgressFn | None = None) -> tuple[list[Ranked], SearchInfo, list[Candidate]]:
    """Enumerate, prune, price. Returns (fitting candidates best first, stats, the space)."""
    limit = cluster.device_memory_bytes
    work = stage_work(graph)
    candidates = enumerate_candidates(graph, work, cluster, global_batch, space)
    if progress:
        progress("price", 0, len(candidates))
    start = time.perf_counter()
    fitting: list[Ranked] = []
    num_priced = pruned_mem = pruned_dom = not_fit = 0
    fits_without_more_recompute: set[tuple[Any, ...]] = set()
    complete = True
    for i, cand in enumerate(candidates):
        if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
            complete = False
            break
        if progress and i % 256 == 0:
            progress("price", i, len(candidates))
        if space.prune_memory and cand.memory_bound_bytes > limit:
            pruned_mem += 1
            continue
        family = (replace(cand.config, recompute="none"), cand.stage_layers)
        if space.prune_dominated and family in fits_without_more_recompute:
            pruned_dom += 1
            continue
        est = price(cand.config, cand.stage_layers)
        num_priced += 1
        if not est.fits:
            not_fit += 1
            continue
        fits_without_more_recompute.add(family)
        m = cand.config.num_microbatches(global_batch)
        fitting.append(Ranked(config=cand.config, stage_layers=cand.stage_layers, estimate=est,
                              bubble_fraction=bubble_fraction(cand.config, m)))
    if progress:
        progress("price", len(candidates), len(candidates))
    fitting.sort(key=rank_key)
    info = SearchInfo(cost_model="", num_candidates=len(candidates), num_priced=num_priced,
                      num_pruned_memory=pruned_mem, num_pruned_dominated=pruned_dom, num_not_fitting=not_fit,
                      complete=complete, alternatives=())
    log.info("search: %d candidates, %d priced, %d pruned by memory, %d dominated, %d over memory, %d fit",
             len(candidates), num_priced, pruned_mem, pruned_dom, not_fit, len(fitting))
    return fitting, info, candidates


def smallest_memory(candidates: Sequence[Candidate], price: PriceFn) -> tuple[Candidate, int] | None:
    """The candidate with the least predicted peak memory, exactly, pricing few.

    A candidate's peak is at least its memory bound, so candidates are priced in order
    of bound and the scan stops once the next bound exceeds the smallest peak found.
    """
    best: tuple[Candidate, int] | None = None
    for cand in sorted(candidates, key=lambda c: (c.memory_bound_bytes, RECOMPUTE.index(c.config.recompute) * -1,
                                                  c.config.micro_batch)):
        if best is not None and cand.memory_bound_bytes >= best[1]:
            break
        peak = int(price(cand.config, cand.stage_layers).peak_memory_bytes)
        if best is None or peak < best[1]:
            best = (cand, peak)
    return best


def infeasible_error(graph: Graph, cluster: Cluster, global_batch: int, candidates: Sequence[Candidate],
                     price: PriceFn) -> InfeasiblePlanError:
    limit = cluster.device_memory_bytes
    what = (f"No plan fits {limit / GIB:.3g} GiB/device for {graph.model.name} on {cluster.spec} "
            f"(global batch {global_batch}, seq {graph.model.seq})")
    smallest = smallest_memory(candidates, price)
    if smallest is None:
        return InfeasiblePlanError(
            f"{what}: no parallel configuration divides the job (tp must divide the {graph.model.heads} heads and "
            f"a node's {cluster.devices_per_node} devices, dp the global batch). Try a global batch that is a "
            f"multiple of the device count, or another cluster size")
    cand, peak = smallest
    return InfeasiblePlanError(
        f"{what}; the smallest needs {peak / GIB:.3g} GiB per device "
        f"({describe_config(cand.config, cand.stage_layers, global_batch)}), even with ZeRO-3 and full "
        f"recomputation tried. That is {peak / limit:.1f}x the budget: add devices (about "
        f"{-(-cluster.num_devices * peak // limit)} if the need divided evenly), use larger-memory hardware or "
        f"raise --memory-gb, or shorten --seq",
        min_memory_bytes=peak)


def build_plan(graph: Graph, cluster: Cluster, *, global_batch: int, model: str, fingerprint: str,
               best: Ranked, runners_up: Sequence[Ranked], info: SearchInfo, cost_model_name: str) -> Plan:
    """Assemble the frozen Plan for one ranked candidate."""
    c, cuts = best.config, best.stage_layers
    work = stage_work(graph)
    stages = []
    first = 0
    for k, n in enumerate(cuts):
        params = work.stage_params(cuts, k)
        stages.append(StageInfo(
            index=k, first_layer=first, num_layers=n, has_embedding=k == 0, has_head=k == len(cuts) - 1,
            submesh=(c.dp, c.tp), recompute=c.recompute, zero=c.zero, flops_per_microbatch=work.stage_flops(cuts, k, c.recompute) * c.micro_batch, num_parameters=params,
            memory_bytes=int(params / c.tp * state_bytes_per_param(c.zero, c.dp))))
        first += n
    alternatives = tuple(
        Alternative(config=r.config, stage_layers=r.stage_layers, step_time_s=r.estimate.step_time_s,
                    peak_memory_bytes=int(r.estimate.peak_memory_bytes), fits=bool(r.estimate.fits))
        for r in runners_up)
    return Plan(
        model=model, model_fingerprint=fingerprint, num_layers=graph.model.num_layers, seq=graph.model.seq,
        global_batch=global_batch, cluster=cluster.spec, memory_limit_bytes=cluster.device_memory_bytes,
        config=c, stage_layers=cuts, mesh_shape=(c.pp, c.dp, c.tp), stages=tuple(stages),
        predicted=best.estimate, bubble_fraction=best.bubble_fraction,
        search=replace(info, cost_model=cost_model_name, alternatives=alternatives),
    )


def pick_runners_up(ranked: Sequence[Ranked]) -> list[Ranked]:
    """The next few plans plus the best of each other mesh shape, so explain can compare."""
    chosen: list[Ranked] = list(ranked[1:5])
    seen = {(r.config.tp, r.config.pp) for r in ranked[:5]}
    for r in ranked[5:]:
        key = (r.config.tp, r.config.pp)
        if key not in seen and len(chosen) < MAX_ALTERNATIVES:
            seen.add(key)
            chosen.append(r)
    return sorted(chosen, key=rank_key)


@dataclass(frozen=True, slots=True, kw_only=True)
class TemplateSearchResult(SearchResult):
    """The template search's result: the product's SearchResult and, for its best plan, the
    intra-op choice per layer group (the template's that was priced, and any `intra_op_fn`
    added beside it), which the product's Plan does not hold (it records the per-op
    placements that run)."""

    intra_op: tuple[IntraOpChoice, ...] = ()

    def explain(self) -> str:
        """The plan's `explain`, then its layer groups' choices."""
        return "\n".join([self.plan.explain(), *layer_group_lines(self.intra_op)])


def search(graph: Graph, cluster: Cluster, *, global_batch: int, price: PriceFn, model: str, fingerprint: str,
           cost_model_name: str, space: SearchSpace = SearchSpace(), top: int = 5,
           time_limit_s: float | None = None, progress: ProgressFn | None = None,
           intra_op_fn: Callable[[ParallelConfig], tuple[IntraOpChoice, ...]] | None = None
           ) -> TemplateSearchResult:
    """The whole search; raises InfeasiblePlanError when nothing fits the memory limit."""
    t0 = time.perf_counter()
    phases: list[tuple[str, float]] = []
    ranked, info, candidates = run_search(graph, cluster, global_batch=global_batch, price=price, space=space,
                                          time_limit_s=time_limit_s, progress=progress)
    phases.append(("price", time.perf_counter() - t0))
    if not ranked:
        raise infeasible_error(graph, cluster, global_batch, candidates, price)
    t1 = time.perf_counter()
    best = ranked[0]
    # the template is what the cost model priced; ILP choices (layer_groups.py here) are added beside it
    intra = template_intra_op(graph, best.config.tp) + (intra_op_fn(best.config) if intra_op_fn else ())
    plan = build_plan(graph, cluster, global_batch=global_batch, model=model, fingerprint=fingerprint, best=best,
                      runners_up=pick_runners_up(ranked), info=info, cost_model_name=cost_model_name)
    phases.append(("plan", time.perf_counter() - t1))
    return TemplateSearchResult(ranked=tuple(ranked[:top]), plan=plan, phases=tuple(phases),
                                search_time_s=time.perf_counter() - t0, intra_op=intra)
