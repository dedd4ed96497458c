"""What a collective costs issued as the per-rank program issues it (a probe, not a test).

`autopar calibrate` times gloo collectives as raw `torch.distributed` calls
(`dist.all_reduce`, `dist.all_gather_into_tensor`, `dist.reduce_scatter_tensor`). The per-rank
program issues most of its collectives through the functional API instead: DTensor's
redistribute, codegen/apply.py's flat parameter gathers and its reduce-scatter buckets
(`funcol.*`, waited by `wait_tensor`); only the bucketed all-reduce gradient sync calls the
in-place op directly. This probe times both, side by side in the same windows, on the
world and inside 2-rank groups (every pair at once, each pair's windows on its own barrier,
as calibrate does), at calibrate's sizes: the fastest of 3 windows, median over ranks.

    .venv/bin/python benchmarks/probe_funcol_overhead.py [--devices 4] [--windows 3]

Prints per (kind, group size, bytes): raw, functional and the difference in ms. The README's
cost-model section says what runs found and what was done with it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PATHS = ("raw", "functional")


def _rank(rank: int, windows: int) -> dict[tuple[str, int, int, str], float]:
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from autopar.calibrate import COLLECTIVE_BYTES, COLLECTIVE_REPEATS

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
            calls: dict[tuple[str, str], Callable[[], Any]] = {
                ("all_reduce", "raw"): lambda: dist.all_reduce(x, group=group),
                ("all_reduce", "functional"): lambda: funcol.wait_tensor(funcol.all_reduce(x, "sum", group)),
                ("all_gather", "raw"): lambda: dist.all_gather_into_tensor(full, shard, group=group),
                ("all_gather", "functional"): lambda: funcol.wait_tensor(funcol.all_gather_tensor(shard, 0, group)),
                ("reduce_scatter", "raw"): lambda: dist.reduce_scatter_tensor(shard, full, group=group),
                ("reduce_scatter", "functional"): lambda: funcol.wait_tensor(
                    funcol.reduce_scatter_tensor(full, "sum", 0, group)),
            }
            for call in calls.values():  # first calls (the functional ops' one-time setup) untimed
                call()
            count = COLLECTIVE_REPEATS[nbytes]
            for _ in range(windows):
                for (kind, path), call in calls.items():  # alternating: both paths see the same load
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
    """Per (kind, group size, bytes): the median over ranks of each path's fastest window."""
    rows = []
    for kind, size, nbytes, path in sorted(per_rank[0]):
        if path != "raw":
            continue
        raw = statistics.median(r[(kind, size, nbytes, "raw")] for r in per_rank)
        functional = statistics.median(r[(kind, size, nbytes, "functional")] for r in per_rank)
        rows.append({"kind": kind, "ranks": size, "bytes": nbytes, "raw_s": raw, "functional_s": functional})
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    import os

    from autopar.runtime.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=4, help="gloo ranks (calibrate's default: 4)")
    ap.add_argument("--windows", type=int, default=3)
    args = ap.parse_args(argv)
    if args.devices < 2:
        ap.error(f"--devices must be at least 2 (a collective needs two ranks), got {args.devices}")
    rows = summarize(spawn(_rank, args.devices, (args.windows,), collective_timeout_s=300.0))
    print(f"{args.devices} gloo ranks on {os.cpu_count()} cores; fastest of {args.windows} windows, median over ranks")
    print(f"{'collective':<15} {'ranks':>5} {'bytes':>9} {'raw ms':>8} {'functional ms':>14} {'difference':>11}")
    for r in rows:
        print(f"{r['kind']:<15} {r['ranks']:>5} {r['bytes']:>9} {r['raw_s'] * 1e3:>8.2f} "
              f"{r['functional_s'] * 1e3:>14.2f} {(r['functional_s'] - r['raw_s']) * 1e3:>+11.2f}")
    return rows


if __name__ == "__main__":
    main()
