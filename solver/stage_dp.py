"""Inter-op dynamic program: stage cuts x per-stage submesh options for one pipeline.

Where it sits: solver/, called by solver/pipeline_search.py once per outer choice
(pipeline degree p, microbatch count m, schedule, ZeRO); the per-stage costs come from
the intra-op ILP (solver/stage_costs.py), so this module is pure arithmetic over frozen
numbers and knows nothing of graphs or torch.

Terms: the model is pre (embedding) | L repeated layers | post (head + loss). A plan
cuts the layers into p contiguous stages, stage k holding n_k >= 1 layers (sum n_k = L;
stage 0 also runs pre, stage p-1 post), and gives each stage an *option* o_k: a submesh
shape (dp, tp) with its intra-op placements, a recompute policy and a ZeRO layout, each
priced per microbatch as

    t_k = [k = 0] pre_o + n_k layer_o + [k = p-1] post_o + c_k p2p_o + v h_o  (time)
    M_k = state_o(n_k, k) + f_k act_o(n_k, k) + temp_o                          (memory)

with c_k the stage's pipeline neighbours times the schedule's chunks per rank (each
boundary passes its values forward and their gradients back), state the parameters,
gradients and optimizer state the stage holds per device, act the activations one
microbatch keeps for the backward, f_k the microbatches the schedule keeps in
flight on stage k, and h_o the host time of one chunk call (the schedule and the
autograd Function around the per-rank graphs; 0 on GPUs), v chunks per rank. Once-per-step terms (gradient sync, optimizer) are folded into the
per-microbatch times divided by m, so that the critical stage's m t_k carries them once.

Step time (Alpa's objective, generalised by a schedule constant beta):

    T = beta * sum_k t_k + (m - beta) * max_k t_k

- gpipe, 1f1b: beta = 1 (T = sum + (m - 1) max: Alpa eq. 2; the bubble is sum - max).
  In flight: gpipe m; 1f1b min(m, p - k).
- interleaved with v chunks per rank: beta = 1/v (Narayanan et al. SC'21: the bubble
  shrinks by v); n_k must be a multiple of v; p2p traffic x v; in flight the 1F1B count
  x (1 + (p - 1) / (p v)) (Korthikanti et al. 2022, Sec. 4.2.3), at most m.
- zbv (torch.distributed.pipelining.ScheduleZBVZeroBubble, the V-shaped zero-bubble
  schedule of Qi et al., "Zero Bubble Pipeline Parallelism", 2024): beta = 0 (the
  authors' table: bubble rate 0 when forward, input-gradient and weight-gradient passes
  take equal time), 2 chunks per rank (n_k even), pipeline communication x 2, activation
  memory as 1F1B's; needs m >= 2p microbatches.

Ranks sharing cores (the cpu profile: more ranks than cores on a node, cost_model.core_share
= share > 1, every t_k priced contended): a rank waiting in a bubble frees its core for the
others, so the step is the longer of the schedule's critical path run uncontended and all
ranks' work over the cores (the same model as the baseline's price_profile,
benchmarks/baselines/analytic/step.py), plus the cores left idle while the pipeline fills and drains
(`ramp_idle_s`; the baseline leaves that out):

    T_shared = max(T / share, m * sum_k t_k / p + R)

(each stage's ranks are 1/p of the node's ranks). With share = 1 (GPUs) T_shared = T.

Solution (exact): T is nondecreasing in every t_k, so for a bound B on max_k t_k the best
option for (stage k, n layers) is the fastest one that fits stage k's memory:
tmin_k(n). Then

    S(B) = min over cuts of sum_k tmin_k(n_k)  subject to tmin_k(n_k) <= B

is a shortest path F_k(l) = min_n F_{k-1}(l - n) + tmin_k(n) (l layers in the first k
stages), and T* = min over B in {tmin_k(n)} of beta S(B) + (m - beta) B. B is scanned in
increasing order from the smallest feasible B (found by bisection: feasibility is
monotone in B) and the scan stops once beta S_free + (m - beta) B (S_free: S with no
bound, a lower bound of every later S(B)) reaches the best T found. Cost: O(#B p L^2)
numpy work, small for L <= 128; the per-option tables are numpy arrays over (k, n). tests/unit/test_stage_dp.py checks it against brute force
over every cut x option assignment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from autopar.config import microbatches_in_flight

SCHEDULES_PRICED: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zbv")
"""Pipeline schedules the DP prices (each ships in torch.distributed.pipelining)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StageOption:
    """One way to run a stage: per-microbatch times and per-device bytes of its pieces."""

    key: Hashable
    """What the option is (submesh, recompute, ZeRO): carried through to the result."""
    pre_s: float
    layer_s: float
    """One real layer's time per microbatch (forward + backward + amortised sync)."""
    post_s: float
    p2p_s: float
    """One boundary's messages per microbatch: every value crossing it sent forward, the
    gradients sent back (solver/pipeline_stages.py boundary_p2p_s)."""
    pre_state_bytes: float
    layer_state_bytes: float
    post_state_bytes: float
    pre_act_bytes: float
    layer_act_bytes: float
    """Activations one layer keeps for its backward, per microbatch in flight."""
    post_act_bytes: float
    temp_bytes: float = 0.0
    """Transient working memory of the stage (one layer's backward workspace)."""
    call_s: float = 0.0
    """Host time of one chunk call (a microbatch's forward and backward through the
    schedule) beyond the graph's ops and the boundary messages
    (cost_model.pipeline_call_time_s; 0 on GPUs), paid by every stage per chunk; not by a
    one-stage plan (no schedule: plain gradient accumulation)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    name: str
    chunks: int = 1
    """Model chunks per pipeline rank (interleave v; 2 for zbv)."""

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES_PRICED:
            raise ValueError(f"unknown schedule {self.name!r}; the DP prices {', '.join(SCHEDULES_PRICED)}")
        if self.name == "zbv" and self.chunks != 2:
            raise ValueError("zbv runs exactly 2 chunks per rank")
        if self.name in ("gpipe", "1f1b") and self.chunks != 1:
            raise ValueError(f"{self.name} runs one chunk per rank, got {self.chunks}")

    @property
    def beta(self) -> float:
        """Weight of sum_k t_k in T (module docstring)."""
        return {"gpipe": 1.0, "1f1b": 1.0, "interleaved": 1.0 / self.chunks, "zbv": 0.0}[self.name]

    def inflight(self, stage: int, num_stages: int, num_microbatches: int) -> float:
        # the cost model's count (zbv holds 1F1B's), from its one home in autopar/config.py
        return microbatches_in_flight(self.name, num_stages, self.chunks, stage, num_microbatches)

    def allows(self, num_stages: int, num_microbatches: int) -> bool:
        if num_stages == 1:
            return self.name == "1f1b"  # one stage: no pipeline, plain gradient accumulation
        if self.name == "zbv":
            return num_microbatches >= 2 * num_stages
        if self.name == "interleaved":
            return num_microbatches % num_stages == 0
        return True


def stage_time_s(o: StageOption, layers: int, stage: int, num_stages: int, schedule: Schedule) -> float:
    first, last = stage == 0, stage == num_stages - 1
    neighbours = (0 if first else 1) + (0 if last else 1)
    return (o.pre_s if first else 0.0) + layers * o.layer_s + (o.post_s if last else 0.0) \
        + neighbours * schedule.chunks * o.p2p_s + (schedule.chunks * o.call_s if num_stages > 1 else 0.0)


def stage_memory_parts(o: StageOption, layers: int, stage: int, num_stages: int, num_microbatches: int,
                       schedule: Schedule) -> tuple[float, float, float]:
    """One stage's per-device memory: (model state, activations of the microbatches in
    flight, temporaries)."""
    first, last = stage == 0, stage == num_stages - 1
    state = (o.pre_state_bytes if first else 0.0) + layers * o.layer_state_bytes + (o.post_state_bytes if last else 0.0)
    act = (o.pre_act_bytes if first else 0.0) + layers * o.layer_act_bytes + (o.post_act_bytes if last else 0.0)
    return state, schedule.inflight(stage, num_stages, num_microbatches) * act, o.temp_bytes


def stage_memory_bytes(o: StageOption, layers: int, stage: int, num_stages: int, num_microbatches: int,
                       schedule: Schedule) -> float:
    return sum(stage_memory_parts(o, layers, stage, num_stages, num_microbatches, schedule))


def ramp_idle_s(total: float, num_stages: int, schedule: Schedule, share: float) -> float:
    """Ranks sharing cores (share > 1): the time the cores left idle while the pipeline
    fills and drains add to the shared work, per core (module docstring):

        R = sum_{j=1}^{p-1} max(0, 1 - j share / p) * S / (p share v)

    While j of p stages run (the first forwards, the last backwards), j r of the node's
    p r ranks are runnable on its p r / share cores: 1 - j share / p of them idle. Each
    such slot lasts one stage's forward (filling) or backward (draining) of one
    microbatch chunk at full speed; a fill slot and its drain slot together are about one
    stage's time per microbatch uncontended, (S / p) / share, over the v chunks a rank
    runs. 0 when a stage's ranks alone fill the cores (p <= share: e.g. 2 stages of 2
    ranks on 2 cores) and on GPUs (share 1). Measured need (benchmarks/sweep_cpu.py, the
    L model on 4 ranks over 2 cores, six runs): GPipe dp2 pp2 ran 1.5-5.8% faster than
    pp4, whose 4 one-rank stages leave one core idle for the first forward and the last
    backward; priced as equal work before, within 1-2% either way round. Here pp4 pays
    S / 16 on top of its m S / p = S of work: 6.25%."""
    p = num_stages
    if share <= 1.0 or p < 2:
        return 0.0
    idle = sum(max(0.0, 1.0 - j * share / p) for j in range(1, p))
    return idle * total / (p * share * schedule.chunks)


def step_time_s(times: Sequence[float], num_microbatches: int, schedule: Schedule, share: float = 1.0) -> float:
    """T (module docstring); with ranks sharing cores (share > 1), max(T / share,
    m sum / p + ramp_idle_s)."""
    beta = schedule.beta
    standard = beta * sum(times) + (num_microbatches - beta) * max(times)
    if share <= 1.0:
        return standard
    total = sum(times)
    return max(standard / share, num_microbatches * total / len(times) + ramp_idle_s(total, len(times), schedule, share))


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineSolution:
    step_time_s: float
    stage_layers: tuple[int, ...]
    options: tuple[int, ...]
    """Index into the options list, per stage."""
    stage_times_s: tuple[float, ...]
    stage_memory_bytes: tuple[float, ...]
    num_microbatches: int

    @property
    def bubble_s(self) -> float:
        """What the schedule adds over m x the slowest stage: beta (sum - max); 0 where ranks
        share cores and the step is their shared work (module docstring)."""
        return max(0.0, self.step_time_s - self.num_microbatches * max(self.stage_times_s))


def option_tables(num_layers: int, num_stages: int, num_microbatches: int, option: StageOption,
                  schedule: Schedule, memory_budget_bytes: float) -> np.ndarray:
    """t[k, n]: stage k's time with n layers under `option` (inf where it does not fit the
    memory budget or n is not a multiple of the schedule's chunks); the same formulas as
    stage_time_s / stage_memory_bytes, over all (k, n) at once."""
    p, L, o = num_stages, num_layers, option
    k = np.arange(p)[:, None]
    n = np.arange(L + 1)[None, :].astype(float)
    first, last = (k == 0), (k == p - 1)
    neighbours = (~first).astype(float) + (~last).astype(float)
    t = np.where(first, o.pre_s, 0.0) + n * o.layer_s + np.where(last, o.post_s, 0.0) \
        + neighbours * schedule.chunks * o.p2p_s + (schedule.chunks * o.call_s if p > 1 else 0.0)
    inflight = np.array([schedule.inflight(i, p, num_microbatches) for i in range(p)])[:, None]
    state = np.where(first, o.pre_state_bytes, 0.0) + n * o.layer_state_bytes + np.where(last, o.post_state_bytes, 0.0)
    act = np.where(first, o.pre_act_bytes, 0.0) + n * o.layer_act_bytes + np.where(last, o.post_act_bytes, 0.0)
    bad = state + inflight * act + o.temp_bytes > memory_budget_bytes
    bad = bad | (np.arange(L + 1)[None, :] % schedule.chunks != 0)
    if L:
        bad[:, 0] = True
    return np.where(bad, np.inf, t)


def _tmin_tables(tables: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """tmin[k, n] over the options' tables and its argmin option (the first on ties)."""
    stacked = np.stack(tables)
    arg = np.argmin(stacked, axis=0)
    tmin = np.take_along_axis(stacked, arg[None], axis=0)[0]
    return tmin, np.where(np.isfinite(tmin), arg, -1)


