"""Fit the cpu profile's four sweep-fitted constants on the CPU sweep's recorded runs.

The four constants (cost_model/efficiency.py; their values: docs/cost-model.md):

1. `gemm_memory_efficiency`: the share of the copy bandwidth at which a GEMM's operand and
   output bytes move in a training step (the roofline's t_memory of a GEMM; 1 on GPUs).
   What it explains: the same FLOPs cost more CPU in thin GEMMs. The sweep's large model on
   4 ranks (dp4, probed for CPU time per op with `time.thread_time`) spent
   158 ms of CPU per step in its GEMMs at one sequence per microbatch (64-row activations,
   each weight read and each weight gradient written once per microbatch) against 119 ms at
   four sequences (256 rows, one microbatch), and a GEMM of that layer alone, 4 processes on
   the 2 cores, ran at 78 GFLOP/s per CPU-second with its operands evicted from cache
   against 95 for the 256-row one: fitted over both shapes, t = FLOPs / 107 GFLOP/s +
   bytes / 13.9 GB/s, a third of a streaming copy's bandwidth. Every recorded sweep priced
   dp4 at one sequence per microbatch 0.77-0.91 of measured against 0.89-1.02 for four.
   Why a fit and not a calibrate probe: probed inside `autopar calibrate` (GEMMs with
   operands rotated through 96 MiB, per-rank timing windows, fitted beside the peak and
   the K-ramp) the bytes came out at 0.8-1.4x the copy bandwidth: the penalty is a thin-M
   one (a small row count re-reads the whole weight), which a bytes-linear term fitted over
   fat and thin shapes alike averages away; whole programs show it.
2. `stage_collective_wait_s`: ranks sharing cores (4 or 8 gloo processes on this machine's
   2 cores) that run a collective inside one pipeline stage (its tensor-parallel pair, its
   data-parallel gradient sync) while the other stages' ranks run different work on the
   same cores wait for each other's turn on a core; cost_model/collectives.py adds the
   wait to that collective's fixed latency (never on GPUs: it needs ranks > cores; never
   in a one-stage program, whose groups all reach the same collective at once).
   Why a fit and not a calibrate probe: measured directly (a loop of work and a pair's
   4 KiB all-gather on every rank, 4 ranks on 2 cores) the excess
   over the priced pair all-gather was 0 to 0.5 ms per call from one window to the next,
   and an earlier probe of the same wait inside `autopar calibrate`
   (`Calibration.sync_skew_s`) read 0.25 and 1.4 ms in two consecutive 3-run
   calibrations: too noisy to price from one calibration. What it explains is visible in
   whole programs: per rank, tensor parallelism inside a pipeline left the cores idle 18%
   of the step (M model, tp2 pp2 on 4 ranks: CPU 85-108 ms per rank, wall 233 ms) against
   4% for dp4 (3 collectives per step instead of 50-70), and every sweep priced tp2 pp2
   and dp2 tp2 pp2 at 0.62-0.86 of measured. Charging one-stage groups too (a first
   version, 0.4 ms, measured out of sample in a later sweep) priced
   dp2 tp2 at 1.02-1.10 of measured against 0.89-1.02 for dp4: the one-stage price of its
   collectives already holds their wait.
3. `collective_latency_share_exponent` g: a collective's latency terms (per ring step, per
   call) grow as (ranks per core) ** g where its bandwidth shrinks linearly. g = 1 (every
   ring step time-sliced in full) over-priced the sweep's 8-process data-parallel and
   pipeline programs: with one latency per gradient bucket priced, S x 8's dp8 at 1.32
   and its pipelines at 1.12-1.25 of measured in an earlier headline sweep, while
   the 4-process rows, priced at the calibration's own sharing, sat at 0.92-1.0. What it
   explains: two calibrations of this machine, 8 and 4 ranks on 2 cores,
   gave a per-core ring step at 8 ranks 0.906x the one at 4 (242 and 267 us stored at
   g = 1: 2 ** (g - 1) = 0.906, g = 0.86): a ring step is part CPU work, time-sliced,
   and part waiting on a peer. One pair only, and the 4-rank figure spread 187-333 us
   over the calibrations recorded with the sweeps: the fit decides. Why a
   fit and not a calibrate probe: calibrate measures at one rank count (the profile's);
   the exponent is the change between two, and measured back to back (no work between
   collectives) it misses what the programs show (collectives amid GEMM work took 1.0-1.2x
   their price on 8 ranks, 1.3-2x on 4, in probes). `autopar calibrate`
   stores latencies per core by the same law (measured / s ** g), so the calibration's own
   rank count prices as measured whatever g: only other rank counts move.
4. `pipeline_call_host_s` h: host time per pipeline stage per chunk call (a microbatch's
   forward and backward through the schedule), beyond the stage graph's ops and boundary
   messages as priced, per dedicated core (x ranks per core; 0 on GPUs). What it explains:
   deeper pipelines ran slower than priced in twelve recorded sweeps (log measured / priced,
   dp2 pp4 against dp4 pp2 on 8 processes: +4.2 to +5.9% per size, mean of the twelve);
   probed on S and M x 8 (per-rank CPU and wall of dp8, dp4 pp2 and dp2 pp4),
   dp2 pp4 ran about 12 ms per step slower than priced against dp4 pp2 on both S and M,
   0.7-1.6 ms of CPU per extra stage call, where the priced extra nodes are a few us.
   Why a fit and not a calibrate probe: trivial stages through the runtime's path measure
   0.07 ms per call without messages and 0.2 ms with one message each way (2 ranks), but
   what the programs pay also holds the boundary messages' host work, which the p2p price
   (latency + bandwidth, measured as a ping-pong's wall time) already partly holds: only
   the whole programs separate the two.

How: every recorded sweep (benchmarks/data/cpu_sweeps/sweep_<run>.json for RUNS, the measured
step times of the same 57 programs, six runs) is priced again with the
built-in `cpu` profile carrying each candidate value (the programs that ran are the
built-in profile's solves: `sweep_cpu.predict_ilp` prices those placements; pipelines by
the pipeline search's stage costs). One pass of coordinate search, in GRIDS order: each
constant's value maximises the mean Spearman over the runs' groups (model size x
processes) and sizes (4 and 8 processes ranked together: the sweep's ranking target is
per model size), the constants before it at their chosen values
and the ones after it at the built-in profile's; ties go to the smaller median |error|. Leave-one-run-out per
constant: each run priced at the value the other runs choose, beside the neutral value
(1, 0 and 1: the term off, linear sharing).

Output: --json (per constant, every run x value: per-group Spearman, median error,
regret) and --md; --write stores the chosen values in the built-in profile
(autopar/cpu_profile.json, `efficiency`; the latencies derived again from its kept
measurements at the chosen g), which `autopar calibrate` carries into the profiles it
writes (it measures none of them). --reuse skips (constant, run, value) prices an
earlier output holds at the same values of the other constants and on the same built-in
measurements (`profile_digest`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SWEEPS = ROOT / "benchmarks" / "data" / "cpu_sweeps"
RUNS = ("28", "29", "30", "31", "32", "33")
"""The recorded sweeps (SWEEPS / sweep_<run>.json; its README dates each): six runs in
random round order, measured with the per-rank programs the runtime runs but for
the loss report's transport (DTensor in these runs, a direct all-reduce on each Partial
axis's group in the runtime: the same one-element all-reduces, 1-3 ms less host work per
step at 8 ranks). Older sweeps ran programs that differ from the runtime's (before gradient
buckets, the views' price, per-chunk pipeline calls and the loss report's transport); fitted
on them, the pipeline terms priced S x 8's pipelines 0.85 of measured against 1.0 for `dp8`.
Sweeps measured after these (runs 34 and later) are not in the fit: they check it out of
sample."""
GRIDS: dict[str, tuple[float, ...]] = {
    "gemm_memory_efficiency": (1.0, 0.6, 0.4, 0.35, 0.3, 0.25, 0.2),
    "stage_collective_wait_s": (0.0, 0.5e-3, 1.0e-3, 1.5e-3, 2.0e-3),
    "collective_latency_share_exponent": (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3),
    "pipeline_call_host_s": (0.0, 0.1e-3, 0.2e-3, 0.3e-3, 0.4e-3, 0.5e-3, 0.6e-3, 0.8e-3, 1.0e-3, 1.2e-3, 1.5e-3),
}
"""The constants, in the order they are fitted, and the values tried."""
LATENCY = "collective_latency_share_exponent"
NEUTRAL = {"gemm_memory_efficiency": 1.0, "stage_collective_wait_s": 0.0, LATENCY: 1.0, "pipeline_call_host_s": 0.0}
"""Each constant's value that leaves its term out (the leave-one-run-out baseline)."""
KEY = "predicted_default_s"
PROFILE = ROOT / "autopar" / "cpu_profile.json"


