"""Regenerate every benchmark table and figure in benchmarks/results/ from the repository alone.

    python benchmarks/run_all.py [--full] [--skip-measure]

Phases, each printing its figures as it goes (wall time per phase at the end):
1. `autopar calibrate --devices 4 --repeats 3` -> results/cpu_profile.json (this machine,
   per dedicated core: it prices 4 and 8 processes; the median of 3 runs, so one burst of
   other users' load does not set a fit)
2. benchmarks/sweep_cpu.py (3 model sizes x 8-11 configurations on 4 and 8 processes,
   measured vs the calibrated and the built-in profile) -> results/sweep_cpu.{md,json};
   benchmarks/measure_cpu.py (autopar vs the hand-tuned baseline, measured) ->
   results/measured_cpu.{md,json}; benchmarks/measure_torchtitan.py (autopar vs torchtitan
   itself, measured) -> results/torchtitan.{md,json,png}; with no `make bench-install` it
   prints one line saying it was skipped; benchmarks/measure_hf_moe.py (Hugging Face MoE
   models: the search's plan beside ep2 x dp2, measured) -> results/hf_moe.{md,json}
3. benchmarks/fit/fit_cost_model.py: the closed-form baseline's fit on every published run ->
   results/fitted_constants.json (a reproducibility check of the committed constants it alone
   sets, `overlap_efficiency` and `compiled_memory_factor`; the others are the one model's,
   committed by benchmarks/fit/fit_one_model.py --commit), and
   the leave-one-source-out and leave-one-publication-out fits ->
   results/loso_by_{source,publication}.json; with --full also benchmarks/fit/fit_cpu_constants.py
   (the cpu profile's GEMM memory efficiency, stage collective wait, latency share law and
   pipeline chunk-call host time refitted on the sweeps in benchmarks/data/cpu_sweeps/, ~50 min) ->
   results/fit_cpu_constants.{md,json}, checked
   against the built-in profile's
4. benchmarks/validate_cost_model.py (published runs in benchmarks/data/, LOSO headline,
   ranking groups, this machine's sweep) -> results/cost_model_validation.md, then
   benchmarks/validate_one_model.py (the same runs priced by the model that ranks plans,
   ~5 min) -> results/one_model_validation.md (with --full first benchmarks/fit/fit_one_model.py:
   the one model's constants fitted on the published runs, left out by publication and by
   source, ~30 min on 2 processes -> results/one_model_fit.{md,json}), and at the
   same time (single-process, after the measured part so it does not disturb it)
   benchmarks/vs_hand_tuned.py: the first QUICK_GROUPS groups (smallest clusters) ->
   results/vs_hand_tuned_quick.md, or with --full every group -> results/vs_hand_tuned.md;
   with --full also benchmarks/validate_moe.py (the published mixture-of-experts runs,
   held out of the dense fit, ~5 min) -> results/moe_validation.{md,json}
5. benchmarks/op_coverage.py (share of each model's FLOPs the ILP can shard) ->
   results/op_coverage.md; benchmarks/gpu_report.py: results/gpu_h100.md re-priced from the
   rows a lent H100 measured (results/gpu_h100_run*.jsonl; nothing is measured here); with
   --full also benchmarks/check_search_plans.py (every searched top-5 plan on cpu:2/4/8
   trains like the single-process reference, ~16 min) -> results/search_plans_run.{md,json}
6. benchmarks/plots_results.py -> results/*.png
Nothing outside the repository is read (the published runs and the recorded CPU sweeps ship
in benchmarks/data/). What older runs found lives in the code's docstrings and in docs/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PY = sys.executable
QUICK_GROUPS = 40
BUDGET_S = 55 * 60
"""The whole run on the shared 2-core development machine (its load varies a lot), torchtitan included."""


def _run(cmd: list[str]) -> None:
    print(f"$ {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true",
                    help="the complete vs_hand_tuned table (~20 min more), the cpu wait refit (~13 min) and every "
                         "searched plan run (~12 min)")
    ap.add_argument("--skip-measure", action="store_true", help="reuse results/{sweep,measured}_cpu.json and the profile")
    args = ap.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    phases: list[tuple[str, float]] = []
    start = time.perf_counter()
    profile = str(RESULTS / "cpu_profile.json")

    if not args.skip_measure:
        t = time.perf_counter()
        _run([PY, "-m", "autopar.cli", "calibrate", "--devices", "4", "--repeats", "3", "--out", profile])
        phases.append(("calibrate", time.perf_counter() - t))
        t = time.perf_counter()
        _run([PY, "benchmarks/sweep_cpu.py", "--profile", profile, "--json", str(RESULTS / "sweep_cpu.json"),
              "--md", str(RESULTS / "sweep_cpu.md")])
        phases.append(("sweep_cpu", time.perf_counter() - t))
        t = time.perf_counter()
        _run([PY, "benchmarks/measure_cpu.py", "--profile4", profile, "--profile8", profile,
              "--json", str(RESULTS / "measured_cpu.json"), "--md", str(RESULTS / "measured_cpu.md")])
        phases.append(("measure_cpu", time.perf_counter() - t))
        t = time.perf_counter()
        _run([PY, "benchmarks/measure_torchtitan.py", "--json", str(RESULTS / "torchtitan.json"),
              "--md", str(RESULTS / "torchtitan.md"), "--plot", str(RESULTS / "torchtitan.png"),
              "--profile-below", "0.95"])
        phases.append(("measure_torchtitan", time.perf_counter() - t))
        t = time.perf_counter()
        _run([PY, "benchmarks/measure_hf_moe.py", "--out", str(RESULTS / "hf_moe")])
        phases.append(("measure_hf_moe", time.perf_counter() - t))

    t = time.perf_counter()
    _run([PY, "benchmarks/fit/fit_cost_model.py", "--out", str(RESULTS / "fitted_constants.json")])
    committed_file = json.loads((ROOT / "cost_model" / "fitted_constants.json").read_text())
    committed = committed_file["constants"]
    refit = json.loads((RESULTS / "fitted_constants.json").read_text())["constants"]
    # the constants the one model fits (fit_one_model.py --commit) are not the baseline's to reproduce
    own = set(committed) - set(committed_file.get("one_model", {}).get("constants", ()))
    drift = {k: (committed[k], refit[k]) for k in sorted(own) if abs(committed[k] - refit[k]) > 1e-3 * abs(committed[k])}
    print("refit reproduces the committed constants" if not drift else f"WARNING: refit differs from the committed "
          f"constants: {drift} (commit results/fitted_constants.json's values with "
          "`benchmarks/fit/fit_cost_model.py`)", flush=True)
    _run([PY, "benchmarks/fit/fit_cost_model.py", "--loso", str(RESULTS / "loso_by_source.json")])
    _run([PY, "benchmarks/fit/fit_cost_model.py", "--loso", str(RESULTS / "loso_by_publication.json"),
          "--holdout", "publication"])
    phases.append(("fit + leave-one-out fits", time.perf_counter() - t))
    if args.full:  # ~50 min on 2 cores: the recorded sweeps priced at 7 + 5 + 8 + 7 values of the four constants
        t = time.perf_counter()
        _run([PY, "benchmarks/fit/fit_cpu_constants.py", "--json", str(RESULTS / "fit_cpu_constants.json"),
              "--md", str(RESULTS / "fit_cpu_constants.md")])
        fitted = json.loads((RESULTS / "fit_cpu_constants.json").read_text())["chosen"]
        shipped = json.loads((ROOT / "autopar" / "cpu_profile.json").read_text())["hardware"]["efficiency"]
        drift = {k: (shipped.get(k), v) for k, v in fitted.items() if shipped.get(k) != v}
        print("refit reproduces the built-in profile's sweep-fitted constants" if not drift else
              f"WARNING: refit differs from the built-in profile (built-in, refit): {drift} "
              "(store them with `benchmarks/fit/fit_cpu_constants.py --write`)", flush=True)
        phases.append(("fit_cpu_constants", time.perf_counter() - t))

    t = time.perf_counter()
    vs_cmd = [PY, "benchmarks/vs_hand_tuned.py"] + (
        [] if args.full else ["--limit", str(QUICK_GROUPS), "--out", str(RESULTS / "vs_hand_tuned_quick.md")])
    print(f"$ {' '.join(vs_cmd)}   (in the background)", flush=True)
    vs_out = RESULTS / ("vs_hand_tuned.md" if args.full else "vs_hand_tuned_quick.md")
    written_before = vs_out.stat().st_mtime if vs_out.exists() else 0.0
    vs = subprocess.Popen(vs_cmd, cwd=ROOT)
    _run([PY, "benchmarks/validate_cost_model.py", "--loso", str(RESULTS / "loso_by_source.json"),
          "--lopo", str(RESULTS / "loso_by_publication.json"), "--sweep", str(RESULTS / "sweep_cpu.json")])
    if args.full:
        _run([PY, "benchmarks/fit/fit_one_model.py"])
    _run([PY, "benchmarks/validate_one_model.py"])
    if args.full:
        _run([PY, "benchmarks/validate_moe.py"])
    vs.wait()  # exit 1 may mean a row below 1.0 (reported in its table): judge by the table written
    if not vs_out.exists() or vs_out.stat().st_mtime <= written_before:
        print(f"WARNING: vs_hand_tuned.py (exit {vs.returncode}) did not write {vs_out.name}; the table there "
              "(if any) is from an earlier run", flush=True)
    phases.append(("validate_cost_model + validate_one_model + vs_hand_tuned", time.perf_counter() - t))

    t = time.perf_counter()
    _run([PY, "benchmarks/op_coverage.py"])
    _run([PY, "benchmarks/gpu_report.py", *sorted(str(p) for p in RESULTS.glob("gpu_h100_run*.jsonl")),
          "--out", str(RESULTS / "gpu_h100.md")])
    if args.full:
        _run([PY, "benchmarks/check_search_plans.py", "--out", str(RESULTS / "search_plans_run")])
    phases.append(("op coverage + gpu report" + (" + searched plans run" if args.full else ""),
                   time.perf_counter() - t))

    t = time.perf_counter()
    _run([PY, "benchmarks/plots_results.py"])
    phases.append(("plots", time.perf_counter() - t))

    total = time.perf_counter() - start
    print("\nphases: " + ", ".join(f"{name} {s:.0f} s" for name, s in phases) + f"; total {total:.0f} s "
          f"({'within' if total <= BUDGET_S else 'OVER'} the {BUDGET_S // 60}-minute budget)")
    print("figures: " + ", ".join(sorted(p.name for p in RESULTS.glob("*.png"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