def _gathered(tmin: np.ndarray) -> np.ndarray:
    """G[k, l, j] = tmin[k, l - j] (stage k taking layers j..l-1), inf where l < j."""
    L1 = tmin.shape[1]
    rows = np.arange(L1)
    take = rows[:, None] - rows[None, :]
    valid = take >= 0
    return np.where(valid[None], tmin[:, np.where(valid, take, 0)], np.inf)


def _shortest(gathered: np.ndarray, bound: float, num_layers: int) -> tuple[float, list[int]] | None:
    """min sum_k tmin[k, n_k] over cuts with every tmin[k, n_k] <= bound (and the cut);
    `gathered` is _gathered(tmin)."""
    p, L = gathered.shape[0], num_layers
    F = np.full(L + 1, np.inf)
    F[0] = 0.0
    back = np.zeros((p, L + 1), dtype=np.int64)
    rows = np.arange(L + 1)
    for k in range(p):
        g = gathered[k]
        cand = F[None, :] + np.where(g <= bound, g, np.inf)
        j = np.argmin(cand, axis=1)
        F = cand[rows, j]
        back[k] = rows - j
    if not math.isfinite(F[L]):
        return None
    cuts, l = [], L
    for k in range(p - 1, -1, -1):
        n = int(back[k, l])
        cuts.append(n)
        l -= n
    cuts.reverse()
    return float(F[L]), cuts


