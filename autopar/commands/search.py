"""`autopar search MODEL --cluster ... --global-batch B`: find the best whole plan.

Wires the stages (as cli.py may): trace a few layers on fake tensors, fingerprint the
full model, profile the graph for the cost model once, run solver/search.py with
`cost_model.price_profile` as the pricing callable, solve the intra-op ILP for the
chosen plan's layer groups (recorded beside the priced template), then print a ranked
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
from codegen.rules import rules_for
from solver.intra_ilp import ilp_intra_op
from solver.search import ProgressFn, SearchResult, SearchSpace, search

log = logging.getLogger(__name__)

LAYERS_TRACED = 2
"""Zoo models repeat one layer structure: two traced layers scale exactly to the depth."""


def plan_search(model: str, cluster_spec: str, *, global_batch: int, seq: int | None = None,
                memory_gb: float | None = None, top: int = 5, time_limit_s: float | None = None,
                space: SearchSpace = SearchSpace(), progress: ProgressFn | None = None,
                with_ilp: bool = True) -> SearchResult:
    """Trace, fingerprint, profile and search; phases (seconds) cover the whole pipeline.

    With `with_ilp`, the intra-op ILP is solved for the chosen plan's layer groups and
    recorded in the plan beside the template (solver/intra_ilp.py)."""
    import cost_model

    phases: list[tuple[str, float]] = []
    t0 = time.perf_counter()
    source = resolve(model).with_overrides(seq=seq)
    cluster = Cluster.parse(cluster_spec).with_memory_gb(memory_gb)
    if source.factory is not None and rules_for(source.factory()[0]) is None:
        # as autopar.api.search_plan: the runtime splits only models of known structure by
        # tensor or pipeline, and a plan it cannot execute is never ranked
        space = replace(space, max_tp=1, max_pp=1)
    if progress:
        progress("trace", 0, 1)
    graph = trace_model(source, batch=1, dtype="bfloat16", layers_traced=LAYERS_TRACED)
    phases.append(("trace", time.perf_counter() - t0))
    t = time.perf_counter()
    fingerprint = fingerprint_source(source)
    phases.append(("fingerprint", time.perf_counter() - t))
    t = time.perf_counter()
    profile = cost_model.profile_graph(graph)
    phases.append(("profile", time.perf_counter() - t))

    def price(config: ParallelConfig, stage_layers: tuple[int, ...]) -> Any:
        return cost_model.price_profile(profile, config, cluster, global_batch=global_batch, stage_layers=stage_layers)

    ilp_cache: dict[Any, Any] = {}

    def intra_op(config: ParallelConfig) -> tuple[Any, ...]:
        try:
            return ilp_intra_op(graph, cluster, config, cache=ilp_cache, time_limit_s=time_limit_s or 60.0)
        except ValueError as exc:  # the template stays the plan's intra-op choice
            log.warning("intra-op ILP skipped: %s", exc)
            return ()

    result = search(graph, cluster, global_batch=global_batch, price=price, model=model, fingerprint=fingerprint,
                    cost_model_name="cost_model.price_profile", space=space, top=top, time_limit_s=time_limit_s,
                    progress=progress, intra_op_fn=intra_op if with_ilp else None)
    return SearchResult(ranked=result.ranked, plan=result.plan, phases=tuple(phases) + result.phases,
                        search_time_s=time.perf_counter() - t0)


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
