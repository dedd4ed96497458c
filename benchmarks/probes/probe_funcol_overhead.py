"""What a collective costs issued as the per-rank program issues it (a probe, not a test).

`autopar calibrate` times gloo collectives as raw `torch.distributed` calls
(`dist.all_reduce`, `dist.all_gather_into_tensor`, `dist.reduce_scatter_tensor`). The per-rank
program is a `make_fx` graph (codegen/apply.py): its collectives are the
`_c10d_functional` ops DTensor's redistribute and the runtime's gathers and buckets record
(`all_gather_into_tensor`, `reduce_scatter_tensor`, `all_reduce` / `all_reduce_`), each
followed by `wait_tensor`, with no Python wrapper at run time. This probe times three paths
side by side in the same windows, on the world and inside 2-rank groups (every pair at
once, each pair's windows on its own barrier, as calibrate does), at calibrate's sizes:
- raw: what calibrate times;
- graph: the `_c10d_functional` op plus `wait_tensor`, what the program runs (the
  out-of-place `all_reduce`, as DTensor's Partial -> Replicate records it);
- funcol: the Python `funcol.*` API (an `AsyncCollectiveTensor`, waited at once), what
  DTensor's redistribute calls eagerly; the program does not pay it (make_fx records the
  ops under it), shown for scale.
The fastest of `--windows` windows, median over ranks.

    .venv/bin/python benchmarks/probes/probe_funcol_overhead.py [--devices 4] [--windows 3]

Prints per (kind, group size, bytes) each path's ms and graph - raw. What its runs found is in docs/cost-model.md (the `cpu` profile).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PATHS = ("raw", "graph", "funcol")


def _rank(rank: int, windows: int) -> dict[tuple[str, int, int, str], float]:
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from autopar.calibrate_rank import COLLECTIVE_BYTES, COLLECTIVE_REPEATS

    warnings.filterwarnings("ignore", category=FutureWarning)
    n = dist.get_world_size()
    pairs = [dist.new_group([2 * j, 2 * j + 1]) for j in range(n // 2)]
    mine = pairs[rank // 2] if rank // 2 < len(pairs) else None
    out: dict[tuple[str, int, int, str], float] = {}
    passes = [(n, dist.group.WORLD, dist.barrier)]
    if n > 2 and n % 2 == 0:
        passes.append((2, mine, lambda: dist.barrier(group=mine)))
    for size, group, sync in passes:
        for nbytes in COLLECTIVE_BYTES:
            x = torch.ones(nbytes // 4)
            shard = torch.ones(nbytes // 4 // size)
            full = torch.ones(shard.numel() * size)
            name = funcol._resolve_group_name(group)
            ops = torch.ops._c10d_functional
            calls: dict[tuple[str, str], Callable[[], Any]] = {
                ("all_reduce", "raw"): lambda: dist.all_reduce(x, group=group),
                ("all_reduce", "graph"): lambda: ops.wait_tensor(ops.all_reduce(x, "sum", name)),
                ("all_reduce", "funcol"): lambda: funcol.wait_tensor(funcol.all_reduce(x, "sum", group)),
                ("all_gather", "raw"): lambda: dist.all_gather_into_tensor(full, shard, group=group),
                ("all_gather", "graph"): lambda: ops.wait_tensor(ops.all_gather_into_tensor(shard, size, name)),
                ("all_gather", "funcol"): lambda: funcol.wait_tensor(funcol.all_gather_single(shard, 0, group)),
                ("reduce_scatter", "raw"): lambda: dist.reduce_scatter_tensor(shard, full, group=group),
                ("reduce_scatter", "graph"): lambda: ops.wait_tensor(ops.reduce_scatter_tensor(full, "sum", size, name)),
                ("reduce_scatter", "funcol"): lambda: funcol.wait_tensor(
                    funcol.reduce_scatter_single(full, "sum", 0, group)),
            }
            for call in calls.values():  # first calls (the functional API's one-time setup) untimed
                call()
            count = COLLECTIVE_REPEATS[nbytes]
            for _ in range(windows):
                for (kind, path), call in calls.items():  # interleaved: every path sees the same load
                    sync()
                    start = time.perf_counter()
                    for _ in range(count):
                        call()
                    sync()
                    key = (kind, size, nbytes, path)
                    out[key] = min(out.get(key, float("inf")), (time.perf_counter() - start) / count)
        dist.barrier()
    return out


def summarize(per_rank: list[dict[tuple[str, int, int, str], float]]) -> list[dict[str, Any]]:
    """Per (kind, group size, bytes): the median over ranks of each path's fastest window
    (`<path>_s` for every path in PATHS)."""
    rows = []
    for kind, size, nbytes, path in sorted(per_rank[0]):
        if path != PATHS[0]:
            continue
        row: dict[str, Any] = {"kind": kind, "ranks": size, "bytes": nbytes}
        for p in PATHS:
            row[f"{p}_s"] = statistics.median(r[(kind, size, nbytes, p)] for r in per_rank)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    import os

    from autopar.runtime.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=4, help="gloo ranks (calibrate's default: 4)")
    ap.add_argument("--windows", type=int, default=3)
    args = ap.parse_args(argv)
    if args.windows < 1:
        ap.error(f"--windows must be at least 1 (each path is timed in that many windows), got {args.windows}")
    if args.devices < 2:
        ap.error(f"--devices must be at least 2 (a collective needs two ranks), got {args.devices}")
    rows = summarize(spawn(_rank, args.devices, (args.windows,), collective_timeout_s=300.0))
    print(f"{args.devices} gloo ranks on {os.cpu_count()} cores; fastest of {args.windows} windows, median over ranks")
    print(f"{'collective':<15} {'ranks':>5} {'bytes':>9} {'raw ms':>8} {'graph ms':>9} {'funcol ms':>10} "
          f"{'graph - raw':>12}")
    for r in rows:
        print(f"{r['kind']:<15} {r['ranks']:>5} {r['bytes']:>9} {r['raw_s'] * 1e3:>8.2f} {r['graph_s'] * 1e3:>9.2f} "
              f"{r['funcol_s'] * 1e3:>10.2f} {(r['graph_s'] - r['raw_s']) * 1e3:>+12.2f}")
    return rows


if __name__ == "__main__":
    main()
