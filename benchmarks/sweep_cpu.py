"""This machine as a measured sweep: 3 model sizes x 8+ configurations on 4 and 8 processes,
measured against the cost model's prediction (calibrated profile and built-in `cpu` profile).

    python benchmarks/sweep_cpu.py [--profile cpu.json] [--sizes S,M,L]
        [--worlds 4,8] --json out.json --md out.md [--quick] [--rounds 22]

A measuring run needs --json or --md (or both): nothing else is written.

What runs: for each model size and world size, every configuration is compiled through the
public entry point (`autopar.compile(model, "cpu:N", example_inputs=..., config=...)`) on
the same spawned gloo ranks (`autopar.runtime.launch.spawn`), side by side, and timed in
rounds: each round runs one step (`compiled.step(batch)`, barrier before and after, timed on
rank 0) of every configuration, interleaved in a fresh random order each round
(`round_order`; the same on every rank), after WARMUP_ROUNDS untimed rounds, so slow phases
of the shared 2-core machine hit all configurations of a group alike: the ranking and the
predicted/measured ratios are measured side by side. Why random (`--order`): a step's time
depends on the step that ran just before it, and a round-robin order (round k starting at
configuration k, reversed on odd rounds; `--order rotate`) gives every configuration
the same two predecessors in every round, so that context is a fixed bias of each row, the
same in every run (measured by benchmarks/probes/probe_microbatches.py). A random order makes it
noise that every row shares, as Google Benchmark's random interleaving does against
run-to-run variance (docs/random_interleaving.md, google/benchmark#1051). Each row keeps
the label that ran just before it in every timed round (`predecessors`).
Measurement protocol (the noise): other users' processes only ever slow a step down, so a
configuration's step time is the MINIMUM over its timed rounds (the convention of Python's
`timeit`: higher values are "typically not caused by variability in Python's speed, but by
other processes interfering with your timing accuracy"); the median is kept beside it
(`measured_median_s`). The reference workload that scales the predictions (`load_factor`)
is reduced the same way, per block of REFERENCE_WINDOWS rounds (`reference_reading`).
`--rounds` (a multiple of REFERENCE_WINDOWS, 11 by default) gives the minimum more draws:
on the machine's slow mode the fastest round stood 3.3-5.3% below the second
fastest at the median against 1.1-2.2% on quiet runs, so the minimum of 11 rested on one or two
lucky rounds (benchmarks/fit/sweep_estimators.py). Noise estimate: every world runs its first configuration twice, as
two separately compiled programs (`REPEAT_SUFFIX`); the report gives how far apart the two
identical programs measured under each estimator. Repeats are left out of the rankings.

Predicted: what the product ranks a configuration by (price = run), on `cpu:N`, with a
freshly calibrated profile (`autopar calibrate --devices 4 --out ...`; per dedicated core,
so it prices 8 processes too) when given, and with the built-in `cpu` profile:
- pp = 1: the per-op program's own price. The runtime solves the intra-op ILP for the
  configuration (autopar/placing.py `solve_config`, solver/forced.py rules) on the
  traced step at one global microbatch, and `autopar search` ranks one-stage candidates by
  that ILP's step time (solver/spmd_search.py `estimate`); the sweep prices the same
  solution (m x the ILP's per-microbatch cost + the optimizer step);
- pp > 1: the pipeline search's price (`predict_pipeline`): the intra-op ILP's stage costs
  on the (dp, tp) submesh, split into pre / layer / post pieces and assembled by the
  inter-op formulas (solver/stage_costs.py, solver/stage_dp.py) for the configuration's
  even cuts, what `autopar search` ranks pipelines by; each stage runs the per-op program.
The whole-model formula `price_profile` is kept for every row too (`*_analytic_s`), so the
two pricings of one-stage plans can be compared against the same measurements.
The machine is shared (load averages of 10-20 on 2 cores were seen while developing this),
so its speed drifts between a calibration and a sweep: every round also times
`autopar.calibrate_rank.reference_workload` on as many of the same ranks as the calibration ran
(`REFERENCE_RANKS`), and the ratio of that time to the profile's own reference time
(`load_factor`, per dedicated core) slows the profile's local work (GEMM peak, copy
bandwidth, per-op overheads: `at_load`) before it prices the group; the collectives keep
their calibrated latency and bandwidth, since the reference workload times no collective
(so the factor does not multiply the whole prediction). The predictions at
the profile's own speed are kept too (`*_raw_s`).

Figures per (size, world) group and over all: median |predicted / measured - 1|, Spearman
rank correlation of predicted vs measured step time, the regret of the profile's top pick
(measured time of the predicted-fastest configuration / measured fastest - 1), and whether
the built-in profile picks the same configuration as the calibrated one.

This drives programs only through `autopar.compile` and `compiled.step`: when the runtime
behind them changes (the per-op compiler replacing the module-level runtime), re-run this
script (and `autopar calibrate`) and the figures follow.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.lib.bench_stats import spearman  # noqa: E402

SIZES = {
    "S": "llama:layers=4,hidden=128,heads=4,kv_heads=4,ffn=256,vocab=512,seq=64",
    "M": "llama:layers=4,hidden=256,heads=4,kv_heads=4,ffn=512,vocab=1024,seq=64",
    "L": "llama:layers=4,hidden=384,heads=8,kv_heads=4,ffn=1024,vocab=2048,seq=64",
}
"""Three llama shapes (every tp in {1, 2, 4} divides their query and key/value heads, and
4 layers allow pp up to 4)."""
GLOBAL_BATCH = 16
PREDICTION_KEYS = ("predicted_calibrated_s", "predicted_default_s", "predicted_calibrated_analytic_s",
                   "predicted_default_analytic_s")
"""Headline predictions (what the product ranks by), then price_profile for every row."""
WARMUP_ROUNDS = 2
from autopar.calibrate_rank import REFERENCE_CALLS, REFERENCE_WINDOWS  # noqa: E402

TIMED_ROUNDS = REFERENCE_WINDOWS
"""The reference workload runs as one window of REFERENCE_CALLS calls per timed round, and
the load factor takes the fastest: the fastest of REFERENCE_WINDOWS windows of
REFERENCE_CALLS calls, how `autopar calibrate` reduces its own reference time
(`autopar.calibrate_rank.reference_time`), so the two compare like with like. (Calibrate took
the fastest of 3 windows of 5 calls before, 10-15% slower on an unchanged machine, and
every prediction here was scaled down by that.)"""
ORDERS = ("random", "rotate")
"""How a round orders a group's configurations (`round_order`): "random", a permutation
drawn afresh each round from a seed that is the round's number (the default); "rotate",
the round-robin of the earlier recorded runs (round k starts at configuration
k; odd rounds reversed), kept to reproduce them."""
REFERENCE_RANKS = 4
"""Ranks the reference workload runs on (the others wait at the barrier): the device count of
the calibrations it is set against (`autopar calibrate --devices 4`, the default; both
profiles here). On all 8 ranks it ran 1.33-1.40x slower per dedicated core than on 4 at an
unchanged machine speed (4 ranks per core, and 2 (n - 1) ring steps in the all-reduce it
had then), and that was read as load: every 8-process prediction came out about 1.4x too
slow next to the 4-process ones."""
REPEAT_SUFFIX = " (repeat)"
"""Label suffix of the noise estimate: the world's first configuration compiled and timed a
second time (an identical program measured in the same rounds)."""
NOISY_APART = 0.05
"""Two identical programs measured further apart than this (minimum over rounds) mark the
group as noisy in the summary: differences of that size between configurations are not
resolved, and the 3% pick target is below them. Quiet runs measured 0.5-3.3%; a run on a
loaded machine 2.1-16.3%."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepCase:
    label: str
    world: int
    config: Any  # ParallelConfig


