"""Probe: CPU a pipeline schedule spends per point-to-point message on this machine.

A measurement, not a model term. Every rank of a world of N
gloo ranks holds one stage, a small `nn.Linear`, and torch.distributed.pipelining runs
`Schedule1F1B` (or `ScheduleGPipe`) over M microbatches: each boundary passes one
activation forward and its gradient back per microbatch, 2 (N - 1) M messages per step.
The CPU time of all ranks per step (process CPU, gloo's threads included), less the CPU
of the same modules' forward+backward run M times without the schedule, divided by the
messages, is what a message costs with the schedule's own work around it (sender and
receiver together). The pipeline search prices each side of a message at the link's
latency plus bytes over bandwidth (solver/pipeline_stages.py boundary_p2p_s).

Run: .venv/bin/python benchmarks/probes/probe_pipeline_messages.py [--ranks 2 4 8] [--microbatches 8]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rank(rank: int, microbatches: int, width: int, schedule: str) -> tuple[float, float, float]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    n = dist.get_world_size()
    torch.manual_seed(rank)
    module = nn.Linear(width, width)
    rows = 2
    stage = PipelineStage(module, rank, n, torch.device("cpu"))
    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    sched = kind(stage, microbatches, loss_fn=lambda y, _t: y.sum())
    x = torch.randn(microbatches * rows, width)

    def step() -> None:
        if rank == 0:
            sched.step(x)
        elif rank == n - 1:
            sched.step(target=x, losses=[])
        else:
            sched.step()

    for _ in range(3):
        step()
    walls, cpus = [], []
    for _ in range(10):
        dist.barrier()
        t0, c0 = time.perf_counter(), _cpu_s()
        for _ in range(5):
            step()
        c1 = _cpu_s()
        dist.barrier()
        walls.append((time.perf_counter() - t0) / 5)
        cpus.append((c1 - c0) / 5)
    xi = torch.randn(rows, width, requires_grad=True)
    local = []
    for _ in range(10):
        dist.barrier()
        c0 = _cpu_s()
        for _ in range(5):
            for _ in range(microbatches):
                module(xi).sum().backward()
        local.append((_cpu_s() - c0) / 5)
    return min(walls), statistics.median(cpus), statistics.median(local)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    args = ap.parse_args(argv)
    if min(args.ranks) < 2:
        ap.error(f"--ranks: a pipeline needs at least 2 ranks, got {args.ranks}")
    from autopar.runtime.launch import spawn

    for n in args.ranks:
        got = spawn(_rank, n, (args.microbatches, args.width, args.schedule))
        cpu = sum(g[1] for g in got)
        bare = sum(g[2] for g in got)
        messages = 2 * (n - 1) * args.microbatches
        print(f"{n} ranks, {args.schedule}, {args.microbatches} microbatches: step {got[0][0] * 1e3:.1f} ms wall, "
              f"{cpu * 1e3:.1f} ms CPU on all ranks ({bare * 1e3:.1f} ms of it the modules' own work); "
              f"{(cpu - bare) / messages * 1e3:.2f} ms of CPU per message", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
