"""Whole-plan search speed on large clusters (DESIGN.md: benchmarks print figures, not timed tests).

The search in the loop is the product's: one-stage plans priced by the intra-op ILP and
pipelines by the inter-op DP over ILP stage costs (solver/pipeline_search.py), only
plans the runtime runs ranked. Targets: llama3-70b on h100:128x8 (1,024
H100s) at global batch 1024 x seq 8192 in < 30 s; llama3-405b on h100:2048x8 (16,384
H100s, global batch 2048 x seq 8192, Llama 3's 16M-token batch) in < 60 s, on this
2-core machine; deepseek-v3-like (autopar/models/moe.py: 256 routed experts, top 8) on
h100:256x8 (2,048 H100s, DeepSeek-V3's cluster size) at global batch 4096 x seq 4096 in
< 60 s, with whether its plan shards the expert weights on their expert dim; and two small recurrent models (benchmarks/lib/small_models.py, an LSTM and a
GRU of 64 unrolled steps, no layer stack) on cpu:4 in < 15 s each. The plan and its
predicted step time are printed. The search is
single-threaded (HiGHS with one thread), so its CPU seconds are also printed: on a shared
machine they are what the wall time would be without the other processes.
Run: .venv/bin/python benchmarks/bench_search.py [--only 70b|405b|moe|small]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autopar.plan import Plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.lib.small_models, run from anywhere

from autopar.api import search_plans  # noqa: E402
from autopar.placement import Shard, parse_placements  # noqa: E402
from autopar.explain import describe_config  # noqa: E402

CASES = (
    ("llama3-70b", "h100:128x8", 1024, 8192, 30.0),
    ("llama3-405b", "h100:2048x8", 2048, 8192, 60.0),
    # mixture of experts (GShard dispatch: expert parallelism is a placement the ILP chooses)
    ("deepseek-v3-like", "h100:256x8", 4096, 4096, 60.0),
    # small models on the cpu profile: recurrent layers traced unrolled (64 steps), no layer stack
    ("benchmarks.lib.small_models:lstm", "cpu:4", 8, None, 15.0),
    ("benchmarks.lib.small_models:gru", "cpu:4", 8, None, 15.0),
)


EXPERT_WEIGHTS = re.compile(r"\.moe\.w[123]$")
"""The routed experts' stacked weights [E, d, f] / [E, f, d] (autopar/models/moe.py)."""


def expert_placements(plan: Plan) -> str:
    """How a MoE plan places its routed experts' weights, from the plan file alone: per
    stage (a pipeline) or per op (one stage), each distinct compute placement of the expert
    weights over the (dp, tp) axes, and whether some axis shards their expert dim (S(0):
    expert parallelism). Empty for a model without them."""
    if any(st.placements for st in plan.stages):
        found = {text.split(" update")[0] for st in plan.stages for name, text in st.placements
                 if EXPERT_WEIGHTS.search(name)}
    else:
        found = {op.outputs[0] for op in plan.chunk_placements(0) if op.op == "placeholder"
                 and EXPERT_WEIGHTS.search(op.key)}
    if not found:
        return ""
    axes = sorted({axis for text in found for axis, p in zip(("dp", "tp"), parse_placements(text)) if p == Shard(0)})
    return (f"expert weights {', '.join(sorted(found))} on (dp, tp): expert dim "
            + (f"sharded over {' and '.join(axes)}" if axes else "not sharded"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("70b", "405b", "moe", "small"), default=None)
    args = parser.parse_args(argv)
    ok = True
    for model, cluster, batch, seq, target_s in CASES:
        if args.only and not (model.endswith(args.only) or (args.only == "small" and ":" in model)
                              or (args.only == "moe" and model.startswith("deepseek"))):
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
        experts = expert_placements(plan)
        if experts:
            print(f"  {experts}")
        if plan.pipeline is not None and len(plan.stages) > 1:
            for st in plan.stages:
                print(f"    stage {st.index}: layers {st.first_layer}-{st.first_layer + st.num_layers - 1} on (dp, tp) "
                      f"{st.submesh}, recompute {st.recompute}, zero {st.zero}, "
                      f"{st.time_per_microbatch_s * 1e3:.1f} ms/microbatch, {st.memory_bytes / 2**30:.1f} GiB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
