"""`autopar price MODEL --cluster ... --global-batch B [config flags]`, or
`autopar price --plan plan.json`: the step time and memory of one configuration.

The price is the search's own (solver/search_config.py `Fixed`): the model is traced as
the search traces it (float32 on the cpu profile, else bfloat16), the intra-op ILP places
every op under the configuration's rules (solver/forced.py) and, for pp > 1, the stage DP
cuts the layers and prices the schedule. So a configuration priced here and the same
configuration ranked by `autopar search` are one number, and `--plan` reprices a saved
plan's configuration with its cuts.

What the flags leave open stays the search's choice: per-op placements always; each
parameter's ZeRO layout unless `--zero` is given; the stage cuts unless a plan gives them.
Defaults (DESIGN.md): tp = pp = 1, dp = devices / (tp * pp), micro-batch 1, 1f1b when
pp > 1, recompute none. A configuration that does not fit is still priced (its ILP solved
without the memory limit) and flagged. `--hardware profile.json` prices against a
calibrated or custom hardware profile.

There is one model: the closed-form formula that preceded it is a baseline under
benchmarks/baselines/analytic/ (what the published-run reports print beside it), not a command.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

from autopar.api import price_result
from autopar.cluster import GIB, Cluster, load_hardware
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.plan import Plan


def config_from_args(args: argparse.Namespace, num_devices: int) -> ParallelConfig:
    tp = args.tp or 1
    pp = args.pp or 1
    if args.dp is None:
        if num_devices % (tp * pp):
            raise ValueError(
                f"tp * pp = {tp} * {pp} = {tp * pp} does not divide the cluster's {num_devices} devices; "
                f"pick --tp/--pp whose product divides {num_devices}, or give --dp"
            )
        dp = num_devices // (tp * pp)
    else:
        dp = args.dp
    interleave = args.interleave or 1
    schedule = args.schedule or ("interleaved" if interleave > 1 else "1f1b")
    return ParallelConfig(tp=tp, pp=pp, dp=dp, zero=args.zero or 0, ep=args.ep or 1, micro_batch=args.micro_batch or 1,
                          schedule=schedule, interleave=interleave, recompute=args.recompute or "none",
                          attention=args.attention or "flash", precision=args.precision or "",
                          reduce_dtype=args.reduce_dtype or "", compiled=args.compile)


def _cluster(args: argparse.Namespace, spec: str) -> Cluster:
    hardware = load_hardware(args.hardware) if getattr(args, "hardware", None) else None
    return Cluster.parse(spec, hardware=hardware).with_memory_gb(args.memory_gb)


def _collectives(plan: Plan) -> list[tuple[str, str, int, int]]:
    """Collectives per step by (kind, axis): count and bytes (a pipeline's: per microbatch
    of each stage, times the microbatches; stage gradient syncs are counted once)."""
    if plan.config.pp == 1:
        info = plan.intra_op_info
        return [tuple(c) for c in info.collectives] if info is not None else []
    calls: Counter = Counter()
    volume: Counter = Counter()
    for stage in plan.stages:
        for kind, axis, count, size in stage.collectives:
            calls[(f"stage {stage.index} {kind}", axis)] += count
            volume[(f"stage {stage.index} {kind}", axis)] += size
    return [(k, a, calls[(k, a)], volume[(k, a)]) for k, a in sorted(calls)]


def run(args: argparse.Namespace) -> int:
    plan_file = getattr(args, "plan", None)
    if plan_file:
        given = [f for f in ("model", "cluster", "global_batch", "tp", "pp", "dp", "zero", "micro_batch", "schedule",
                             "interleave", "recompute", "precision", "reduce_dtype")
                 if getattr(args, f, None) is not None] + (["compile"] if args.compile else [])
        if given:
            raise ValueError(f"--plan prices the saved plan's model, cluster and configuration; drop "
                             f"{', '.join('--' + f.replace('_', '-') if f != 'model' else 'MODEL' for f in given)}")
        saved = Plan.load(plan_file)
        cluster = _cluster(args, saved.cluster)
        zoo = resolve(saved.model).config is not None  # a factory's batch fixes its sequence length
        result = price_result(saved.model, cluster, global_batch=saved.global_batch, config=saved.config,
                              seq=saved.seq if zoo else None, choose_zero=True,
                              stage_layers=tuple(saved.stage_layers) if saved.config.pp > 1 else None)
        now = result.plan.model_fingerprint
        if saved.model_fingerprint and now != saved.model_fingerprint:
            raise ValueError(f"{plan_file} was searched for another version of {saved.model!r} (fingerprint "
                             f"{saved.model_fingerprint[:12]}, now {now[:12]}); search it again")
        return _report(args, result, cluster, saved)
    if args.model is None or args.cluster is None or args.global_batch is None:
        raise ValueError("price needs MODEL, --cluster and --global-batch (or --plan PLAN_JSON)")
    cluster = _cluster(args, args.cluster)
    config = config_from_args(args, cluster.num_devices)
    source = resolve(args.model).with_overrides(seq=args.seq)
    if source.config is not None:  # fail on bad degrees before spending time on the trace
        cfg = source.config
        config.check(global_batch=args.global_batch, num_devices=cluster.num_devices, heads=cfg.heads,
                     kv_heads=getattr(cfg, "num_kv_heads", cfg.heads), num_layers=cfg.layers)
    if config.attention != "flash":
        raise ValueError(f"--attention {config.attention}: autopar traces and runs the model's fused attention "
                         "(scaled_dot_product_attention), so that is what it prices; drop --attention")
    result = price_result(args.model, cluster, global_batch=args.global_batch, config=config, seq=args.seq,
                          choose_zero=args.zero is None)
    return _report(args, result, cluster, None)


def _communication_json(est: Any, communication: tuple) -> list[dict[str, Any]]:
    """`communication` rows as objects, each with its share of the step."""
    return [dict(row.to_json(), share=row.time_s / est.step_time_s if est.step_time_s else 0.0)
            for row in communication]


def _report(args: argparse.Namespace, result: Any, cluster: Cluster, saved: Plan | None) -> int:
    plan = result.plan
    est = plan.predicted
    communication = tuple(r for r in result.communication if r.count or r.time_s)
    if args.json:
        out = est.to_json()
        out["stage_layers"] = list(plan.stage_layers)
        out["collectives"] = [list(c) for c in _collectives(plan)]
        out["communication"] = _communication_json(est, communication)
        if saved is not None:
            out["plan_step_time_s"] = saved.predicted.step_time_s
            out["plan_peak_memory_bytes"] = saved.predicted.peak_memory_bytes
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    _print(f"{plan.model} on {cluster.spec}", est, cluster, _collectives(plan), plan, communication)
    if saved is not None:
        print(f"the plan file predicted {saved.predicted.step_time_s:.4g} s and "
              f"{saved.predicted.peak_memory_bytes / GIB:.3g} GiB")
    return 0


def _print(title: str, est: Any, cluster: Cluster, collectives: list, plan: Plan, communication: tuple = ()) -> None:
    from rich.console import Console  # lazy: rich, only to print tables
    from rich.table import Table  # lazy: rich, only to print tables

    console = Console()
    c = dict(est.config)
    console.print(f"[bold]{title}[/]: tp={c['tp']} pp={c['pp']} dp={c['dp']} "
                  f"zero={c['zero']} micro-batch={c['micro_batch']} x {c['num_microbatches']} microbatches, "
                  f"schedule={c['schedule']} interleave={c['interleave']} recompute={c['recompute']}"
                  + (f", stages of {'/'.join(map(str, plan.stage_layers))} layers"
                     if len(plan.stage_layers) > 1 else ""))
    console.print(f"step {est.step_time_s:.4g} s | {est.tokens_per_s:,.0f} tokens/s "
                  f"({est.tokens_per_s_per_device:,.1f} per device) | "
                  f"{est.model_tflops_per_device:.1f} model TFLOP/s per device | MFU {est.mfu:.1%}")
    fit = "[green]fits[/]" if est.fits else f"[red]does NOT fit: {est.over_memory_bytes / GIB:.2f} GiB over[/]"
    console.print(f"peak memory {est.peak_memory_bytes / GIB:.3g} GiB of {est.memory_limit_bytes / GIB:.3g} GiB "
                  f"(stage {est.peak_stage}): {fit}")
    times = Table(title="time per step")
    times.add_column("component")
    times.add_column("seconds", justify="right")
    times.add_column("share", justify="right")
    for name, value in est.time_breakdown:
        times.add_row(name.removesuffix("_s"), f"{value:.4g}", f"{value / est.step_time_s:.1%}")
    console.print(times)
    if plan.config.pp > 1:
        stages = Table(title="stages")
        for col in ("stage", "layers", "dp x tp", "zero", "recompute", "s / microbatch", "GiB"):
            stages.add_column(col, justify="right")
        for s in plan.stages:
            stages.add_row(str(s.index), str(s.num_layers), f"{s.submesh[0]} x {s.submesh[1]}", str(s.zero),
                           s.recompute, f"{s.time_per_microbatch_s:.4g}", f"{s.memory_bytes / GIB:.3g}")
        console.print(stages)
    if collectives and plan.config.pp > 1:
        table = Table(title="collectives per microbatch")
        for col in ("kind", "axis", "count", "MiB"):
            table.add_column(col, justify="right")
        for kind, axis, count, size in collectives:
            table.add_row(kind, axis, str(count), f"{size / 2**20:,.1f}")
        console.print(table)
    _print_communication(est, communication, plan)
    mem = Table(title=f"memory on the peak device (stage {est.peak_stage})")
    mem.add_column("component")
    mem.add_column("GiB", justify="right")
    for name, value in est.memory_breakdown:
        mem.add_row(name.removesuffix("_bytes"), f"{value / GIB:.3g}")
    console.print(mem)


def _print_communication(est: Any, communication: tuple, plan: Plan) -> None:
    """The communication `time_breakdown` charges, by collective kind and mesh axis
    (solver/comm_time.py): for one stage, the `reshard` row's parts; for a pipeline, the
    critical stage's share of `critical_stage` and the `p2p` row. The seconds of each row
    of the time table add up (the total line)."""
    from rich.console import Console  # lazy: rich, only to print tables
    from rich.table import Table  # lazy: rich, only to print tables

    if not communication:
        return
    one_stage = plan.config.pp == 1
    table = Table(title="collectives per step" if one_stage else "communication per step on the critical stage")
    for col in ("kind", "axis", "count", "MiB", "seconds", "share", "in"):
        table.add_column(col, justify="right")
    for row in communication:
        counted = row.kind not in ("local_copy", "overlapped")
        table.add_row(row.kind, row.axis, f"{row.count:,.0f}" if counted else "",
                      f"{row.bytes / 2**20:,.1f}" if counted else "", f"{row.time_s:.4g}",
                      f"{row.time_s / est.step_time_s:.1%}" if est.step_time_s else "",
                      row.part_of.removesuffix("_s"))
    rows = dict(est.time_breakdown)
    for part in dict.fromkeys(r.part_of for r in communication):
        total = sum(r.time_s for r in communication if r.part_of == part)
        table.add_row("total", "", "", "", f"{total:.4g}", f"{total / est.step_time_s:.1%}" if est.step_time_s else "",
                      f"{part.removesuffix('_s')} ({rows.get(part, 0.0):.4g} s)")
    Console().print(table)
