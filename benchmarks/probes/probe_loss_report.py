"""What a few-element all-reduce costs on gloo, back to back and as a step issues it (a
probe, not a test).

Two parts, each on `--devices` spawned gloo ranks:
1. back to back: `dist.all_reduce` of 1, 2, 4, 8, 16 and 1024 float32 elements, the fastest
   of 5 windows of 20 calls (closed on a world barrier), median over ranks; beside it what
   the built-in `cpu` profile prices (cost_model.all_reduce_time_s). gloo's ring
   (gloo/allreduce.cc) cuts its input into at least 2 n segments of at least one element
   and skips the empty ones, so fewer than 2 n elements run fewer ring messages.
2. in place: a data-parallel program of the sweep's model (`--size`, dp = devices, one
   microbatch per step) stepped in rounds where the step's loss report
   (autopar/runtime/spmd.py `SpmdProgram.global_loss`) runs as usual, is skipped, or is
   issued two or four times, the variants in a rotating order each round; per variant the
   fastest and median step, and the median over rounds of (variant - usual): what the
   report costs where the step issues it, and what one more costs right after it. Beside
   it the price (`cost_model.loss_report_time_s` on the built-in profile).

    .venv/bin/python benchmarks/probes/probe_loss_report.py [--devices 8] [--size S] [--rounds 30]

What it found: gloo's ring skips empty segments, so a one-element all-reduce costs about one
ring step per rank (2.2 ms back to back over 8 ranks, against 18.8 ms for 1024 floats):
priced by its own measured step, `scalar_all_reduce_hop_s`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

ELEMENTS = (1, 2, 4, 8, 16, 1024)
VARIANTS = ("usual", "skipped", "twice", "four times")
CALLS, WINDOWS = 20, 5


def _rank(rank: int, spec: str, rounds: int) -> dict[str, Any]:
    import functools

    import torch
    import torch.distributed as dist

    import autopar
    from benchmarks import sweep_cpu
    from autopar.config import ParallelConfig
    from autopar.models import resolve
    from autopar.runtime.spmd import SpmdProgram

    n = dist.get_world_size()
    back_to_back = {}
    for elements in ELEMENTS:
        x = torch.ones(elements)
        best = float("inf")
        for _ in range(WINDOWS):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(CALLS):
                dist.all_reduce(x)
            dist.barrier()
            best = min(best, (time.perf_counter() - start) / CALLS)
        back_to_back[elements] = best

    real = SpmdProgram.global_loss
    variant = [VARIANTS[0]]

    def report(self: Any, local: Any) -> float:
        if variant[0] == "skipped":
            return float(local)
        for _ in range({"usual": 0, "twice": 1, "four times": 3}[variant[0]]):
            real(self, local)
        return real(self, local)

    SpmdProgram.global_loss = report
    source = resolve(spec)
    batch = source.example_inputs(sweep_cpu.GLOBAL_BATCH, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    compiled = autopar.compile(source.build(), f"cpu:{n}", example_inputs=batch,
                               config=ParallelConfig(dp=n, micro_batch=sweep_cpu.GLOBAL_BATCH // n),
                               optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    for _ in range(2):
        compiled.step(batch)
    steps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for k in range(rounds):
        for v in VARIANTS[k % len(VARIANTS):] + VARIANTS[:k % len(VARIANTS)]:
            variant[0] = v
            dist.barrier()
            start = time.perf_counter()
            compiled.step(batch)
            dist.barrier()
            steps[v].append(time.perf_counter() - start)
    SpmdProgram.global_loss = real
    return {"back_to_back": back_to_back, "steps": steps}


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Back to back: per element count, the median over ranks of each rank's fastest window.
    In place: rank 0's step times (every rank's step ends on the same barrier), per variant
    the fastest and the median round, and the median over rounds of (variant - usual)."""
    b2b = {e: statistics.median(r["back_to_back"][e] for r in per_rank) for e in per_rank[0]["back_to_back"]}
    steps = per_rank[0]["steps"]
    usual = steps["usual"]
    in_place = {v: {"min_s": min(t), "median_s": statistics.median(t),
                    "minus_usual_s": statistics.median(a - b for a, b in zip(t, usual))}
                for v, t in steps.items()}
    return {"back_to_back_s": b2b, "in_place": in_place}


def main(argv: list[str] | None = None) -> int:
    from benchmarks import sweep_cpu

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--size", default="S", choices=sorted(sweep_cpu.SIZES))
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args(argv)
    if args.devices < 2 or sweep_cpu.GLOBAL_BATCH % args.devices:
        ap.error(f"--devices must be at least 2 and divide the sweep's global batch {sweep_cpu.GLOBAL_BATCH}, "
                 f"got {args.devices}")
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    import autopar  # noqa: F401  (autopar before cost_model: import order)
    import cost_model
    from autopar.cluster import Cluster
    from autopar.runtime.launch import spawn

    got = summarize(spawn(_rank, args.devices, (sweep_cpu.SIZES[args.size], args.rounds),
                          collective_timeout_s=900))
    (link,) = cost_model.mesh_axis_links(Cluster.parse(f"cpu:{args.devices}"), (args.devices,))
    print(f"back to back, {args.devices} gloo ranks, fastest of {WINDOWS} windows of {CALLS} calls:")
    for e, t in got["back_to_back_s"].items():
        print(f"  {e:5d} float32: measured {t * 1e3:6.2f} ms, priced {cost_model.all_reduce_time_s(4 * e, link) * 1e3:6.2f}")
    report = cost_model.loss_report_time_s((), (), link)
    print(f"in place, {args.size} x {args.devices} dp{args.devices} (loss report priced {report * 1e3:.2f} ms):")
    for v, row in got["in_place"].items():
        print(f"  report {v:10s}: step min {row['min_s'] * 1e3:6.1f} ms, median {row['median_s'] * 1e3:6.1f} ms, "
              f"median of (this - usual) {row['minus_usual_s'] * 1e3:+6.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
