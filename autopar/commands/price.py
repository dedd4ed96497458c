"""`autopar price MODEL --cluster ... --global-batch B [config flags]`: price one config.

Traces 2 layers on fake tensors (the layer group is scaled to the real depth), then
prices the configuration with cost_model. Defaults (DESIGN.md): tp = pp = 1,
dp = devices / (tp * pp), zero 0, micro-batch 1, 1f1b when pp > 1, recompute none,
attention flash. A config that does not fit is still priced and flagged. `--runtime KEY=VALUE`
describes the training stack beyond the configuration (cost_model/options.py), and
`--hardware profile.json` prices against a calibrated or custom hardware profile.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from autopar.cluster import GIB, Cluster, load_hardware
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.trace import trace_model

TRACED_LAYERS = 2


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
    return ParallelConfig(tp=tp, pp=pp, dp=dp, zero=args.zero or 0, micro_batch=args.micro_batch or 1,
                          schedule=schedule, interleave=interleave, recompute=args.recompute or "none",
                          attention=args.attention or "flash")


def runtime_from_args(pairs: list[str]) -> Any:
    """`--runtime KEY=VALUE` pairs -> cost_model.RuntimeOptions (ValueError names bad keys)."""
    from cost_model import RuntimeOptions

    values = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--runtime expects KEY=VALUE (e.g. --runtime grad_reduce_bytes=4), got {pair!r}")
        values[key.strip()] = value.strip()
    return RuntimeOptions.from_pairs(values)


def run(args: argparse.Namespace) -> int:
    from cost_model import price

    hardware = load_hardware(args.hardware) if getattr(args, "hardware", None) else None
    cluster = Cluster.parse(args.cluster, hardware=hardware).with_memory_gb(args.memory_gb)
    config = config_from_args(args, cluster.num_devices)
    if getattr(args, "no_sequence_parallel", False):
        config = dataclasses.replace(config, sequence_parallel=False)
    options = runtime_from_args(getattr(args, "runtime", []) or [])
    source = resolve(args.model).with_overrides(seq=args.seq)
    if source.config is not None:  # fail on bad degrees before spending time on the trace
        cfg = source.config
        config.check(global_batch=args.global_batch, num_devices=cluster.num_devices, heads=cfg.heads,
                     kv_heads=getattr(cfg, "num_kv_heads", cfg.heads), num_layers=cfg.layers)
    graph = trace_model(source, batch=1, dtype="bfloat16", layers_traced=TRACED_LAYERS)
    est = price(graph, config, cluster, global_batch=args.global_batch, options=options)
    if args.json:
        print(json.dumps(est.to_json(), indent=2, sort_keys=True))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    c = dict(est.config)
    console.print(f"[bold]{graph.model.name}[/] on {cluster.spec}: tp={c['tp']} pp={c['pp']} dp={c['dp']} "
                  f"zero={c['zero']} micro-batch={c['micro_batch']} x {c['num_microbatches']} microbatches, "
                  f"schedule={c['schedule']} interleave={c['interleave']} recompute={c['recompute']} "
                  f"attention={c['attention']}")
    console.print(f"step {est.step_time_s:.3f} s | {est.tokens_per_s:,.0f} tokens/s "
                  f"({est.tokens_per_s_per_device:,.1f} per device) | "
                  f"{est.model_tflops_per_device:.1f} model TFLOP/s per device | MFU {est.mfu:.1%}")
    fit = "[green]fits[/]" if est.fits else f"[red]does NOT fit: {est.over_memory_bytes / GIB:.2f} GiB over[/]"
    console.print(f"peak memory {est.peak_memory_bytes / GIB:.2f} GiB of {est.memory_limit_bytes / GIB:.2f} GiB "
                  f"(stage {est.peak_stage}): {fit}")
    times = Table(title="time per step")
    times.add_column("component")
    times.add_column("seconds", justify="right")
    times.add_column("share", justify="right")
    for name, value in est.time_breakdown:
        times.add_row(name.removesuffix("_s"), f"{value:.4f}", f"{value / est.step_time_s:.1%}")
    console.print(times)
    mem = Table(title=f"memory on the peak device (stage {est.peak_stage})")
    mem.add_column("component")
    mem.add_column("GiB", justify="right")
    for name, value in est.memory_breakdown:
        mem.add_row(name.removesuffix("_bytes"), f"{value / GIB:.2f}")
    console.print(mem)
    return 0
