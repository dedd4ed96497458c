"""`autopar explain plan.json`: what the plan chose per stage and layer group, and why.

Reads the plan file only (no tracing, no re-solving): a plan is explainable from itself.
"""

from __future__ import annotations

import argparse
import json

from autopar.plan import GIB, Plan


def _plot(plan: Plan, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [s.index for s in plan.stages]
    fig, (ax_work, ax_mem) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax_work.bar(stages, [s.flops_per_microbatch / 1e12 for s in plan.stages])
    ax_work.set(xlabel="pipeline stage", ylabel="TFLOP per microbatch", title="work per stage")
    ax_mem.bar(stages, [s.memory_bytes / GIB for s in plan.stages], label="model state")
    ax_mem.axhline(plan.memory_limit_bytes / GIB, color="red", linestyle="--", label="budget")
    ax_mem.axhline(plan.predicted.peak_memory_bytes / GIB, color="black", linestyle=":", label="predicted peak")
    ax_mem.set(xlabel="pipeline stage", ylabel="GiB per device", title="memory per device")
    ax_mem.legend()
    fig.suptitle(f"{plan.model} on {plan.cluster}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    if args.plot:
        _plot(plan, args.plot)
    if args.json:
        print(json.dumps({"plan": plan.to_json(), "explanation": plan.explain().splitlines()}, indent=2,
                         sort_keys=True))
    else:
        print(plan.explain())
    return 0
