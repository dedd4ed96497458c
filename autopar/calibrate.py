"""Measure this machine and write a `cpu` Hardware profile the cost model can price against.

Where it sits: beside autopar/cluster.py (which defines `Hardware` and loads profiles with
`load_hardware`). `calibrate(devices)` spawns `devices` local gloo ranks (one thread each,
exactly as `autopar train --devices N` runs them) and measures, on every rank at once:

- GEMMs: fp32 matmuls of several shapes (square and thin); peak rate, K-ramp and per-call
  overhead are fitted (least squares) to t = 2 m n k / peak * (k + k0) / k + overhead;
- memory-bound ops: copies of several sizes, t = bytes / bandwidth + overhead (bytes = read +
  write);
- the step's two memory-bound passes over whole parameter sets, each timed as the runtime
  runs it, per element: the optimizer step (fused fp32 AdamW, the default optimizer,
  autopar/runtime/spmd.py) and the in-place accumulation of a microbatch's gradients
  (`a.add_(b)`, autopar.runtime.spmd.accumulate). The profile stores them as the traffic
  they are worth at the copy bandwidth (`optimizer_bytes_per_param`,
  `accumulate_bytes_per_byte`): measured on the development machine (1- and 3-run calibrations), an AdamW step
  took the time of 14-16 bytes of copy traffic per parameter, not the 36 of the default
  (mixed precision on a GPU) nor the 28 fp32 AdamW reads and writes, and an in-place add 1.4
  bytes per byte, not 3 (torch's `copy_` is the slower kernel here), so the default traffic
  priced both 2-3x too slow;
- the step's epilogue per parameter tensor: every step, every local parameter gets its
  gradient as a DTensor (autopar.runtime.program.gradient_for), and the optimizer steps and
  clears them, all on DTensor parameters: a fixed host cost per tensor (DTensor's dispatch
  of the fused AdamW kernel over lists of DTensors, the wrapping) that a per-element pass
  cannot show. Timed on PARAM_TENSORS[0] and [1] tiny parameters of a (1, N, 1) mesh; the
  slope per tensor is `optimizer_tensor_overhead_s` (on the development machine the sweep's
  small model, 39 parameter tensors, spent 1.7 ms of CPU per rank in the optimizer step
  against 0.6 ms its elements were worth);
- eager per-op cost: a chain of small elementwise ops under autograd, forward and backward,
  per ATen op (what every op of a training step pays on the host: dispatch, autograd
  recording, the backward engine); a chain of views; both chains again as the per-rank
  program runs its ops (`program_op_s`, `program_view_s`: a make_fx GraphModule calling ATen
  op overloads under no_grad; the profile's per-op and per-view costs, which the ILP charges
  too, cost_model/table.py `view_host_s`); a small tensor-parallel block on
  DTensors vs on local tensors (the sharding propagation and wrapping a DTensor op adds,
  per ATen op of the block, counted with a dispatch mode);
- fused attention: `scaled_dot_product_attention` forward+backward at a small shape, its
  rate relative to the GEMM peak;
- gloo collectives: all-reduce, all-gather and reduce-scatter at several sizes, on all N
  ranks and inside 2-rank groups, and send/recv pairs; per kind, the latency per ring step
  and the bus bandwidth are fitted to t = L0 + steps(n) alpha + vol(n) S / B_kind
  (steps: 2(n-1) all-reduce and reduce-scatter, n-1 all-gather; vol: 2(n-1)/n, (n-1)/n:
  gloo runs a reduce-scatter as an all-reduce of the whole input,
  `cost_model.collectives.GLOO_REDUCE_SCATTER`);
- rank skew: a small all-reduce between chunks of GEMM work costs more than back to back
  (every rank waits for the one the OS scheduled last). Measured and reported, not priced:
  see `Calibration.sync_skew_s`.

Load: this machine is shared, and its speed drifts with other users' load. Each run times
`reference_workload` at its start (`reference_s`, `reference_time`); several runs are set
to one speed by it and combined by medians (`combine`), and a later run can set its own
reference time against it (the load factor). Short reference timings between measurements
record the drift within a run (logged), without scaling the figures (see `timed`). The
probes, the timing windows and the reference workload are autopar/calibrate_rank.py's.

Core sharing: with more ranks than cores, the OS time-slices them, and every rate above is
what one rank gets while all ranks work. The profile stores them per dedicated core (times
divided, rates multiplied by s = max(1, N / cores); the collectives' latencies divided by
s ** g, g the built-in profile's `collective_latency_share_exponent`), with `cores_per_node`;
the cost model applies the sharing factor of the job's own N by the same laws
(cost_model/table.py core_share, collectives.py), so one profile serves `cpu:4` and `cpu:8`. The
fastest of a few timing windows, median over ranks (the machine is shared; the load
of other users drifts: `reference_workload` records how fast the machine was).

From measured rates to a profile: the profile's peaks ARE the measured rates, and its
`efficiency` overrides set the cost model's GPU efficiencies to 1 and its per-op overheads
to the measured ones (cost_model/efficiency.py).
"""

