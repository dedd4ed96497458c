"""`autopar explain plan.json`: what the plan chose per stage and layer group, and why.

Reads the plan file only (no tracing, no re-solving): a plan is explainable from itself.
"""

from __future__ import annotations

import argparse
import json

from autopar.plan import Plan


def run(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    if args.plot:  # pipeline timeline + peak-device memory breakdown (autopar/plots.py)
        from autopar.plots import plot_plan

        plot_plan(plan, args.plot)
    if args.json:
        print(json.dumps({"plan": plan.to_json(), "explanation": plan.explain().splitlines()}, indent=2,
                         sort_keys=True))
    else:
        print(plan.explain())
    return 0
