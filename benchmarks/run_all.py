"""Regenerate every benchmark table and figure (in about 30 minutes here with torchtitan).

    .venv/bin/python benchmarks/run_all.py [--full] [--skip-measure]

Phases, each printing its figures as it goes (wall time per phase at the end):
1. `autopar calibrate --devices 4` and `--devices 8` -> results/cpu_profile_{4,8}.json
2. benchmarks/measure_cpu.py (autopar vs hand-tuned, measured; calibrated predictions,
   Spearman) -> results/measured_cpu.{md,json}
3. benchmarks/measure_torchtitan.py (autopar vs torchtitan 0.3.0 itself, measured) ->
   results/torchtitan.{md,json,png}; with no `make bench-install` it prints one line
   saying it was skipped and the phase ends
4. benchmarks/validate_cost_model.py (94 published runs) -> results/cost_model_validation.md
   and, at the same time (single-process, after the measured part so it does not disturb
   it), benchmarks/vs_hand_tuned.py: the first QUICK_GROUPS groups (smallest clusters)
   -> results/vs_hand_tuned_quick.md, or with --full every group -> results/vs_hand_tuned.md
   (the full run takes ~19 minutes alone on this machine)
5. benchmarks/plots_results.py -> results/*.png
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PY = sys.executable
QUICK_GROUPS = 40
BUDGET_S = 35 * 60


def _run(cmd: list[str]) -> None:
    print(f"$ {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the complete vs_hand_tuned table (~19 min more)")
    ap.add_argument("--skip-measure", action="store_true", help="reuse results/measured_cpu.json and the profiles")
    args = ap.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    phases: list[tuple[str, float]] = []
    start = time.perf_counter()

    if not args.skip_measure:
        t = time.perf_counter()
        for n in (4, 8):
            _run([PY, "-m", "autopar.cli", "calibrate", "--devices", str(n), "--out",
                  str(RESULTS / f"cpu_profile_{n}.json")])
        phases.append(("calibrate 4 and 8", time.perf_counter() - t))
        t = time.perf_counter()
        _run([PY, "benchmarks/measure_cpu.py", "--profile4", str(RESULTS / "cpu_profile_4.json"),
              "--profile8", str(RESULTS / "cpu_profile_8.json"), "--json", str(RESULTS / "measured_cpu.json"),
              "--md", str(RESULTS / "measured_cpu.md")])
        phases.append(("measure_cpu", time.perf_counter() - t))
        t = time.perf_counter()
        _run([PY, "benchmarks/measure_torchtitan.py", "--json", str(RESULTS / "torchtitan.json"),
              "--md", str(RESULTS / "torchtitan.md"), "--plot", str(RESULTS / "torchtitan.png"),
              "--profile-below", "0.95"])
        phases.append(("measure_torchtitan", time.perf_counter() - t))

    t = time.perf_counter()
    vs_cmd = [PY, "benchmarks/vs_hand_tuned.py"] + (
        [] if args.full else ["--limit", str(QUICK_GROUPS), "--out", str(RESULTS / "vs_hand_tuned_quick.md")])
    print(f"$ {' '.join(vs_cmd)}   (in the background)", flush=True)
    vs_out = RESULTS / ("vs_hand_tuned.md" if args.full else "vs_hand_tuned_quick.md")
    written_before = vs_out.stat().st_mtime if vs_out.exists() else 0.0
    vs = subprocess.Popen(vs_cmd, cwd=ROOT)
    _run([PY, "benchmarks/validate_cost_model.py"])
    vs.wait()  # exit 1 may mean a row below 1.0 (reported in its table): judge by the table written
    if not vs_out.exists() or vs_out.stat().st_mtime <= written_before:
        print(f"WARNING: vs_hand_tuned.py (exit {vs.returncode}) did not write {vs_out.name}; the table there "
              "(if any) is from an earlier run", flush=True)
    phases.append(("validate_cost_model + vs_hand_tuned", time.perf_counter() - t))

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
