"""`autopar search MODEL --cluster ... --global-batch B`: find the best whole plan.

Wires the stages (as cli.py may): trace a few layers on fake tensors at each microbatch
the search asks for, fingerprint the full model, run solver/pipeline_search.py (one-stage
plans priced by the intra-op ILP, pipelines by the inter-op DP over ILP stage costs; only
plans the runtime executes are ranked, autopar/capabilities.py), then print a ranked
table (or JSON) and write the best plan. Progress goes to stderr so `--json` stdout stays clean.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
from dataclasses import replace
from typing import Any, Callable

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.plan import GIB, describe_config, fingerprint_source
from autopar.trace import trace_model
from solver.search import ProgressFn, SearchResult, SearchSpace, search

log = logging.getLogger(__name__)

LAYERS_TRACED = 2
"""Zoo models repeat one layer structure: two traced layers scale exactly to the depth."""


def plan_search(model: str, cluster_spec: str, *, global_batch: int, seq: int | None = None,
                memory_gb: float | None = None, top: int = 5, time_limit_s: float | None = None,
                space: SearchSpace = SearchSpace(), progress: ProgressFn | None = None,
                with_ilp: bool = True, microbatch_choices: int | None = None) -> SearchResult:
    """Trace, fingerprint and search; phases (seconds) cover the whole pipeline.

    One-stage candidates (mesh x microbatch) are traced at their microbatch and priced by
    the intra-op ILP: the plan's per-op placements are the program `autopar train --plan`
    runs. Pipelines (pp > 1) are priced by the inter-op DP over the ILP's stage costs and
    ranked only where the runtime runs them (solver/pipeline_search.py). Zoo presets and
    specs trace LAYERS_TRACED layers (a group of identical layers stands for all of
    them); factories trace whole."""
    from solver.pipeline_search import search as search_plans

    phases: list[tuple[str, float]] = []
    t0 = time.perf_counter()
    source = resolve(model).with_overrides(seq=seq)
    cluster = Cluster.parse(cluster_spec).with_memory_gb(memory_gb)
    dtype = "float32" if cluster.hardware.name == "cpu" else "bfloat16"
    if progress:
        progress("trace", 0, 1)
    if source.config is None:
        from autopar.trace import trace_step

        factory_model, example = source.factory()
        tensors = [t for t in example if hasattr(t, "shape") and len(t.shape)]
        batch = int(tensors[0].shape[0]) if tensors else 1
        if global_batch != batch:
            raise ValueError(f"factory {model!r} gives batches of {batch}; search it with --global-batch {batch}")

        def trace_at(rows: int) -> Any:
            import copy

            micro = [t[:rows] if hasattr(t, "shape") and len(t.shape) and t.shape[0] == batch else t for t in example]
            return trace_step(copy.deepcopy(factory_model), micro)[1]
        num_layers = None
    else:
        def trace_at(rows: int) -> Any:
            return trace_model(source, batch=rows, dtype=dtype, layers_traced=LAYERS_TRACED)
        num_layers = source.config.layers
    t = time.perf_counter()
    fingerprint = fingerprint_source(source)
    phases.append(("fingerprint", time.perf_counter() - t))
    extra = {} if microbatch_choices is None else {"microbatch_choices": microbatch_choices}
    family = source.family if source.config is not None else ""  # a factory runs as one stage today
    result = search_plans(trace_at, cluster, global_batch=global_batch, model=model, fingerprint=fingerprint,
                          family=family, top=top, time_limit_s=time_limit_s, progress=progress,
                          num_layers=num_layers, max_pp=space.max_pp, **extra)
    return SearchResult(ranked=result.ranked, plan=result.plan, phases=tuple(phases) + result.phases,
                        search_time_s=time.perf_counter() - t0, plans=result.plans)


def _progress_display(enabled: bool) -> tuple[Callable[[], None], ProgressFn | None, Callable[[], None]]:
    if not enabled:
        return (lambda: None), None, (lambda: None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=True)
    tasks: dict[str, Any] = {}

    def update(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = bar.add_task({"trace": "tracing (fake tensors)", "price": "pricing plans"}.get(phase, phase),
                                        total=total)
        bar.update(tasks[phase], completed=done, total=total)

    return bar.start, update, bar.stop


def _emit(plan: Any, directory: str) -> None:
    """Hook for the code generator (codegen/ owns `emit_plan(plan, directory)`)."""
    try:
        codegen = importlib.import_module("codegen")
    except ModuleNotFoundError:
        codegen = None
    emit = getattr(codegen, "emit_plan", None)
    if emit is None:
        raise ValueError("--emit needs the code generator (codegen.emit_plan), which this version does not have; "
                         "save the plan with --out and emit later")
    emit(plan, directory)


def run(args: argparse.Namespace) -> int:
    start, progress, stop = _progress_display(sys.stderr.isatty() or not args.json)
    start()
    try:
        result = plan_search(args.model, args.cluster, global_batch=args.global_batch, seq=args.seq,
                             memory_gb=args.memory_gb, top=args.top, time_limit_s=args.time_limit, progress=progress)
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

    from rich.console import Console
    from rich.table import Table

    console = Console()
    s = plan.search
    console.print(f"[bold]{plan.model}[/] on {plan.cluster}, global batch {plan.global_batch} x seq {plan.seq}, "
                  f"{plan.memory_limit_bytes / GIB:.1f} GiB/device: {s.num_candidates} candidates, {s.num_priced} "
                  f"priced, {s.num_pruned_memory} pruned by memory bound, {s.num_pruned_dominated} dominated"
                  + ("" if s.complete else " [red](time limit hit: partial search)[/]"))
    table = Table(title=f"top {len(result.ranked)} plans (best first)")
    for col in ("#", "config", "step s", "tokens/s", "MFU", "peak GiB", "bubble"):
        table.add_column(col, justify="left" if col == "config" else "right")
    for i, r in enumerate(result.ranked, 1):
        e = r.estimate
        table.add_row(str(i), describe_config(r.config, r.stage_layers, args.global_batch), f"{e.step_time_s:.4g}",
                      f"{e.tokens_per_s:,.0f}", f"{e.mfu:.1%}", f"{e.peak_memory_bytes / GIB:.2f}",
                      f"{r.bubble_fraction:.1%}")
    console.print(table)
    console.print("phases: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
                  + f"; total {result.search_time_s:.2f} s")
    console.print(f"plan file: {args.out}" if args.out else "plan file: not written (use --out plan.json)")
    return 0