def builtin_measurements() -> Any:
    """The measurements the built-in profile keeps (autopar/cpu_profile.json)."""
    from autopar.calibrate import Calibration

    return Calibration.from_json(json.loads(PROFILE.read_text())["measurements"])


def with_values(hardware: Any, values: dict[str, float]) -> Any:
    """The built-in profile (`hardware`, what `autopar.calibrate.to_hardware` derives from its
    kept measurements) carrying `values`, derived again from those measurements: a share-law
    exponent also changes how its latencies are normalised per core (the rank count measured
    stays priced as measured)."""
    from autopar.calibrate import to_hardware

    eff = dict(hardware.efficiency)
    eff.update(values)
    return to_hardware(builtin_measurements(), name=hardware.name,
                       built_in=replace(hardware, efficiency=tuple(sorted(eff.items()))))


def _tag(v: float) -> str:
    return f"{v:.6f}"


def price_run(run: str, name: str, values: tuple[float, ...], held: dict[str, float]) -> dict[str, Any]:
    """{value: {"groups": {group: figures}, "median_abs_error": ...}} for one recorded run, the
    constant `name` at each of `values` and the others at `held`."""
    import autopar  # noqa: F401  (autopar before cost_model: import order)
    from benchmarks import sweep_cpu as sc
    from autopar.cluster import HARDWARE

    rows = json.loads((SWEEPS / f"sweep_{run}.json").read_text())["rows"]
    rows = [r for r in rows if not r["label"].endswith(sc.REPEAT_SUFFIX)]
    by_world = {w: {c.label: c for c in sc.cases(w)} for w in (4, 8)}
    profiles: dict[str, Any] = {}
    graphs: dict[tuple[str, str], Any] = {}
    out: dict[str, Any] = {}
    for value in values:
        hw = with_values(HARDWARE["cpu"], {**held, name: value})
        priced = []
        for r in rows:
            case = by_world[r["world"]][r["label"]]
            if r["model"] not in profiles:
                profiles[r["model"]] = sc._profile(r["model"])
            graph = None
            if case.config.pp == 1:
                key = (r["model"], r["label"])
                if key not in graphs:
                    graphs[key] = sc._step_graph(r["model"], case.config)
                graph = graphs[key]
            p = sc.predictions(profiles[r["model"]], r["model"], case, hw, None, reference_s=r["reference_s"],
                               reference_ranks=r.get("reference_ranks", r["world"]), graph=graph)
            priced.append({**r, KEY: p[KEY]})
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in priced:
            groups.setdefault(f"{r['size']} x {r['world']}", []).append(r)
        sizes: dict[str, list[dict[str, Any]]] = {}
        for r in priced:
            sizes.setdefault(r["size"], []).append(r)
        out[_tag(value)] = {
            "groups": {g: sc.group_figures(rs, KEY) for g, rs in sorted(groups.items())},
            "sizes": {z: sc.group_figures(rs, KEY)["spearman"] for z, rs in sorted(sizes.items())},
            "median_abs_error": statistics.median(abs(r[KEY] / r["measured_s"] - 1) for r in priced),
        }
    return out


