"""`autopar trace MODEL`: trace a training step and summarise the graph."""

from __future__ import annotations

import argparse
import json

from autopar import units
from autopar.models import resolve
from autopar.trace import trace_model


def run(args: argparse.Namespace) -> int:
    source = resolve(args.model).with_overrides(seq=args.seq)
    graph = trace_model(source, batch=args.global_batch, dtype=args.dtype)
    summary = graph.summary()
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
        return 0
    from rich.console import Console  # lazy: rich, only to print tables
    from rich.table import Table  # lazy: rich, only to print tables

    console = Console()
    m = graph.model
    console.print(f"[bold]{m.name}[/]: {units.count(m.num_parameters)} parameters, {m.num_layers} layers, "
                  f"batch {m.batch} x seq {m.seq}, {m.dtype}")
    console.print(f"joint graph: {len(graph)} nodes, {len(summary['ops'])} distinct ops, "
                  f"{units.flops(graph.flops_per_step)} per step, traced in {graph.trace_time_s:.2f} s")
    groups = Table(title="layer groups (solved once, weighted by multiplicity)")
    for col in ("group", "traced layers", "multiplicity", "nodes/layer", "signature"):
        groups.add_column(col)
    for g in summary["layer_groups"]:
        layers = g["traced_layers"]
        span = f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
        groups.add_row(str(g["index"]), span, str(g["multiplicity"]), str(g["nodes_per_layer"]), g["signature"])
    console.print(groups)
    ops = Table(title="ops")
    ops.add_column("op")
    ops.add_column("count", justify="right")
    for op, count in sorted(summary["ops"].items(), key=lambda kv: -kv[1]):
        ops.add_row(op, str(count))
    console.print(ops)
    return 0
