"""Time `autopar price`'s pricing step: llama3-70b on h100:128x8 (target: < 2 s after tracing).

Prints the trace time, the one-time profile time and the per-call pricing time of a few
configurations (the whole-plan search calls `price_profile` thousands of times).
Usage: .venv/bin/python benchmarks/bench_price.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `benchmarks.*`

from autopar.cluster import Cluster  # noqa: E402
from autopar.config import ParallelConfig  # noqa: E402
from autopar.models import resolve  # noqa: E402
from autopar.trace import trace_model  # noqa: E402
from benchmarks.baselines.analytic import price, price_profile, profile_graph  # noqa: E402


def main() -> None:
    cluster = Cluster.parse("h100:128x8")
    start = time.perf_counter()
    graph = trace_model(resolve("llama3-70b"), batch=1, dtype="bfloat16", layers_traced=2)
    print(f"trace (2 layers, scaled to 80): {time.perf_counter() - start:.2f} s, {len(graph)} nodes")
    config = ParallelConfig(tp=8, pp=8, dp=16, zero=1, micro_batch=1, recompute="selective")
    start = time.perf_counter()
    est = price(graph, config, cluster, global_batch=1024)
    print(f"price(graph, ...) incl. profiling: {time.perf_counter() - start:.4f} s "
          f"-> step {est.step_time_s:.3f} s, MFU {est.mfu:.1%}, peak {est.peak_memory_bytes / 2**30:.1f} GiB")
    start = time.perf_counter()
    profile = profile_graph(graph)
    print(f"profile_graph: {time.perf_counter() - start:.4f} s")
    configs = [config, ParallelConfig(tp=8, pp=4, dp=32, zero=1, schedule="interleaved", interleave=2),
               ParallelConfig(tp=4, pp=1, dp=256, zero=3, recompute="full"),
               ParallelConfig(tp=8, pp=16, dp=8, schedule="gpipe", micro_batch=2)]
    calls = 200
    start = time.perf_counter()
    for _ in range(calls):
        for cfg in configs:
            price_profile(profile, cfg, cluster, global_batch=1024)
    per_call = (time.perf_counter() - start) / (calls * len(configs))
    print(f"price_profile: {per_call * 1e3:.3f} ms per call (mean of {calls * len(configs)})")


if __name__ == "__main__":
    main()