def score(table: dict[str, dict[str, Any]], runs: list[str], value: str) -> tuple[float, float]:
    """(mean Spearman, -mean median error) over `runs` at `value`: larger is better. The mean
    is over each run's per-group Spearmans (size x processes) and its per-size ones (4 and 8
    processes ranked together: the sweep's ranking target is per model size)."""
    sp = [f["spearman"] for run in runs for f in table[run][value]["groups"].values()]
    sp += [v for run in runs for v in table[run][value].get("sizes", {}).values()]
    err = [table[run][value]["median_abs_error"] for run in runs]
    return statistics.mean(sp), -statistics.mean(err)


def choose(table: dict[str, dict[str, Any]], runs: list[str]) -> str:
    return max(table[runs[0]], key=lambda w: score(table, runs, w))


def profile_digest() -> str:
    """The built-in profile's measured part (every field but the constants fitted here): prices
    an earlier output holds are reused only if they were priced on the same measurements."""
    import hashlib

    from autopar.cluster import HARDWARE

    data = with_values(HARDWARE["cpu"], NEUTRAL).to_json()  # derived from its measurements at the neutral values
    data["efficiency"] = {k: v for k, v in data["efficiency"].items() if k not in GRIDS}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _same_held(old: dict[str, float] | None, held: dict[str, float]) -> bool:
    """An earlier output's held values are these: a constant it does not name (fitted since)
    was then at its neutral value (the term did not exist)."""
    if old is None:
        return False
    return all(old.get(k, NEUTRAL[k]) == held.get(k, NEUTRAL[k]) for k in set(old) | set(held))