def _least_feasible_bound(gathered: np.ndarray, bounds: np.ndarray, num_layers: int) -> int:
    """The index of the smallest bound in `bounds` (sorted) under which the cuts have a path
    (`_shortest`): feasibility is monotone in the bound, so found by bisection."""
    lo, hi = 0, len(bounds) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _shortest(gathered, float(bounds[mid]), num_layers) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


def solve_pipeline(num_layers: int, num_stages: int, num_microbatches: int, options: Sequence[StageOption],
                   schedule: Schedule, memory_budget_bytes: float,
                   tables: Sequence[np.ndarray] | None = None, cutoff_s: float = math.inf,
                   share: float = 1.0, stage_layers: Sequence[int] | None = None) -> PipelineSolution | None:
    """The exact optimum of T over cuts x per-stage options (module docstring), or None
    when no assignment fits the memory budget. L = 0 (no repeated layers) needs p = 1.
    `tables` are the options' `option_tables` when the caller reuses them across subsets.

    `cutoff_s`: only an optimum with T < cutoff_s is returned (None otherwise), so the
    search stops as soon as a bound reaches it. Bounds, from T >= (beta + (m - beta) / p) S
    (the slowest stage is at least the mean) with S = sum_k t_k: S >= L min_(k,n) tmin_k(n) / n
    (before any path is computed), then S >= S_free.

    `share` > 1: ranks share cores (cost_model.core_share; the times are priced contended),
    T = max(T_sched / share, m S / p + R(S)) (module docstring; R linear in S), still nondecreasing in S for a
    fixed bound B, so the scan stays exact.

    `stage_layers`: the cuts are given (a saved plan priced as it is): only the options per
    stage are chosen."""
    p, m, L = num_stages, num_microbatches, num_layers
    if p < 1 or (L < p and not (L == 0 and p == 1)) or not options or not schedule.allows(p, m):
        return None
    if tables is None:
        tables = [option_tables(L, p, m, o, schedule, memory_budget_bytes) for o in options]
    if stage_layers is not None:
        if len(stage_layers) != p or sum(stage_layers) != L:
            return None
        keep = np.zeros((p, L + 1), dtype=bool)
        keep[np.arange(p), list(stage_layers)] = True
        tables = [np.where(keep, t, np.inf) for t in tables]
    tmin, arg = _tmin_tables(tables)
    beta = schedule.beta
    shared = share > 1.0
    div = share if shared else 1.0
    scale = max((beta + (m - beta) / p) / div, m / p if shared else 0.0)

    def objective(total: float, bound: float) -> float:
        t = (beta * total + (m - beta) * bound) / div
        return max(t, m * total / p + ramp_idle_s(total, p, schedule, share)) if shared else t

    if L and math.isfinite(cutoff_s):
        per_layer = (tmin[:, 1:] / np.arange(1, L + 1)[None, :]).min()
        if not math.isfinite(per_layer) or scale * L * per_layer >= cutoff_s:
            return None
    gathered = _gathered(tmin)
    free = _shortest(gathered, math.inf, L)
    if free is None:
        return None
    s_free = free[0]
    if scale * s_free >= cutoff_s:
        return None
    bounds = np.unique(tmin[np.isfinite(tmin)])
    # from the smallest feasible bound, scan upwards while a larger bound can still pay for itself
    lo = _least_feasible_bound(gathered, bounds, L)
    best: list[int] | None = None
    best_t = cutoff_s
    for bound in bounds[lo:]:
        if objective(s_free, float(bound)) >= best_t:
            break
        found = _shortest(gathered, float(bound), L)
        assert found is not None  # every bound above a feasible one is feasible
        total, cuts = found
        t = objective(total, float(bound))
        if t < best_t:
            best_t, best = t, cuts
    if best is None:  # with no cutoff, the largest bound admits the unbounded optimum
        assert math.isfinite(cutoff_s)
        return None
    cuts = best
    chosen = tuple(int(arg[k, n]) for k, n in enumerate(cuts))
    times = tuple(stage_time_s(options[i], n, k, p, schedule) for k, (n, i) in enumerate(zip(cuts, chosen)))
    mems = tuple(stage_memory_bytes(options[i], n, k, p, m, schedule) for k, (n, i) in enumerate(zip(cuts, chosen)))
    return PipelineSolution(step_time_s=step_time_s(times, m, schedule, share), stage_layers=tuple(cuts), options=chosen,
                            stage_times_s=times, stage_memory_bytes=mems, num_microbatches=m)
