"""Trace time and peak memory of the full joint graph of large presets.

Each model is traced in its own process (`autopar trace MODEL --json`) so peak RSS is per
model. Usage: python benchmarks/bench_trace.py [--models llama3-8b,llama3-70b] [--seq 8192]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def measure(model: str, seq: int, batch: int) -> dict:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "autopar.cli", "trace", model, "--seq", str(seq),
         "--global-batch", str(batch), "--json"],
        capture_output=True, text=True, check=True,
    )
    wall_s = time.perf_counter() - start
    peak_rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    data = json.loads(proc.stdout)
    return {"model": model, "wall_s": wall_s, "trace_time_s": data["trace_time_s"],
            "peak_rss_gib": peak_rss_gib, "num_nodes": data["num_nodes"],
            "params_b": data["num_parameters"] / 1e9, "tflops_per_step": data["flops_per_step"] / 1e12}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="llama3-8b,llama3-70b,llama3-405b")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, default=1)
    args = parser.parse_args()
    print(f"{'model':<14}{'params(B)':>10}{'nodes':>8}{'TFLOP/step':>12}{'trace s':>9}{'wall s':>8}{'peak RSS GiB':>14}")
    for model in args.models.split(","):
        r = measure(model, args.seq, args.global_batch)
        # ru_maxrss of children is the max over all children so far: models run in
        # increasing size, so each row is that model's peak
        print(f"{r['model']:<14}{r['params_b']:>10.2f}{r['num_nodes']:>8}{r['tflops_per_step']:>12.1f}"
              f"{r['trace_time_s']:>9.2f}{r['wall_s']:>8.2f}{r['peak_rss_gib']:>14.2f}", flush=True)


if __name__ == "__main__":
    main()
