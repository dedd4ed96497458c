"""Whole-plan search speed on large clusters (DESIGN.md: benchmarks print figures, not timed tests).

Targets: llama3-70b on h100:128x8 at global batch 1024 x seq 8192 in < 60 s; llama3-405b
on h100:2048x8 (global batch 2048 x seq 8192, Llama 3's 16M-token batch) in < 120 s.
Run: .venv/bin/python benchmarks/bench_search.py
"""

from __future__ import annotations

import sys

from autopar.commands.search import plan_search
from autopar.plan import describe_config

CASES = (
    ("llama3-70b", "h100:128x8", 1024, 8192, 60.0),
    ("llama3-405b", "h100:2048x8", 2048, 8192, 120.0),
)


def main() -> int:
    ok = True
    for model, cluster, batch, seq, target_s in CASES:
        result = plan_search(model, cluster, global_batch=batch, seq=seq)
        plan, s = result.plan, result.plan.search
        within = result.search_time_s < target_s
        ok &= within
        phases = ", ".join(f"{name} {sec:.2f} s" for name, sec in result.phases)
        print(f"{model} on {cluster}, global batch {batch} x seq {seq}: {result.search_time_s:.1f} s "
              f"(target < {target_s:.0f} s: {'ok' if within else 'MISSED'})")
        print(f"  phases: {phases}")
        print(f"  space: {s.num_candidates} candidates, {s.num_priced} priced, {s.num_pruned_memory} pruned by "
              f"memory bound, {s.num_pruned_dominated} dominated, {s.num_not_fitting} over memory")
        print(f"  best: {describe_config(plan.config, plan.stage_layers, batch)}: step {plan.predicted.step_time_s:.3f} s, "
              f"MFU {plan.predicted.mfu:.1%}, peak {plan.predicted.peak_memory_bytes / 2**30:.1f} GiB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