from __future__ import annotations

import itertools
import logging
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from autopar.calibrate_rank import KINDS, rank_measure
from autopar.cluster import HARDWARE, Hardware
from autopar.runtime.launch import spawn

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    devices: int
    cores: int
    gemm_s: tuple[tuple[int, int, int, float], ...]
    """(m, n, k, seconds per matmul), median over ranks, all ranks busy."""
    copy_s: tuple[tuple[int, float], ...]
    """(bytes copied, seconds)."""
    eager_op_s: float
    """Per ATen op of a small elementwise chain under autograd, forward and backward."""
    view_op_s: float
    dtensor_op_s: float
    """Extra time per ATen op of a small tensor-parallel block (column-parallel linear,
    elementwise, views, reduction; forward and backward) run on DTensors instead of local tensors."""
    attention_flops_per_s: float
    """SDPA forward+backward FLOP rate (full-square count: 4 b h s^2 d forward, x3 total)."""
    collective_s: tuple[tuple[str, int, int, float], ...]
    """(kind, ranks in the group, bytes, seconds): kind in KINDS; bytes = the full tensor."""
    send_recv_s: tuple[tuple[int, float], ...]
    optimizer_s: float = 0.0
    """Seconds per parameter element of one optimizer step (fused fp32 AdamW over
    OPTIMIZER_SHAPES), all ranks busy; 0 = not measured (a profile written before it)."""
    accumulate_s: float = 0.0
    """Seconds per gradient byte of an in-place fp32 add (`a.add_(b)`, ACCUMULATE_ELEMENTS),
    all ranks busy; 0 = not measured."""
    param_tensor_s: float = 0.0
    """Seconds per local parameter tensor of the step's epilogue (gradient set as a DTensor,
    optimizer step, zero_grad on DTensor parameters; the slope between PARAM_TENSORS), all
    ranks busy; 0 = not measured."""
    sync_skew_s: float = 0.0
    """Extra time of a small all-reduce issued between chunks of work over the same all-reduce
    issued back to back: the wait for the last rank to arrive (rank skew under core sharing).
    Not priced (`fit` leaves it out of the collective latency): it measured 0 while timing
    windows ended on each rank's own clock; with windows closed on all ranks together it
    measured 0.25 and 1.4 ms in two consecutive 3-run calibrations, and priced into every
    collective the larger value moved the CPU sweep's pooled Spearman for the large model
    from 0.92 to 0.76 (`--repredict`). A wait it stands for was measured inside pairs of
    ranks (1.8 ms: tensor-parallel collectives while the other pair works), but adding it
    to subgroup collectives and send/recv priced pipelines and dp x tp too slow next to
    one-stage data parallelism (predicted / measured 2.1 for S x 8 dp2 pp4 and 1.3 for
    L x 8 tp2 pp4 against 0.45-0.6 for dp8): the stage DP's schedule already holds the
    waits between stages. The wait of collectives inside a stage (not send/recv) is now
    priced, fitted on the recorded sweeps rather than measured here
    (`stage_collective_wait_s`, benchmarks/fit/fit_cpu_constants.py)."""
    program_op_s: float = 0.0
    """Per node of a small elementwise chain run as the per-rank program runs its ops: a
    make_fx GraphModule of ATen op overloads under no_grad; all ranks busy; 0 = not measured
    (a profile from an older calibrate: `eager_op_s` stands in)."""
    scalar_all_reduce_s: tuple[tuple[int, float], ...] = ()
    """(ranks in the group, seconds): an all-reduce of one float32 element (the reported
    loss, a loss's total weight), on all N ranks and inside 2-rank groups like the other
    collectives. gloo skips the empty segments of its ring (gloo/allreduce.cc: at least 2 n
    segments of at least one element), so one element is far cheaper than the 4 KiB the
    ring's latency is fitted on (8 ranks on 2 cores: 2.2 against 18.8 ms); priced by
    `Efficiency.scalar_all_reduce_hop_s`. Empty = not measured (a profile from an older
    calibrate: every all-reduce priced by the ring's latency)."""
    total_memory_bytes: int = 0
    """The machine's physical memory when measured (`machine_memory_bytes`); the profile
    gives each of `devices` ranks an equal share. A measurement like the others: the
    profile derived from kept measurements is the same on every machine that derives it
    (the built-in profile is a fixed file). 0 = not recorded (a calibration written before
    it): `to_hardware` then reads the memory of the machine it runs on."""
    program_view_s: float = 0.0
    """Per node of a chain of views (`aten.t`) run the same way; 0 = not measured
    (`view_op_s`, the Tensor method without the op-overload call, stands in: measured
    side by side here, 0.62 against 1.3 us per dedicated core)."""
    reference_s: float = 0.0
    """One call of `reference_workload` on all ranks at once: what a later run on this
    machine compares its own reference time with (`load_factor`), so that predictions made
    with this profile can be set against measurements taken under a different load of the
    shared machine."""

    @property
    def sharing(self) -> float:
        """Ranks per core while measuring (>= 1)."""
        return max(1.0, self.devices / max(1, self.cores))

    def to_json(self) -> dict[str, Any]:
        return {
            "devices": self.devices, "cores": self.cores, "gemm_s": [list(x) for x in self.gemm_s],
            "copy_s": [list(x) for x in self.copy_s], "eager_op_s": self.eager_op_s, "view_op_s": self.view_op_s,
            "dtensor_op_s": self.dtensor_op_s, "attention_flops_per_s": self.attention_flops_per_s,
            "collective_s": [list(x) for x in self.collective_s], "send_recv_s": [list(x) for x in self.send_recv_s],
            "reference_s": self.reference_s, "sync_skew_s": self.sync_skew_s,
            "optimizer_s": self.optimizer_s, "accumulate_s": self.accumulate_s,
            "param_tensor_s": self.param_tensor_s, "program_op_s": self.program_op_s,
            "program_view_s": self.program_view_s,
            "scalar_all_reduce_s": [list(x) for x in self.scalar_all_reduce_s],
            "total_memory_bytes": self.total_memory_bytes,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Calibration":
        return cls(devices=int(data["devices"]), cores=int(data["cores"]),
                   gemm_s=tuple(tuple(x) for x in data["gemm_s"]), copy_s=tuple(tuple(x) for x in data["copy_s"]),
                   eager_op_s=float(data["eager_op_s"]), view_op_s=float(data["view_op_s"]),
                   dtensor_op_s=float(data["dtensor_op_s"]),
                   attention_flops_per_s=float(data["attention_flops_per_s"]),
                   collective_s=tuple(tuple(x) for x in data["collective_s"]),
                   send_recv_s=tuple(tuple(x) for x in data["send_recv_s"]),
                   reference_s=float(data.get("reference_s", 0.0)), sync_skew_s=float(data.get("sync_skew_s", 0.0)),
                   optimizer_s=float(data.get("optimizer_s", 0.0)), accumulate_s=float(data.get("accumulate_s", 0.0)),
                   param_tensor_s=float(data.get("param_tensor_s", 0.0)),
                   program_op_s=float(data.get("program_op_s", 0.0)),
                   program_view_s=float(data.get("program_view_s", 0.0)),
                   scalar_all_reduce_s=tuple((int(n), float(t)) for n, t in data.get("scalar_all_reduce_s", ())),
                   total_memory_bytes=int(data.get("total_memory_bytes", 0)))


def machine_memory_bytes() -> int:
    """Physical memory of the machine this runs on (POSIX `sysconf`): what `calibrate`
    records. Read only while measuring, or for a calibration that did not record it."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")



def _median_rows(results: list[dict[str, Any]], key: str, width: int) -> tuple[tuple[Any, ...], ...]:
    """Rows (key fields..., seconds) with seconds = median over the ranks that measured them."""
    table: dict[tuple[Any, ...], list[float]] = {}
    for r in results:
        for row in r[key]:
            table.setdefault(tuple(row[:width]), []).append(row[width])
    return tuple((*k, statistics.median(v)) for k, v in sorted(table.items()))


def calibrate(devices: int, repeats: int = 1) -> Calibration:
    """Measure with `devices` concurrent local gloo ranks (spawned here); with `repeats` > 1,
    the whole measurement is run that many times and combined (`combine`)."""
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    if repeats > 1:
        return combine([calibrate(devices) for _ in range(repeats)])

    if devices < 2:
        raise ValueError(f"--devices must be at least 2 to measure collectives, got {devices}")
    start = time.perf_counter()
    results = spawn(rank_measure, devices, (), collective_timeout_s=300.0)
    log.info("calibrate: %d ranks measured in %.1f s; the machine's speed drifted by up to x%.2f meanwhile "
             "(corrected)", devices, time.perf_counter() - start, max(r["reference_drift"] for r in results))
    return Calibration(
        devices=devices, cores=len(os.sched_getaffinity(0)),
        gemm_s=_median_rows(results, "gemm", 3), copy_s=_median_rows(results, "copy", 1),
        eager_op_s=statistics.median(r["eager_op"] for r in results),
        view_op_s=statistics.median(r["view_op"] for r in results),
        dtensor_op_s=statistics.median(max(0.0, r["dtensor_block"] - r["plain_block"]) / r["plain_ops"]
                                       for r in results),
        attention_flops_per_s=statistics.median(r["attention_flops_per_s"] for r in results),
        collective_s=_median_rows(results, "coll", 3), send_recv_s=_median_rows(results, "p2p", 1),
        reference_s=statistics.median(r["reference"] for r in results),
        sync_skew_s=statistics.median(r["sync_skew"] for r in results),
        optimizer_s=statistics.median(r["optimizer"] for r in results),
        accumulate_s=statistics.median(r["accumulate"] for r in results),
        param_tensor_s=statistics.median(r.get("param_tensor", 0.0) for r in results),
        program_op_s=statistics.median(r["program_op"] for r in results),
        program_view_s=statistics.median(r["program_view"] for r in results),
        scalar_all_reduce_s=_median_rows(results, "scalar", 1),
        total_memory_bytes=machine_memory_bytes(),
    )


def combine(cals: list[Calibration]) -> Calibration:
    """Several calibrations of this machine as one: each run's times are first set to the
    median run's speed (x the median reference time / that run's reference time: every
    run's figures describe the machine as it was at the run's own start), then every
    figure is the median over the runs. On a machine shared with other users a single run
    can catch a burst of load in one measurement only (one GEMM shape, one collective size)
    and skew the fits; the median of three runs does not follow one such outlier. The
    reference time is the median run's, not the fastest: a later run's single reference
    time (`reference_time`, one run) is set against it, and the fastest of three runs'
    would be a faster estimator than that one (see REFERENCE_WINDOWS)."""
    if not cals:
        raise ValueError("combine needs at least one calibration")
    if len({(c.devices, c.cores) for c in cals}) != 1:
        raise ValueError("combine: calibrations of different device or core counts")
    ref = statistics.median(c.reference_s for c in cals)
    scale = [ref / c.reference_s if c.reference_s > 0 else 1.0 for c in cals]

    def rows(name: str, width: int) -> tuple[tuple[Any, ...], ...]:
        table: dict[tuple[Any, ...], list[float]] = {}
        for c, f in zip(cals, scale):
            for row in getattr(c, name):
                table.setdefault(tuple(row[:width]), []).append(row[width] * f)
        return tuple((*k, statistics.median(v)) for k, v in sorted(table.items()))

    def med(name: str, rate: bool = False) -> float:
        return statistics.median(getattr(c, name) / f if rate else getattr(c, name) * f for c, f in zip(cals, scale))

    return Calibration(devices=cals[0].devices, cores=cals[0].cores, gemm_s=rows("gemm_s", 3),
                       copy_s=rows("copy_s", 1), eager_op_s=med("eager_op_s"), view_op_s=med("view_op_s"),
                       dtensor_op_s=med("dtensor_op_s"), attention_flops_per_s=med("attention_flops_per_s", rate=True),
                       collective_s=rows("collective_s", 3), send_recv_s=rows("send_recv_s", 1),
                       sync_skew_s=med("sync_skew_s"), reference_s=ref, optimizer_s=med("optimizer_s"),
                       accumulate_s=med("accumulate_s"), param_tensor_s=med("param_tensor_s"),
                       program_op_s=med("program_op_s"), program_view_s=med("program_view_s"),
                       scalar_all_reduce_s=rows("scalar_all_reduce_s", 1),
                       # what every run had (a machine's reported size can move by a few KiB)
                       total_memory_bytes=min((c.total_memory_bytes for c in cals if c.total_memory_bytes), default=0))


def _solve_normal(rows: list[list[float]], ys: list[float], free: tuple[int, ...]) -> list[float] | None:
    """Least squares over the columns in `free` (the others held at 0), by the normal
    equations and Gauss-Jordan with partial pivoting; None when they are singular."""
    k = len(free)
    ata = [[sum(r[i] * r[j] for r in rows) for j in free] for i in free]
    aty = [sum(r[i] * y for r, y in zip(rows, ys)) for i in free]
    for i in range(k):
        p = max(range(i, k), key=lambda r: abs(ata[r][i]))
        ata[i], ata[p], aty[i], aty[p] = ata[p], ata[i], aty[p], aty[i]
        if abs(ata[i][i]) < 1e-300:
            return None
        for r in range(k):
            if r != i:
                f = ata[r][i] / ata[i][i]
                ata[r] = [a - f * b for a, b in zip(ata[r], ata[i])]
                aty[r] -= f * aty[i]
    out = [0.0] * len(rows[0])
    for i, col in enumerate(free):
        out[col] = aty[i] / ata[i][i]
    return out


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Non-negative least squares for a few unknowns (every fit here has at most 6): the
    best of the unconstrained solutions over every subset of the unknowns left free (the
    others 0) whose coefficients are all >= 0, which is the exact constrained optimum.

    Why not solve once and clip the negative coefficients to 0: that leaves the others
    where the negative one pulled them. gloo's per-call latency fits at -0.5 to -1.5 ms
    (2-rank groups are far faster per ring step than 4-rank ones); clipped to 0, it left the
    per-step latency 20-55% above the best fit with no per-call term (355-530 instead of
    297-372 us per dedicated core in three calibrations), and 8 ranks, 14 ring steps of an
    all-reduce at 4 ranks per core, multiply that."""
    k = len(rows[0])
    best: tuple[float, list[float]] | None = None
    for size in range(k, 0, -1):
        for free in itertools.combinations(range(k), size):
            x = _solve_normal(rows, ys, free)
            if x is None or any(v < 0 for v in x):
                continue
            residual = sum((sum(a * b for a, b in zip(r, x)) - y) ** 2 for r, y in zip(rows, ys))
            if best is None or residual < best[0]:
                best = (residual, x)
    return best[1] if best is not None else [0.0] * k