def _fit_one(name: str, held: dict[str, float], done: dict[str, Any], jobs: int) -> dict[str, Any]:
    """One constant's table, choice and leave-one-run-out, the others at `held`."""
    grid = GRIDS[name]
    digest = profile_digest()
    old_fit = done.get(name, {})
    reuse = old_fit if _same_held(old_fit.get("held"), held) and old_fit.get("profile") == digest else {}
    # prices of an output made before the per-size figures are priced again
    old = {run: {v: f for v, f in vals.items() if "sizes" in f} for run, vals in reuse.get("table", {}).items()}
    todo = [tuple(v for v in grid if _tag(v) not in old.get(run, {})) for run in RUNS]
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        priced = list(pool.map(price_run, RUNS, [name] * len(RUNS), todo, [held] * len(RUNS)))
    table = {run: {_tag(v): {**old.get(run, {}), **new}[_tag(v)] for v in grid} for run, new in zip(RUNS, priced)}
    runs = list(RUNS)
    chosen = choose(table, runs)
    neutral = _tag(NEUTRAL[name])
    loro = {}
    for out in runs:
        v = choose(table, [r for r in runs if r != out])
        loro[out] = {"value": float(v), "spearman": score(table, [out], v)[0],
                     "spearman_neutral": score(table, [out], neutral)[0],
                     "median_abs_error": table[out][v]["median_abs_error"],
                     "median_abs_error_neutral": table[out][neutral]["median_abs_error"],
                     "max_regret": max(f["pick_regret"] for f in table[out][v]["groups"].values()),
                     "max_regret_neutral": max(f["pick_regret"] for f in table[out][neutral]["groups"].values())}
    return {"held": held, "profile": digest, "grid": list(grid), "chosen": float(chosen), "table": table,
            "leave_one_run_out": loro}


