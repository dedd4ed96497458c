"""Fit the cpu profile's `stage_collective_wait_s` on the CPU sweep's recorded runs.

What it fits: ranks sharing cores (4 or 8 gloo processes on this machine's 2 cores) that
run a collective inside one pipeline stage (its tensor-parallel pair, its data-parallel
gradient sync) while the other stages' ranks run different work on the same cores wait for
each other's turn on a core; cost_model/collectives.py adds the wait to that collective's
fixed latency (never on GPUs: it needs ranks > cores; never in a one-stage program, whose
groups all reach the same collective at once).

Why a fit and not a calibrate probe: measured directly (a loop of work and a pair's
4 KiB all-gather on every rank, 4 ranks on 2 cores, /tmp probes 2026-11-25) the excess
over the priced pair all-gather was 0 to 0.5 ms per call from one window to the next, and
an earlier probe of the same wait inside `autopar calibrate` (`Calibration.sync_skew_s`)
read 0.25 and 1.4 ms in two consecutive 3-run calibrations: too noisy to price from one
calibration. What it explains is visible in whole programs: per rank, tensor parallelism
inside a pipeline left the cores idle 18% of the step (M model, tp2 pp2 on 4 ranks: CPU
85-108 ms per rank, wall 233 ms) against 4% for dp4 (3 collectives per step instead of
50-70), and every sweep priced tp2 pp2 and dp2 tp2 pp2 at 0.62-0.86 of measured.
Charging one-stage groups too (a first version, 0.4 ms, measured out of sample in
benchmarks/records/sweep_cpu_run6) priced dp2 tp2 at 1.02-1.10 of measured against
0.89-1.02 for dp4: the one-stage price of its collectives already holds their wait.

How: every recorded sweep (benchmarks/records/sweep_cpu_*.json, the measured step times
of the same 57 programs, six runs on four days) is priced again with the built-in `cpu`
profile carrying each candidate wait (the programs that ran are the built-in profile's
solves without the wait: `sweep_cpu.predict_ilp` prices those placements; pipelines by
the pipeline search's stage costs). The wait chosen maximises the mean per-group Spearman
(model size x processes) over the runs; ties go to the smaller median |error|. Leave-one-
run-out: each run priced at the wait the other runs choose, beside the wait 0.

Output: --json (every run x wait: per-group Spearman, median error, regret) and --md;
--write stores the chosen wait in the built-in profile (autopar/cpu_profile.json,
efficiency.stage_collective_wait_s), which `autopar calibrate` carries into the
profiles it writes (it does not measure it).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

RUNS = ("run1", "rerun", "run2", "run3", "run4", "run5")
"""The recorded sweeps (benchmarks/records/sweep_cpu_<run>.json; records/README.md dates each)."""
WAITS_S = (0.0, 0.2e-3, 0.4e-3, 0.6e-3, 0.8e-3, 1.0e-3, 1.5e-3, 2.0e-3)
KEY = "predicted_default_s"
PROFILE = ROOT / "autopar" / "cpu_profile.json"


def with_wait(hardware: Any, wait_s: float) -> Any:
    eff = dict(hardware.efficiency)
    eff["stage_collective_wait_s"] = wait_s
    return replace(hardware, efficiency=tuple(sorted(eff.items())))


def price_run(run: str, waits: tuple[float, ...]) -> dict[str, Any]:
    """{wait: {"groups": {group: figures}, "median_abs_error": ...}} for one recorded run."""
    import autopar  # noqa: F401  (autopar before cost_model: import order)
    import sweep_cpu as sc
    from autopar.cluster import HARDWARE

    rows = json.loads((ROOT / "benchmarks" / "records" / f"sweep_cpu_{run}.json").read_text())["rows"]
    rows = [r for r in rows if not r["label"].endswith(sc.REPEAT_SUFFIX)]
    by_world = {w: {c.label: c for c in sc.cases(w)} for w in (4, 8)}
    profiles: dict[str, Any] = {}
    graphs: dict[tuple[str, str], Any] = {}
    out: dict[str, Any] = {}
    for wait in waits:
        hw = with_wait(HARDWARE["cpu"], wait)
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
        out[f"{wait:.6f}"] = {
            "groups": {g: sc.group_figures(rs, KEY) for g, rs in sorted(groups.items())},
            "median_abs_error": statistics.median(abs(r[KEY] / r["measured_s"] - 1) for r in priced),
        }
    return out


def score(table: dict[str, dict[str, Any]], runs: list[str], wait: str) -> tuple[float, float]:
    """(mean per-group Spearman, -mean median error) over `runs` at `wait`: larger is better."""
    sp = [f["spearman"] for run in runs for f in table[run][wait]["groups"].values()]
    err = [table[run][wait]["median_abs_error"] for run in runs]
    return statistics.mean(sp), -statistics.mean(err)


def choose(table: dict[str, dict[str, Any]], runs: list[str]) -> str:
    return max(table[runs[0]], key=lambda w: score(table, runs, w))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "fit_cpu_wait.json"))
    ap.add_argument("--md", default=str(ROOT / "benchmarks" / "results" / "fit_cpu_wait.md"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--reuse", default=None, metavar="JSON",
                    help="an earlier output of this script: the (run, wait) pairs priced there are not priced again")
    ap.add_argument("--write", action="store_true",
                    help="store the chosen wait in autopar/cpu_profile.json (the built-in profile)")
    args = ap.parse_args(argv)
    missing = [run for run in RUNS if not (ROOT / "benchmarks" / "records" / f"sweep_cpu_{run}.json").exists()]
    if missing:
        ap.error(f"recorded sweeps {missing} not found in benchmarks/records/ (sweep_cpu_<run>.json); the fit "
                 f"needs all of {list(RUNS)}: restore them from git")
    done: dict[str, dict[str, Any]] = {}
    if args.reuse:
        try:
            done = json.loads(Path(args.reuse).read_text())["table"]
            if not isinstance(done, dict) or not all(isinstance(v, dict) for v in done.values()):
                raise ValueError("its table is not {run: {wait: figures}}")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            ap.error(f"--reuse {args.reuse}: not an output of this script ({exc}); give an earlier --json file, "
                     "e.g. benchmarks/results/fit_cpu_wait.json, or leave --reuse out to price every pair")
    todo = [tuple(w for w in WAITS_S if f"{w:.6f}" not in done.get(run, {})) for run in RUNS]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        priced = list(pool.map(price_run, RUNS, todo))
    table = {run: {f"{w:.6f}": {**done.get(run, {}), **new}[f"{w:.6f}"] for w in WAITS_S}
             for run, new in zip(RUNS, priced)}
    runs = list(RUNS)
    chosen = choose(table, runs)
    loro = {}
    for held in runs:
        w = choose(table, [r for r in runs if r != held])
        zero = f"{0.0:.6f}"
        loro[held] = {"wait": w, "spearman": score(table, [held], w)[0], "spearman_at_0": score(table, [held], zero)[0],
                      "median_abs_error": table[held][w]["median_abs_error"],
                      "median_abs_error_at_0": table[held][zero]["median_abs_error"],
                      "max_regret": max(f["pick_regret"] for f in table[held][w]["groups"].values()),
                      "max_regret_at_0": max(f["pick_regret"] for f in table[held][zero]["groups"].values())}
    result = {"chosen_wait_s": float(chosen), "runs": runs, "waits_s": list(WAITS_S), "table": table,
              "leave_one_run_out": loro, "key": KEY}
    Path(args.json).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    lines = ["# The cpu profile's stage collective wait, fitted on the recorded sweeps", "",
             "Generated by `python benchmarks/fit_cpu_wait.py` (module docstring: what, why, how). Built-in "
             "profile; per-group Spearman of predicted vs measured step time, mean over the 6 groups "
             "(S, M, L x 4, 8 processes) of each run.", "",
             "| wait ms | " + " | ".join(runs) + " | mean | median \\|error\\| (mean) |",
             "|---|" + "---|" * (len(runs) + 2)]
    for w in table[runs[0]]:
        sp, err = score(table, runs, w)
        lines.append(f"| {float(w) * 1e3:.1f} | " + " | ".join(f"{score(table, [r], w)[0]:.3f}" for r in runs)
                     + f" | {sp:.3f} | {-err:.1%} |")
    lines += ["", f"Chosen on all runs: **{float(chosen) * 1e3:.1f} ms**.", "",
              "Leave one run out (the wait the other runs choose, priced on the run left out):", "",
              "| run | wait ms | mean Spearman | at 0 | median \\|error\\| | at 0 | max regret | at 0 |",
              "|---|---|---|---|---|---|---|---|"]
    for r, v in loro.items():
        lines.append(f"| {r} | {float(v['wait']) * 1e3:.1f} | {v['spearman']:.3f} | {v['spearman_at_0']:.3f} | "
                     f"{v['median_abs_error']:.1%} | {v['median_abs_error_at_0']:.1%} | {v['max_regret']:.1%} | "
                     f"{v['max_regret_at_0']:.1%} |")
    lines += ["", "Per group at the chosen wait (Spearman; at 0 in brackets):", "",
              "| run | " + " | ".join(table[runs[0]][chosen]["groups"]) + " |",
              "|---|" + "---|" * len(table[runs[0]][chosen]["groups"])]
    zero = f"{0.0:.6f}"
    for r in runs:
        lines.append(f"| {r} | " + " | ".join(
            f"{table[r][chosen]['groups'][g]['spearman']:.2f} ({table[r][zero]['groups'][g]['spearman']:.2f})"
            for g in table[r][chosen]["groups"]) + " |")
    Path(args.md).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.write:
        data = json.loads(PROFILE.read_text())
        data["hardware"]["efficiency"]["stage_collective_wait_s"] = float(chosen)
        PROFILE.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        print(f"wrote stage_collective_wait_s = {float(chosen) * 1e3:.1f} ms to {PROFILE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