@dataclass(frozen=True, slots=True, kw_only=True)
class Fitted:
    """What the profile stores, per dedicated core (see the module docstring)."""
    gemm_flops_per_s: float
    gemm_k_ramp: float
    gemm_overhead_s: float
    copy_bytes_per_s: float
    copy_overhead_s: float
    eager_op_s: float
    """Host time per op: `Calibration.program_op_s` where measured, else `eager_op_s`."""
    view_op_s: float
    """Host time per view op: `Calibration.program_view_s` where measured, else `view_op_s`."""
    dtensor_op_overhead_s: float
    attention_efficiency: float
    base_latency_s: float
    """Per collective: gloo's launch cost (fitted)."""
    hop_latency_s: float
    bus_bytes_per_s: dict[str, float]
    p2p_bytes_per_s: float
    optimizer_s: float = 0.0
    """Seconds per parameter element of the optimizer step (0: not measured)."""
    accumulate_s: float = 0.0
    """Seconds per gradient byte of the in-place accumulation (0: not measured)."""
    param_tensor_s: float = 0.0
    """Seconds per local parameter tensor of the step's epilogue (0: not measured)."""
    scalar_hop_latency_s: float = 0.0
    """Per ring step of a one-element all-reduce (0: not measured)."""


def latency_share_exponent(hardware: Hardware | None = None) -> float:
    """The exponent of the share law of collective latencies (cost_model/efficiency.py
    `collective_latency_share_exponent`) that `hardware` (default: the built-in `cpu`
    profile, where benchmarks/fit/fit_cpu_constants.py stores it) carries; 1 where it carries none."""
    hw = HARDWARE["cpu"] if hardware is None else hardware
    return float(dict(hw.efficiency).get("collective_latency_share_exponent", 1.0))