def cases(world: int) -> list[SweepCase]:
    from autopar.config import ParallelConfig

    def c(label: str, **kw: Any) -> SweepCase:
        return SweepCase(label=label, world=world, config=ParallelConfig(**kw))

    if world == 4:
        return [
            c("dp4 mb4", dp=4, micro_batch=4),
            c("dp4 mb4" + REPEAT_SUFFIX, dp=4, micro_batch=4),
            c("dp4 mb1", dp=4, micro_batch=1),
            c("dp4 z1", dp=4, zero=1, micro_batch=4),
            c("dp4 z3", dp=4, zero=3, micro_batch=4),
            c("dp4 full-rc", dp=4, micro_batch=4, recompute="full"),
            c("dp2 tp2", dp=2, tp=2, micro_batch=8),
            c("tp4", tp=4, micro_batch=16),
            c("dp2 pp2 mb2", dp=2, pp=2, micro_batch=2),
            c("dp2 pp2 mb4 gpipe", dp=2, pp=2, micro_batch=4, schedule="gpipe"),
            c("pp4", pp=4, micro_batch=4),
            c("tp2 pp2", tp=2, pp=2, micro_batch=4),
        ]
    if world == 8:
        return [
            c("dp8", dp=8, micro_batch=2),
            c("dp8" + REPEAT_SUFFIX, dp=8, micro_batch=2),
            c("dp8 z3", dp=8, zero=3, micro_batch=2),
            c("dp8 full-rc", dp=8, micro_batch=2, recompute="full"),
            c("dp4 tp2", dp=4, tp=2, micro_batch=4),
            c("dp4 pp2", dp=4, pp=2, micro_batch=2),
            c("dp2 pp4", dp=2, pp=4, micro_batch=2),
            c("dp2 tp2 pp2", dp=2, tp=2, pp=2, micro_batch=2),
            c("tp2 pp4", tp=2, pp=4, micro_batch=4),
        ]
    raise ValueError(f"no sweep defined for {world} processes; use 4 or 8")


