"""`autopar search MODEL --cluster ... --global-batch B`: find the best whole plan.

Runs the one wiring of the search (`autopar.api.search_plans`: trace a few layers on fake
tensors at each microbatch the search asks for, fingerprint the full model, run
solver/pipeline_search.py; only plans the runtime executes are ranked,
autopar/capabilities.py), then prints a ranked table (or JSON) and writes the best plan.
Progress goes to stderr so `--json` stdout stays clean.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

from autopar.api import search_plans
from autopar.batch import throughput_unit
from autopar.cluster import Cluster
from autopar.plan import Plan
from autopar.units import GIB
from solver.results import ProgressFn


PLAIN_EVERY_S = 5.0
"""Plain progress (stderr not a terminal): a line per phase start and end, and at most one
per PLAIN_EVERY_S seconds between."""
PHASES = {"trace": "tracing (fake tensors)", "price": "pricing plans", "solve": "candidates solved"}


def _plain_progress() -> ProgressFn:
    last: dict[str, tuple[float, int]] = {}

    def update(phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        seen = last.get(phase)
        if seen is not None and done != total and now - seen[0] < PLAIN_EVERY_S:
            return
        if seen is not None and seen[1] == done:
            return
        last[phase] = (now, done)
        print(f"search: {PHASES.get(phase, phase)} {done}/{total}", file=sys.stderr, flush=True)

    return update


def _progress_display(enabled: bool) -> tuple[Callable[[], None], ProgressFn | None, Callable[[], None]]:
    if not enabled:
        return (lambda: None), None, (lambda: None)
    if not sys.stderr.isatty():  # a log or a pipe: plain lines as the work goes
        return (lambda: None), _plain_progress(), (lambda: None)
    from rich.console import Console  # lazy: rich, only to show progress
    from rich.progress import (  # lazy: rich, only to show progress
        BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn)

    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=True)
    tasks: dict[str, Any] = {}

    def update(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = bar.add_task(PHASES.get(phase, phase), total=total)
        bar.update(tasks[phase], completed=done, total=total)

    return bar.start, update, bar.stop


def _emit(plan: Plan, directory: str) -> None:
    """Write the plan's per-rank program (autopar/build/emit.py `emit_plan`); a pipeline's chunks
    are built by the per-rank build's stage builder (autopar/build/pipeline.py), which this
    wiring hands to codegen with the chunks' placements: the plan's, or, for a plan that
    records none, solved for it here on its cluster (autopar/placing.py)."""
    from autopar.build.pipeline import stage_sources  # lazy: the per-rank build, only with --emit
    from autopar.placing import program_placements  # lazy: the per-rank build, only with --emit
    from autopar.build.emit import emit_plan  # lazy: the per-rank build, only with --emit

    def sources(plan: Plan, model: Any, example: Any, mesh: Any) -> dict[str, str]:
        placed = program_placements(model, plan.config, example, plan=plan, cluster=Cluster.parse(plan.cluster))
        return stage_sources(placed, model, example, mesh)

    emit_plan(plan, directory, stage_sources=sources)


def run(args: argparse.Namespace) -> int:
    if args.max_pp is not None and args.max_pp < args.min_pp:
        raise ValueError(f"--max-pp {args.max_pp} is below --min-pp {args.min_pp}: no plan has that many stages; "
                         "give --max-pp >= --min-pp")
    start, progress, stop = _progress_display(sys.stderr.isatty() or not args.json)
    start()
    try:
        result = search_plans(args.model, args.cluster, global_batch=args.global_batch, seq=args.seq,
                              memory_gb=args.memory_gb, top=args.top, time_limit_s=args.time_limit, progress=progress,
                              min_pp=args.min_pp, max_pp=args.max_pp, precision=args.precision or "",
                              reduce_dtype=args.reduce_dtype or "", compiled=args.compile)
    finally:
        stop()
    plan = result.plan
    if args.out:
        plan.save(args.out)
    if args.emit:
        _emit(plan, args.emit)
    phases = {name: round(seconds, 4) for name, seconds in result.phases}
    if args.json:
        print(json.dumps({"plans": [r.to_json(args.global_batch) for r in result.ranked],
                          "search_time_s": round(result.search_time_s, 4), "phases": phases}, indent=2, sort_keys=True))
        return 0

    from rich.console import Console  # lazy: rich, only to print tables
    from rich.table import Table  # lazy: rich, only to print tables

    console = Console()
    s = plan.search
    console.print(f"[bold]{plan.model}[/] on {plan.cluster}, global batch {plan.global_batch} x seq {plan.seq}, "
                  f"{plan.memory_limit_bytes / GIB:.1f} GiB/device, precision {plan.config.policy().name}"
                  f"{', compiled by Inductor' if plan.config.compiled else ''}: "
                  f"{s.num_candidates} candidates, {s.num_priced} "
                  f"priced, {s.num_pruned_memory} pruned by memory bound, {s.num_pruned_dominated} dominated"
                  + ("" if s.complete else " [red](time limit hit: partial search)[/]"))
    table = Table(title=f"top {len(result.ranked)} plans (best first)")

    for col in ("#", "config", "step s", throughput_unit(plan.seq), "MFU", "peak GiB", "bubble"):
        table.add_column(col, justify="left" if col == "config" else "right")
    for i, r in enumerate(result.ranked, 1):
        e = r.estimate
        table.add_row(str(i), r.label(args.global_batch), f"{e.step_time_s:.4g}",
                      f"{e.tokens_per_s:,.0f}", f"{e.mfu:.1%}", f"{e.peak_memory_bytes / GIB:.2f}",
                      f"{r.bubble_fraction:.1%}")
    console.print(table)
    seq = f" --seq {args.seq}" if args.seq else ""
    console.print(f"price #1 alone: autopar price {plan.model} --cluster {plan.cluster} --global-batch "
                  f"{plan.global_batch}{seq} {' '.join(result.ranked[0].price_flags())}", soft_wrap=True)
    console.print("phases: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
                  + f"; total {result.search_time_s:.2f} s")
    console.print(f"plan file: {args.out}" if args.out else "plan file: not written (use --out plan.json)")
    return 0