def fit(cal: Calibration, *, latency_exponent: float | None = None) -> Fitted:
    """Fit the model's terms to the measurements and normalise them to one dedicated core:
    rates x s, times / s, the collectives' latencies / s ** `latency_exponent` (default
    the built-in profile's `collective_latency_share_exponent`: the cost model scales them
    back up by the same law, so the rank count measured is priced as measured)."""
    s = cal.sharing
    s_lat = s ** (latency_share_exponent() if latency_exponent is None else latency_exponent)
    # GEMM: t = (2 m n k / P) * (1 + k0 / k) + o  ->  unknowns 1/P, k0/P, o (linear), fitted in
    # relative terms (each row divided by its time): the shapes span 4 decades of time, and
    # an absolute fit lets a few percent of noise on the largest shapes set the intercept o
    # to hundreds of microseconds, more than the smallest GEMMs take in all
    rows = [[2 * m * n * k / t, 2 * m * n / t, 1.0 / t] for m, n, k, t in cal.gemm_s]
    inv_peak, k0_over_peak, gemm_overhead = _least_squares(rows, [1.0] * len(rows))
    peak = 1 / inv_peak if inv_peak > 0 else max(2 * m * n * k / t for m, n, k, t in cal.gemm_s)
    copy = _least_squares([[b, 1.0] for b, _ in cal.copy_s], [t for _, t in cal.copy_s])
    copy_bw = 1 / copy[0] if copy[0] > 0 else max(b / t for b, t in cal.copy_s)
    # collectives: t = L0 + steps(n) alpha + vol(n) S / B_kind  (unknowns L0, alpha, 1/B per kind)
    crow, cy = [], []
    for kind, n, nbytes, t in cal.collective_s:
        twice = kind in ("all_reduce", "reduce_scatter")  # gloo reduce-scatters by an all-reduce
        steps = 2 * (n - 1) if twice else n - 1  # (cost_model.collectives.GLOO_REDUCE_SCATTER)
        vol = (2 if twice else 1) * (n - 1) / n * nbytes
        crow.append([1.0, steps] + [vol if kind == k else 0.0 for k in KINDS])
        cy.append(t)
    base, alpha, *inv_bw = _least_squares(crow, cy)
    bus = {k: (1 / x if x > 0 else float("inf")) for k, x in zip(KINDS, inv_bw)}
    p2p = _least_squares([[b, 1.0] for b, _ in cal.send_recv_s], [t for _, t in cal.send_recv_s])
    # one-element all-reduces: t = L0 + 2 (n-1) alpha_scalar, L0 the collectives' launch
    # latency fitted above (the cost model charges it to every collective)
    scalar = _least_squares([[2.0 * (n - 1)] for n, _ in cal.scalar_all_reduce_s],
                            [max(0.0, t - base) for _, t in cal.scalar_all_reduce_s])[0] \
        if cal.scalar_all_reduce_s else 0.0
    return Fitted(
        gemm_flops_per_s=peak * s, gemm_k_ramp=k0_over_peak * peak, gemm_overhead_s=gemm_overhead / s,
        copy_bytes_per_s=copy_bw * s, copy_overhead_s=copy[1] / s,
        eager_op_s=(cal.program_op_s or cal.eager_op_s) / s,  # the runtime's path where measured
        view_op_s=(cal.program_view_s or cal.view_op_s) / s, dtensor_op_overhead_s=cal.dtensor_op_s / s,
        attention_efficiency=min(1.0, cal.attention_flops_per_s / peak),
        base_latency_s=base / s_lat,
        hop_latency_s=alpha / s_lat, bus_bytes_per_s={k: v * s for k, v in bus.items()},
        p2p_bytes_per_s=(1 / p2p[0] if p2p[0] > 0 else float("inf")) * s,
        optimizer_s=cal.optimizer_s / s, accumulate_s=cal.accumulate_s / s, param_tensor_s=cal.param_tensor_s / s,
        scalar_hop_latency_s=scalar / s_lat,
    )