def add_probe_arguments(ap: argparse.ArgumentParser, *, rounds: int) -> None:
    """The arguments the probes of one sweep group share (benchmarks/probes/probe_*.py): --size,
    --world, --only, --rounds, --warmup; `probe_cases` reads them."""
    ap.add_argument("--size", choices=sorted(SIZES), default="S")
    ap.add_argument("--world", type=int, choices=(4, 8), default=4)
    ap.add_argument("--only", default="", help="comma-separated configuration labels (default: the group's all)")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--warmup", type=int, default=2)


def probe_cases(ap: argparse.ArgumentParser, args: argparse.Namespace, *, one_stage: bool = False) -> list[SweepCase]:
    """The configurations a probe runs: the group's (no repeats; with `one_stage`, pp = 1
    only), narrowed to --only. Bad counts or an unknown label end the probe with the
    parser's exit 2, saying what was given and what the group has, before any rank starts."""
    if args.rounds < 1 or args.warmup < 0:
        ap.error(f"--rounds must be at least 1 and --warmup at least 0, got --rounds {args.rounds} "
                 f"--warmup {args.warmup}")
    group = [c for c in cases(args.world) if not c.label.endswith(REPEAT_SUFFIX)
             and (not one_stage or c.config.pp == 1)]
    if not args.only:
        return group
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    known = {c.label for c in group}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        kind = "one-stage configuration" if one_stage else "configuration"
        ap.error(f"--only: no {kind} {unknown} in the {args.world}-process group; "
                 f"the group has: {', '.join(sorted(known))}")
    return [c for c in group if c.label in wanted]


# ---- on the ranks ----------------------------------------------------------------------

def round_order(n: int, k: int, order: str = "random") -> list[int]:
    """The order round k runs a group's n configurations in: indices into the group's list.
    A pure function of (n, k, order), so every rank computes the same order and their
    collectives match."""
    import random

    if order == "random":
        return random.Random(f"sweep_cpu round {k}").sample(range(n), n)
    if order == "rotate":
        rotated = list(range(k % n, n)) + list(range(k % n)) if n else []
        return rotated if k % 2 == 0 else rotated[::-1]
    raise ValueError(f"round order {order!r}: use one of {', '.join(ORDERS)}")


