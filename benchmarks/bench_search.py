"""Whole-plan search speed on large clusters (DESIGN.md: benchmarks print figures, not timed tests).

The search in the loop is the product's: one-stage plans priced by the intra-op ILP and
pipelines by the inter-op DP over ILP stage costs (solver/pipeline_search.py), only
plans the runtime runs ranked. Targets: llama3-70b on h100:128x8 (1,024
H100s) at global batch 1024 x seq 8192 in < 30 s; llama3-405b on h100:2048x8 (16,384
H100s, global batch 2048 x seq 8192, Llama 3's 16M-token batch) in < 60 s, on this
2-core machine; and two small recurrent models (benchmarks/lib/small_models.py, an LSTM and a
GRU of 64 unrolled steps, no layer stack) on cpu:4 in < 15 s each. The plan and its
predicted step time are printed. The search is
single-threaded (HiGHS with one thread), so its CPU seconds are also printed: on a shared
machine they are what the wall time would be without the other processes.
Run: .venv/bin/python benchmarks/bench_search.py [--only 70b|405b|small]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.lib.small_models, run from anywhere

from autopar.api import search_plans  # noqa: E402
from autopar.explain import describe_config  # noqa: E402

CASES = (
    ("llama3-70b", "h100:128x8", 1024, 8192, 30.0),
    ("llama3-405b", "h100:2048x8", 2048, 8192, 60.0),
    # small models on the cpu profile: recurrent layers traced unrolled (64 steps), no layer stack
    ("benchmarks.lib.small_models:lstm", "cpu:4", 8, None, 15.0),
    ("benchmarks.lib.small_models:gru", "cpu:4", 8, None, 15.0),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("70b", "405b", "small"), default=None)
    args = parser.parse_args(argv)
    ok = True
    for model, cluster, batch, seq, target_s in CASES:
        if args.only and not (model.endswith(args.only) or (args.only == "small" and ":" in model)):
            continue
        cpu0 = time.process_time()
        result = search_plans(model, cluster, global_batch=batch, seq=seq)
        cpu_s = time.process_time() - cpu0
        plan, s = result.plan, result.plan.search
        within = result.search_time_s < target_s
        ok &= within
        phases = ", ".join(f"{name} {sec:.2f} s" for name, sec in result.phases)
        print(f"{model} on {cluster}, global batch {batch} x seq {seq or plan.seq}: {result.search_time_s:.1f} s wall, "
              f"{cpu_s:.1f} s CPU (target < {target_s:.0f} s: {'ok' if within else 'MISSED'}; load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
        print(f"  phases: {phases}")
        print(f"  space: {s.num_candidates} candidates, {s.num_priced} solved, {s.num_pruned_dominated} pruned by "
              f"a bound or by dominance, {s.num_not_fitting} without a fitting plan")
        print(f"  best: {describe_config(plan.config, plan.stage_layers, batch)}: predicted step "
              f"{plan.predicted.step_time_s:.3f} s, MFU {plan.predicted.mfu:.1%}, peak "
              f"{plan.predicted.peak_memory_bytes / 2**30:.1f} GiB")
        if plan.pipeline is not None and len(plan.pipeline.stages) > 1:
            for st in plan.pipeline.stages:
                print(f"    stage {st.index}: layers {st.first_layer}-{st.first_layer + st.num_layers - 1} on (dp, tp) "
                      f"{st.submesh}, recompute {st.recompute}, zero {st.zero}, "
                      f"{st.time_per_microbatch_s * 1e3:.1f} ms/microbatch, {st.memory_bytes / 2**30:.1f} GiB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