CARRIED_FROM_BUILT_IN = ("stage_collective_wait_s", "gemm_memory_efficiency", "collective_latency_share_exponent",
                         "pipeline_call_host_s")
"""Efficiency fields a calibrated profile takes from the built-in `cpu` profile rather than
from its own measurements (cost_model/efficiency.py says where each is fitted)."""


def to_hardware(cal: Calibration, *, name: str = "cpu", built_in: Hardware | None = None) -> Hardware:
    """The profile whose rates are the measured ones, per dedicated core, with the cost
    model's efficiencies replaced by the measured per-op costs (module docstring). The
    constants calibrate does not measure (`CARRIED_FROM_BUILT_IN`) come from `built_in`
    (default: the built-in `cpu` profile; benchmarks/fit/fit_cpu_constants.py passes candidates)."""
    base = HARDWARE["cpu"] if built_in is None else built_in
    f = fit(cal, latency_exponent=latency_share_exponent(base))  # the share law this profile carries
    bus = f.bus_bytes_per_s["all_reduce"]
    total_ram = cal.total_memory_bytes or machine_memory_bytes()
    # every small op pays the eager+autograd cost (its roofline on tiny tensors is ~0)
    per_op = max(f.eager_op_s, f.copy_overhead_s)
    # the optimizer step and the accumulation as the copy traffic they are worth, so that
    # cost_model.optimizer_time_s / grad_accumulation_time_s give the measured times
    measured_passes = {"optimizer_bytes_per_param": f.optimizer_s * f.copy_bytes_per_s,
                       "accumulate_bytes_per_byte": f.accumulate_s * f.copy_bytes_per_s}
    return Hardware(
        name=name,
        peak_flops_per_s=(("bfloat16", f.gemm_flops_per_s), ("float32", f.gemm_flops_per_s)),
        memory_bytes=int(total_ram // cal.devices),
        memory_bandwidth_bytes_per_s=f.copy_bytes_per_s,
        intra_node_bandwidth_bytes_per_s=bus,
        intra_node_latency_s=f.hop_latency_s,
        inter_node_bandwidth_bytes_per_s=bus,
        inter_node_latency_s=f.hop_latency_s,
        default_gpus_per_node=base.default_gpus_per_node,
        comm_overlap=base.comm_overlap,
        collective_bandwidth_scale=tuple((k, f.bus_bytes_per_s[k] / bus) for k in ("all_gather", "reduce_scatter")),
        cores_per_node=cal.cores,
        reference_s=cal.reference_s / cal.sharing,
        efficiency=tuple(sorted({
            "gemm_efficiency": 1.0, "memory_efficiency": 1.0, "nvlink_bus_efficiency": 1.0, "nic_bus_efficiency": 1.0,
            "collective_base_latency_s": f.base_latency_s, "gemm_overhead_s": max(f.gemm_overhead_s, per_op),
            "memory_overhead_s": per_op, "gemm_k_ramp": f.gemm_k_ramp, "view_overhead_s": f.view_op_s,
            "dtensor_op_overhead_s": f.dtensor_op_overhead_s, "flash_attention_efficiency": f.attention_efficiency,
            **{k: v for k, v in measured_passes.items() if v > 0},
            **({"optimizer_tensor_overhead_s": f.param_tensor_s} if f.param_tensor_s > 0 else {}),
            **({"scalar_all_reduce_hop_s": f.scalar_hop_latency_s} if f.scalar_hop_latency_s > 0 else {}),
            # not measured here (a probe here was too noisy, or missed what whole programs show):
            # the built-in profile's, which benchmarks/fit/fit_cpu_constants.py fits on the recorded sweeps
            **{k: v for k, v in base.efficiency if k in CARRIED_FROM_BUILT_IN},
        }.items())),
    )


__all__ = ["Calibration", "Fitted", "calibrate", "combine", "fit", "latency_share_exponent", "machine_memory_bytes",
           "to_hardware"]