def _worker(rank: int, spec: str, world_cases: list[SweepCase], warmup: int, timed: int,
            order: str = "random") -> dict[str, Any]:
    import functools

    import torch
    import torch.distributed as dist

    import autopar
    from autopar.calibrate_rank import reference_workload
    from autopar.models import resolve

    ranks = min(REFERENCE_RANKS, dist.get_world_size())
    reference = reference_workload() if rank < ranks else None
    source = resolve(spec)
    batches = [source.example_inputs(GLOBAL_BATCH, generator=torch.Generator().manual_seed(1 + k))
               for k in range(warmup + timed)]
    programs = []
    for case in world_cases:
        torch.manual_seed(0)
        compiled = autopar.compile(source.build(), f"cpu:{case.world}", example_inputs=batches[0],
                                   config=case.config, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
        programs.append((case.label, compiled))
    times: dict[str, list[float]] = {label: [] for label, _ in programs}
    before: dict[str, list[str | None]] = {label: [] for label, _ in programs}
    losses: dict[str, float] = {}
    reference_s: list[float] = []
    for k, batch in enumerate(batches):
        dist.barrier()
        start = time.perf_counter()
        if reference is not None:
            for _ in range(REFERENCE_CALLS):
                reference()
        dist.barrier()
        if k >= warmup:
            reference_s.append((time.perf_counter() - start) / REFERENCE_CALLS)
        previous = None  # the reference workload ran last
        for i in round_order(len(programs), k, order):
            label, compiled = programs[i]
            dist.barrier()
            start = time.perf_counter()
            loss = compiled.step(batch)
            dist.barrier()
            if k >= warmup:
                times[label].append(time.perf_counter() - start)
                before[label].append(previous)
            losses.setdefault(label, float(loss))
            previous = label
    return {"times": times, "predecessors": before, "first_loss": losses, "reference_s": reference_s,
            "reference_ranks": ranks}


def measure(spec: str, world_cases: list[SweepCase], *, warmup: int, timed: int, order: str = "random") -> dict[str, Any]:
    from autopar.runtime.launch import spawn

    per_rank = spawn(_worker, world_cases[0].world, (spec, world_cases, warmup, timed, order),
                     collective_timeout_s=300.0)
    return per_rank[0]


# ---- prediction and figures --------------------------------------------------------------

def _profile(spec: str) -> Any:
    from benchmarks.baselines import analytic
    from autopar.models import resolve
    from autopar.trace import trace_model

    return analytic.profile_graph(trace_model(resolve(spec), batch=1, dtype="float32", layers_traced=2))


def predict(profile: Any, case: SweepCase, hardware: Any) -> float:
    """`price_profile`'s step time (the whole-model formula) on `hardware` (for a load
    other than the calibration's: `at_load`)."""
    from benchmarks.baselines import analytic
    from autopar.cluster import Cluster

    cluster = Cluster.parse(f"cpu:{case.world}", hardware=hardware)
    return analytic.price_profile(profile, case.config, cluster, global_batch=GLOBAL_BATCH).step_time_s


def _step_graph(spec: str, config: Any) -> Any:
    """The lowered training step the per-op runtime compiles for `config` (pp = 1): the
    model traced on one global microbatch of dp * micro_batch sequences, recompute applied."""
    import torch

    from autopar.models import resolve
    from autopar.trace import trace_step

    source = resolve(spec)
    rows = config.dp * config.micro_batch
    torch.manual_seed(0)
    batch = source.example_inputs(rows, generator=torch.Generator().manual_seed(1))
    return trace_step(source.build(), batch, recompute=config.recompute)[1]


def predict_ilp(graph: Any, case: SweepCase, hardware: Any) -> float:
    """The per-op program's price of a pp = 1 configuration: the intra-op ILP the runtime
    solves for it (`solve_config`), priced as `autopar search` ranks it (`estimate`).

    The program that ran is the one `autopar.compile(model, "cpu:N", config=...)` built:
    solved on the built-in `cpu` profile. Another profile prices those same placements
    (`price_solution`), not its own solve's: for dp x tp and tp4 a solve on the calibrated
    profile placed 0.3-31% of the nodes differently, a different program."""
    from autopar.cluster import HARDWARE, Cluster
    from autopar.placing import solve_config
    from solver.forced import price_solution
    from solver.spmd_search import SpmdCandidate, estimate

    config = case.config
    cluster = Cluster.parse(f"cpu:{case.world}", hardware=hardware)
    rows = config.dp * config.micro_batch
    m = GLOBAL_BATCH // rows
    ran = solve_config(graph, config, Cluster.parse(f"cpu:{case.world}"), num_microbatches=m)
    solution = ran if hardware == HARDWARE["cpu"] else price_solution(graph, config, ran, cluster, num_microbatches=m)
    cand = SpmdCandidate(mesh=(config.dp, config.tp), microbatch=rows, num_microbatches=m)
    return estimate(graph, solution, cand, cluster, GLOBAL_BATCH).step_time_s


_STAGE_COSTS: dict[tuple[str, int, Any], Any] = {}
"""Per (model, world, profile): the pipeline search's stage-cost cache, its cluster and depth."""


def predict_pipeline(spec: str, case: SweepCase, hardware: Any) -> float:
    """A pp > 1 configuration priced as `autopar search` ranks pipelines: the intra-op ILP's
    stage costs on the (dp, tp) submesh (solver/pipeline_search.py's stage-cost cache,
    solver/stage_costs.py) assembled by the inter-op formulas (solver/stage_dp.py) for the
    configuration's even cuts, schedule and microbatches (vs_hand_tuned.price_template, the
    template grid's pricing of one point)."""
    from benchmarks.vs_hand_tuned import GridCache, price_template

    from autopar.cluster import Cluster
    from autopar.models import resolve
    from autopar.trace import trace_model

    key = (spec, case.world, hardware)
    if key not in _STAGE_COSTS:
        source, traces = resolve(spec), {}

        def trace_at(rows: int, recompute: str = "none") -> Any:
            if (rows, recompute) not in traces:
                traces[(rows, recompute)] = trace_model(source, batch=rows, dtype="float32", layers_traced=2,
                                                        recompute=recompute)
            return traces[(rows, recompute)]

        cluster = Cluster.parse(f"cpu:{case.world}", hardware=hardware)
        _STAGE_COSTS[key] = (GridCache(trace_at, cluster, GLOBAL_BATCH, {}, None), cluster,
                             trace_at(1).model.num_layers)
    cache, cluster, layers = _STAGE_COSTS[key]
    got = price_template(case.config, cache, cluster, GLOBAL_BATCH, layers)
    if got is None:
        raise ValueError(f"{case.label}: not expressible by the pipeline search's stage costs")
    return got.step_time_s


def predictions(profile: Any, spec: str, case: SweepCase, hw_default: Any, hw_cal: Any | None,
                reference_s: list[float] | None = None, graph: Any = None,
                reference_ranks: int | None = None) -> dict[str, Any]:
    """A row's predicted columns: `predicted_<profile>_s` (what the product ranks by: the
    ILP's price for pp = 1, the ILP stage costs for pp > 1), `..._analytic_s` (price_profile for
    every row), each on the profile slowed by the load factor (`at_load`); the product's
    price on the profile as calibrated (`_raw`), and the load factors."""
    out: dict[str, Any] = {}
    if case.config.pp == 1 and graph is None:
        graph = _step_graph(spec, case.config)
    for name, hw in (("default", hw_default), ("calibrated", hw_cal)):
        if hw is None:
            continue
        load = load_factor(hw, reference_ranks or case.world, reference_s if reference_s is not None else [])
        now = at_load(hw, load)
        raw = predict_ilp(graph, case, hw) if case.config.pp == 1 else predict_pipeline(spec, case, hw)
        product = predict_ilp(graph, case, now) if case.config.pp == 1 else predict_pipeline(spec, case, now)
        out.update({f"load_{name}": load, f"predicted_{name}_s": product, f"predicted_{name}_raw_s": raw,
                    f"predicted_{name}_analytic_s": predict(profile, case, now)})
    return out


def repredict(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Price an earlier run's rows again (its measured times and reference timings kept)."""
    import autopar  # noqa: F401  (autopar before cost_model: import order)
    from autopar.cluster import HARDWARE, load_hardware

    old = json.loads(path.read_text())
    hw_cal = load_hardware(args.profile) if args.profile else None
    by_world = {w: {c.label: c for c in cases(w)} for w in (4, 8)}
    profiles: dict[str, Any] = {}
    rows = []
    for r in old["rows"]:
        case = by_world[r["world"]][r["label"]]
        if r["model"] not in profiles:
            profiles[r["model"]] = _profile(r["model"])
        kept = {k: v for k, v in r.items() if not k.startswith(("predicted_", "load_"))}
        rows.append({**kept, **predictions(profiles[r["model"]], r["model"], case, HARDWARE["cpu"], hw_cal,
                                           reference_s=r["reference_s"],
                                           reference_ranks=r.get("reference_ranks", r["world"]))})
    out = {**old, **summarize(rows), "rows": rows, "profile": args.profile, "repriced": True}
    return report(out, args)


def report(out: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Print the summary and write the --json / --md outputs that were asked for."""
    print("\n".join(out["summary"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    if args.md:
        write_markdown(out, Path(args.md))
    return out


def _merge_rows(ap: argparse.ArgumentParser, path: str) -> list[dict[str, Any]]:
    """The rows of the --merge JSON, or an argparse error (exit 2) naming what is wrong."""
    try:
        rows = json.loads(Path(path).read_text())["rows"]
        if not isinstance(rows, list) or not all(isinstance(r, dict) and {"size", "world"} <= set(r) for r in rows):
            raise ValueError("its rows lack size/world")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        ap.error(f"--merge {path}: not a sweep_cpu.py JSON ({exc}); give the --json file of an earlier run, "
                 "e.g. benchmarks/results/sweep_cpu.json")
    return rows


LOCAL_WORK_OVERHEADS = ("gemm_overhead_s", "memory_overhead_s", "view_overhead_s", "dtensor_op_overhead_s",
                        "optimizer_tensor_overhead_s")
"""The per-call overheads of local work (eager dispatch, DTensor, the optimizer's epilogue):
what the reference workload's small ops and autograd time, so they follow its load."""


def at_load(hardware: Any, load: float) -> Any:
    """`hardware` with its local work `load` times slower: the GEMM peaks and the copy
    bandwidth divided by it, the per-call overheads (LOCAL_WORK_OVERHEADS) multiplied; the
    collectives' latency and bandwidth kept as calibrated.

    The load factor is measured by the reference workload, which is local work only (GEMMs,
    small autograd ops, a copy): it says nothing of gloo. Measured in the other direction:
    the reference workload's gloo all-reduce, when it had one, ran 20% faster inside a
    process that had built and stepped training programs than at the start of a
    calibration, while its local parts ran the same (`autopar.calibrate_rank.reference_workload`).
    So the load scales the local work, not the whole prediction."""
    from dataclasses import replace

    from cost_model.efficiency import efficiency_for

    if load == 1.0:
        return hardware
    eff = efficiency_for(hardware)
    overrides = dict(hardware.efficiency)
    overrides.update({k: getattr(eff, k) * load for k in LOCAL_WORK_OVERHEADS})
    return replace(hardware, peak_flops_per_s=tuple((k, v / load) for k, v in hardware.peak_flops_per_s),
                   memory_bandwidth_bytes_per_s=hardware.memory_bandwidth_bytes_per_s / load,
                   efficiency=tuple(sorted(overrides.items())), reference_s=hardware.reference_s * load)


def load_factor(hardware: Any, ranks: int, reference_s: list[float]) -> float:
    """How much slower the shared machine ran the reference workload (on `ranks` ranks at once,
    REFERENCE_RANKS) during the sweep than when `hardware` was calibrated (both per dedicated
    core); 1.0 for an uncalibrated profile.
    The sweep's reference timings (one window of REFERENCE_CALLS calls per timed round) are
    reduced like the step times and like `autopar calibrate` reduces its windows: the fastest."""
    if not hardware.reference_s or not reference_s:
        return 1.0
    share = max(1.0, ranks / hardware.cores_per_node) if hardware.cores_per_node else 1.0
    return reference_reading(reference_s) / share / hardware.reference_s


def reference_reading(reference_s: list[float]) -> float:
    """The sweep's reference time from its windows (one per timed round), read as calibrate
    reads its REFERENCE_WINDOWS windows: the fastest of REFERENCE_WINDOWS. A sweep of more
    rounds (`--rounds`, a multiple of REFERENCE_WINDOWS) has one such block of consecutive
    windows per REFERENCE_WINDOWS rounds: the median over the blocks of each block's
    fastest, so that more windows do not read faster than calibrate's (the fastest of more
    draws is lower). Fewer windows than a block (`--quick`): the fastest of them."""
    w = REFERENCE_WINDOWS
    blocks = [reference_s[i:i + w] for i in range(0, len(reference_s) - w + 1, w)] or [reference_s]
    return statistics.median(min(b) for b in blocks)


def noise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per repeated configuration: how far apart two identical programs measured, under the
    headline estimator (minimum over rounds) and under the median."""
    by_label = {(r["size"], r["world"], r["label"]): r for r in rows}
    out = []
    for r in rows:
        if not r["label"].endswith(REPEAT_SUFFIX):
            continue
        twin = by_label.get((r["size"], r["world"], r["label"].removesuffix(REPEAT_SUFFIX)))
        if twin is None:
            continue
        pair = sorted((twin["measured_s"], r["measured_s"]))
        med = sorted((statistics.median(twin["measured_times_s"]), statistics.median(r["measured_times_s"])))
        out.append({"group": f"{r['size']} x {r['world']}", "label": twin["label"],
                    "min_apart": pair[1] / pair[0] - 1, "median_apart": med[1] / med[0] - 1})
    return out


def group_figures(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Error, ranking and pick figures of one group of rows for the prediction `key`."""
    measured = [r["measured_s"] for r in rows]
    predicted = [r[key] for r in rows]
    errors = [abs(p / m - 1) for p, m in zip(predicted, measured)]
    pick = min(range(len(rows)), key=lambda i: predicted[i])
    best = min(range(len(rows)), key=lambda i: measured[i])
    return {
        "median_abs_error": statistics.median(errors),
        "spearman": spearman(predicted, measured),
        "pick": rows[pick]["label"],
        "measured_best": rows[best]["label"],
        "pick_regret": measured[pick] / measured[best] - 1,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="calibrated profile (autopar calibrate --devices 4 --out ...); "
                    "per dedicated core, it prices 4 and 8 processes alike")
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--worlds", default="4,8")
    ap.add_argument("--only", default="", help="comma-separated configuration labels (for iterating)")
    ap.add_argument("--quick", action="store_true", help="1 warm-up and 3 timed rounds")
    ap.add_argument("--rounds", type=int, default=TIMED_ROUNDS,
                    help=f"timed rounds, a multiple of {REFERENCE_WINDOWS} (default {TIMED_ROUNDS}): more rounds "
                         "give the minimum over rounds more draws on a machine whose speed comes and goes")
    ap.add_argument("--order", choices=ORDERS, default="random",
                    help="how each round orders the configurations: a fresh random order (default) or the "
                         "round-robin order of the older recorded runs")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--merge", default=None, metavar="JSON",
                    help="keep an earlier run's rows of the (size, processes) groups this run does not measure "
                         "(e.g. re-measure --worlds 8 only); the tables cover both")
    ap.add_argument("--summarize", default=None, metavar="JSON",
                    help="no measuring: recompute the figures and tables of an earlier run's JSON")
    ap.add_argument("--repredict", default=None, metavar="JSON",
                    help="no measuring: keep an earlier run's measured times and reference timings, and "
                         "price every row again with the current cost model and --profile")
    args = ap.parse_args(argv)
    if args.quick and args.rounds != TIMED_ROUNDS:
        ap.error(f"--quick runs 3 timed rounds; it cannot be combined with --rounds {args.rounds} (give one of them)")
    if args.rounds < 1 or args.rounds % REFERENCE_WINDOWS:
        ap.error(f"--rounds must be a positive multiple of {REFERENCE_WINDOWS} (one reference block each), "
                 f"got {args.rounds}")
    if not (args.repredict or args.summarize or args.json or args.md):
        ap.error("a measuring run writes its rows only to --json and its tables only to --md, and neither was given: "
                 "13-30 minutes of measuring would be printed and lost; give one or both, e.g. --json "
                 "benchmarks/results/sweep_cpu.json --md benchmarks/results/sweep_cpu.md (what benchmarks/run_all.py "
                 "passes) or a file of your own")
    merged_rows = _merge_rows(ap, args.merge) if args.merge else None  # checked before ~20 minutes of measuring
    if args.repredict:
        return repredict(Path(args.repredict), args)
    if args.summarize:
        old = json.loads(Path(args.summarize).read_text())
        out = {**old, **summarize(old["rows"])}
        return report(out, args)
    import autopar  # noqa: F401  (autopar before cost_model: import order)
    from autopar.cluster import HARDWARE, load_hardware

    warmup, timed = (1, 3) if args.quick else (WARMUP_ROUNDS, args.rounds)
    hw_cal = load_hardware(args.profile) if args.profile else None
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for size in args.sizes.split(","):
        spec = SIZES[size]
        profile = _profile(spec)
        for world in (int(w) for w in args.worlds.split(",")):
            world_cases = [c for c in cases(world) if not args.only or c.label in args.only.split(",")]
            t = time.perf_counter()
            got = measure(spec, world_cases, warmup=warmup, timed=timed, order=args.order)
            ranks = got["reference_ranks"]
            load_default = load_factor(HARDWARE["cpu"], ranks, got["reference_s"])
            load_cal = load_factor(hw_cal, ranks, got["reference_s"]) if hw_cal is not None else None
            print(f"  reference workload {reference_reading(got['reference_s']) * 1e3:.0f} ms: load x{load_default:.2f} "
                  f"vs the built-in profile's calibration" + (f", x{load_cal:.2f} vs the calibrated one"
                                                                if load_cal is not None else ""), flush=True)
            for case in world_cases:
                row = {"size": size, "model": spec, "world": world, "label": case.label,
                       "config": case.config.to_json(), "measured_s": min(got["times"][case.label]),
                       "measured_median_s": statistics.median(got["times"][case.label]),
                       "measured_times_s": got["times"][case.label],
                       "predecessors": got["predecessors"][case.label], "first_loss": got["first_loss"][case.label],
                       "reference_s": got["reference_s"], "reference_ranks": ranks}
                row.update(predictions(profile, spec, case, HARDWARE["cpu"], hw_cal, reference_s=got["reference_s"],
                                       reference_ranks=ranks))
                rows.append(row)
                print(f"  {size} world {world} {case.label:<20} measured {row['measured_s'] * 1e3:7.0f} ms  "
                      f"predicted {row.get('predicted_calibrated_s', float('nan')) * 1e3:7.0f} ms (calibrated) "
                      f"{row['predicted_default_s'] * 1e3:7.0f} ms (built-in)", flush=True)
            print(f"[{size} on {world} processes: {len(world_cases)} configurations in {time.perf_counter() - t:.0f} s]",
                  flush=True)
    if args.merge:
        measured = {(r["size"], r["world"]) for r in rows}
        kept = [r for r in merged_rows if (r["size"], r["world"]) not in measured]
        order = {(s, w): i for i, (s, w) in enumerate((s, w) for s in SIZES for w in (4, 8))}
        rows = sorted(kept + rows, key=lambda r: order[(r["size"], r["world"])])
    out = summarize(rows)
    out.update(rows=rows, global_batch=GLOBAL_BATCH, warmup_rounds=warmup, timed_rounds=timed, order=args.order,
               wall_s=time.perf_counter() - start, profile=args.profile)
    return report(out, args)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    pairs = noise(rows)
    rows = [r for r in rows if not r["label"].endswith(REPEAT_SUFFIX)]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(f"{r['size']} x {r['world']}", []).append(r)
    keys = [k for k in PREDICTION_KEYS if all(k in r for r in rows)]
    figures = {name: {k: group_figures(rs, k) for k in keys} for name, rs in groups.items() if len(rs) > 1}
    summary = []
    for key in keys:
        errors = [abs(r[key] / r["measured_s"] - 1) for r in rows]
        per = [figures[g][key] for g in figures]
        summary.append(
            f"{_key_name(key)} profile: median |error| "
            f"{statistics.median(errors):.1%} over {len(rows)} runs; Spearman per group "
            + ", ".join(f"{g} {figures[g][key]['spearman']:.2f}" for g in figures)
            + f"; top-pick regret max {max(p['pick_regret'] for p in per):.1%}" if per else "")
    for key in keys:
        sizes = sorted({r["size"] for r in rows})
        pooled = {z: spearman([r[key] for r in rows if r["size"] == z], [r["measured_s"] for r in rows if r["size"] == z])
                  for z in sizes}
        summary.append(f"{_key_name(key)} profile: Spearman per model size (4 and 8 "
                       "processes pooled) " + ", ".join(f"{z} {v:.2f}" for z, v in pooled.items()))
    if {"predicted_calibrated_s", "predicted_default_s"} <= set(keys):
        same = [g for g in figures
                if figures[g]["predicted_calibrated_s"]["pick"] == figures[g]["predicted_default_s"]["pick"]]
        summary.append(f"built-in profile picks the calibrated profile's configuration in {len(same)} of "
                       f"{len(figures)} groups")
    if pairs:
        summary.append("noise (two identical programs in the same rounds): "
                       + ", ".join(f"{p['group']} {p['label']}: {p['min_apart']:.1%} apart (minimum over rounds), "
                                   f"{p['median_apart']:.1%} (median)" for p in pairs))
    noisy = [p for p in pairs if p["min_apart"] > NOISY_APART]
    if noisy:
        summary.append(f"NOISY RUN: two identical programs more than {NOISY_APART:.0%} apart in "
                       + ", ".join(f"{p['group']} ({p['min_apart']:.1%})" for p in noisy)
                       + "; differences of that size are not resolved there: re-measure on a quiet machine "
                         "before taking this run as a headline")
    return {"groups": figures, "summary": summary, "noise": pairs, "noisy_groups": [p["group"] for p in noisy]}


def _key_name(key: str) -> str:
    return key.removeprefix("predicted_").removesuffix("_s").replace("_analytic", " (price_profile for all)")


def write_markdown(out: dict[str, Any], path: Path) -> None:
    keys = [k for k in PREDICTION_KEYS if all(k in r for r in out["rows"])]
    lines = [
        "# This machine as a measured sweep (CPU, gloo)", "",
        f"Generated by `python benchmarks/sweep_cpu.py` (via `benchmarks/run_all.py`). Global batch "
        f"{out['global_batch']}, AdamW, fp32; every configuration compiled with `autopar.compile(..., config=...)` "
        f"and stepped with `compiled.step` on the same spawned gloo ranks, side by side: {out['warmup_rounds']} "
        f"warm-up rounds, then {out['timed_rounds']} timed rounds of one step of every configuration, interleaved "
        + ("round-robin (each round starts one configuration later; order reversed every other round)"
           if out.get("order", "rotate") == "rotate" else "in a fresh random order each round") + "; measured = "
        "minimum over rounds (other users only slow a step down; the median is in the JSON), and the "
        "first configuration of every world runs twice as two identical programs, a noise estimate (below). One-stage configurations (pp = 1) run "
        "the per-op program (the intra-op ILP's placements for the configuration); pipelines run the "
        "per-op program per stage (each chunk's own ILP on the stage's submesh). Predicted = what the product "
        "ranks by: for pp = 1 the ILP's own price of the program that runs (solver/spmd_search.py `estimate` "
        "of `solve_config`), for pp > 1 the pipeline search's price (ILP stage costs assembled by "
        "solver/stage_dp.py, `predict_pipeline`); the whole-model formula `analytic.price_profile` (the baseline) of every "
        "row is in the last column for comparison. "
        "Each with the calibrated profile and the built-in `cpu` profile, their local work (GEMM peak, copy "
        "bandwidth, per-op overheads; not the collectives) slowed by the load factor of the reference workload "
        "timed in the same run (`at_load`). The machine has 2 cores shared with other users.", "",
        "| size | procs | configuration | measured ms | predicted ms (calibrated) | ratio | predicted ms (built-in) | "
        "ratio | price_profile ms (calibrated) | ratio |", "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        cells = []
        for key in ("predicted_calibrated_s", "predicted_default_s", "predicted_calibrated_analytic_s"):
            value = r.get(key)
            cells.append(f"{value * 1e3:.0f} | {value / r['measured_s']:.2f}" if value else "- | -")
        lines.append(f"| {r['size']} | {r['world']} | {r['label']} | {r['measured_s'] * 1e3:.0f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "| group | profile | median abs error | Spearman | pick | measured best | pick regret |",
              "|---|---|---|---|---|---|---|"]
    for g, per in out["groups"].items():
        for k in keys:
            f = per[k]
            lines.append(f"| {g} | {_key_name(k)} | {f['median_abs_error']:.1%} | "
                         f"{f['spearman']:.2f} | {f['pick']} | {f['measured_best']} | {f['pick_regret']:.1%} |")
    lines += [""] + [f"- {s}" for s in out["summary"]] + [f"- wall time {out['wall_s']:.0f} s (measuring)"]
    if out.get("repriced"):
        lines.append("- predictions re-priced with `sweep_cpu.py --repredict` from this run's measured times and "
                     "reference timings (the current cost model and profiles; nothing re-measured)")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