def _markdown(name: str, fit: dict[str, Any]) -> list[str]:
    table, runs = fit["table"], list(RUNS)
    chosen, neutral = _tag(fit["chosen"]), _tag(NEUTRAL[name])
    held = ", ".join(f"{k} = {v:g}" for k, v in fit["held"].items())
    lines = [f"## {name}", "", f"The other constants held at: {held}.", "",
             f"| {name} | " + " | ".join(runs) + " | mean | median \\|error\\| (mean) |",
             "|---|" + "---|" * (len(runs) + 2)]
    for v in table[runs[0]]:
        sp, err = score(table, runs, v)
        lines.append(f"| {float(v):g} | " + " | ".join(f"{score(table, [r], v)[0]:.3f}" for r in runs)
                     + f" | {sp:.3f} | {-err:.1%} |")
    lines += ["", f"Chosen on all runs: **{fit['chosen']:g}**.", "",
              f"Leave one run out (the value the other runs choose, priced on the run left out; "
              f"neutral = {NEUTRAL[name]:g}, the term off):", "",
              "| run | value | mean Spearman | neutral | median \\|error\\| | neutral | max regret | neutral |",
              "|---|---|---|---|---|---|---|---|"]
    for r, v in fit["leave_one_run_out"].items():
        lines.append(f"| {r} | {v['value']:g} | {v['spearman']:.3f} | {v['spearman_neutral']:.3f} | "
                     f"{v['median_abs_error']:.1%} | {v['median_abs_error_neutral']:.1%} | {v['max_regret']:.1%} | "
                     f"{v['max_regret_neutral']:.1%} |")
    groups = list(table[runs[0]][chosen]["groups"])
    sizes = list(table[runs[0]][chosen].get("sizes", {}))
    lines += ["", "Per group and per size (4 and 8 processes pooled) at the chosen value (Spearman; neutral in "
              "brackets):", "",
              "| run | " + " | ".join(groups + [f"{z} pooled" for z in sizes]) + " |",
              "|---|" + "---|" * (len(groups) + len(sizes))]
    for r in runs:
        cells = [f"{table[r][chosen]['groups'][g]['spearman']:.2f} ({table[r][neutral]['groups'][g]['spearman']:.2f})"
                 for g in groups]
        cells += [f"{table[r][chosen]['sizes'][z]:.2f} ({table[r][neutral]['sizes'][z]:.2f})" for z in sizes]
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "fit_cpu_constants.json"))
    ap.add_argument("--md", default=str(ROOT / "benchmarks" / "results" / "fit_cpu_constants.md"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--reuse", default=None, metavar="JSON",
                    help="an earlier output of this script: the prices it holds (same values of the other "
                         "constants) are not computed again")
    ap.add_argument("--write", action="store_true",
                    help="store the chosen values in autopar/cpu_profile.json (the built-in profile)")
    args = ap.parse_args(argv)
    missing = [run for run in RUNS if not (SWEEPS / f"sweep_{run}.json").exists()]
    if missing:
        ap.error(f"recorded sweeps {missing} not found in {SWEEPS} (sweep_<run>.json); the fit "
                 f"needs all of {list(RUNS)}: restore them from git")
    done: dict[str, Any] = {}
    if args.reuse:
        try:
            done = json.loads(Path(args.reuse).read_text())["constants"]
            if not isinstance(done, dict) or not all(isinstance(v, dict) and isinstance(v.get("table"), dict)
                                                     for v in done.values()):
                raise ValueError("its constants are not {name: {table: {run: {value: figures}}}}")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            ap.error(f"--reuse {args.reuse}: not an output of this script ({exc}); give an earlier --json file, "
                     "e.g. benchmarks/results/fit_cpu_constants.json, or leave --reuse out to price every value")
    import autopar  # noqa: F401  (autopar before cost_model: import order)
    from autopar.cluster import HARDWARE

    shipped = dict(HARDWARE["cpu"].efficiency)
    current = {name: float(shipped.get(name, NEUTRAL[name])) for name in GRIDS}
    fits: dict[str, Any] = {}
    for name in GRIDS:
        held = {k: v for k, v in current.items() if k != name}
        fits[name] = _fit_one(name, held, done, args.jobs)
        current[name] = fits[name]["chosen"]
    result = {"chosen": current, "runs": list(RUNS), "key": KEY, "constants": fits}
    Path(args.json).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    lines = ["# The cpu profile's sweep-fitted constants", "",
             "Generated by `python benchmarks/fit/fit_cpu_constants.py` (module docstring: what, why, how). Built-in "
             "profile; Spearman of predicted vs measured step time, mean over the 6 groups (S, M, L x 4, 8 processes) "
             "and the 3 sizes (4 and 8 processes pooled) of each recorded run; one pass of coordinate search in the "
             "order below.", ""]
    for name, fit in fits.items():
        lines += _markdown(name, fit)
    lines.append("Chosen: " + ", ".join(f"**{k} = {v:g}**" for k, v in current.items()) + ".")
    Path(args.md).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.write:
        data = json.loads(PROFILE.read_text())
        data["hardware"] = with_values(HARDWARE["cpu"], current).to_json()  # latencies per core by the chosen law
        PROFILE.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        print(f"wrote {current} to {PROFILE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
