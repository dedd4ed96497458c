"""Measure this machine and write a `cpu` Hardware profile the cost model can price against.

Where it sits: beside autopar/cluster.py (which defines `Hardware` and loads profiles with
`load_hardware`). `calibrate(devices)` spawns `devices` local gloo ranks (one thread
each, exactly as `autopar train --devices N` runs them) and, on every rank at once:
- GEMM rate: fp32 square matmuls of a few sizes, flops = 2 n^3 per matmul;
- memory bandwidth: copies of a large tensor, bytes = 2 x size (read + write);
- gloo collectives: all-reduce, all-gather and send/recv (pairs 2k <-> 2k+1) at a small
  size (latency) and large sizes (bandwidth), nccl-tests bus-bandwidth conventions:
  all-reduce busBW = 2 (n-1)/n S / t, all-gather and reduce-scatter busBW = (n-1)/n S / t,
  p2p S / t.
Because the ranks run concurrently, every rate is what one rank gets while the others
work too (on 2 cores and 4 ranks, about half a core each): the per-device rate a plan on
`cpu:N` sees. Medians over repeats are used everywhere (the machine is shared and noisy).

Collective bandwidth per kind: gloo's all-gather and reduce-scatter run at a fraction of
its all-reduce busBW (measured here: about half), and FSDP / sequence-parallel steps are
made of them, so the profile keeps the all-reduce busBW (median over the large sizes) as
the link's and the other two as `collective_bandwidth_scale` ratios of their busBW to it.

From measured rates to a profile: the cost model multiplies each peak by a global
efficiency (cost_model/efficiency.py); the profile stores measured / efficiency, so the
model's achievable rate equals the measured one. Latency: a ring all-reduce of n ranks
takes 2 (n-1) steps and an all-gather n-1, so alpha is fitted (least squares) to the small
collectives on all N ranks and inside 2-rank groups (see `Calibration.latency_s`).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

from autopar.cluster import HARDWARE, Hardware

log = logging.getLogger(__name__)

GEMM_SIZES = (128, 256, 512)
COPY_BYTES = 32 * 2**20
COLLECTIVE_SMALL_BYTES = 4 * 2**10
COLLECTIVE_LARGE_BYTES = (2 * 2**20, 8 * 2**20)
COLLECTIVE_REPEATS = {COLLECTIVE_SMALL_BYTES: 20, 2 * 2**20: 4, 8 * 2**20: 2}
MIN_TIME_S = 0.2
"""Length of one timing window of local work (GEMM, copy)."""
WINDOWS = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    devices: int
    gemm_flops_per_s: tuple[tuple[int, float], ...]
    """Per matrix size n: median fp32 rate per rank with all ranks busy."""
    copy_bandwidth_bytes_per_s: float
    all_reduce_bus_bytes_per_s: tuple[tuple[int, float], ...]
    all_gather_bus_bytes_per_s: tuple[tuple[int, float], ...]
    reduce_scatter_bus_bytes_per_s: tuple[tuple[int, float], ...]
    send_recv_bytes_per_s: tuple[tuple[int, float], ...]
    all_reduce_small_s: float
    all_gather_small_s: float
    send_recv_small_s: float
    pair_all_reduce_small_s: float = 0.0
    """The small all-reduce / all-gather inside 2-rank groups (0 = not measured)."""
    pair_all_gather_small_s: float = 0.0

    @property
    def latency_s(self) -> float:
        """Per ring step alpha: least squares through the origin of the small collectives'
        times against their ring steps (all-reduce 2 (n-1), all-gather n-1, n = N and 2)."""
        n = self.devices
        points = [(self.all_reduce_small_s, 2 * (n - 1)), (self.all_gather_small_s, n - 1)]
        if self.pair_all_reduce_small_s:
            points += [(self.pair_all_reduce_small_s, 2), (self.pair_all_gather_small_s, 1)]
        return sum(t * k for t, k in points) / sum(k * k for _, k in points)

    def to_json(self) -> dict[str, Any]:
        return {
            "devices": self.devices,
            "gemm_flops_per_s": {str(n): r for n, r in self.gemm_flops_per_s},
            "copy_bandwidth_bytes_per_s": self.copy_bandwidth_bytes_per_s,
            "all_reduce_bus_bytes_per_s": {str(n): r for n, r in self.all_reduce_bus_bytes_per_s},
            "all_gather_bus_bytes_per_s": {str(n): r for n, r in self.all_gather_bus_bytes_per_s},
            "reduce_scatter_bus_bytes_per_s": {str(n): r for n, r in self.reduce_scatter_bus_bytes_per_s},
            "send_recv_bytes_per_s": {str(n): r for n, r in self.send_recv_bytes_per_s},
            "all_reduce_small_s": self.all_reduce_small_s,
            "all_gather_small_s": self.all_gather_small_s,
            "send_recv_small_s": self.send_recv_small_s,
            "pair_all_reduce_small_s": self.pair_all_reduce_small_s,
            "pair_all_gather_small_s": self.pair_all_gather_small_s,
            "latency_s": self.latency_s,
            "small_bytes": COLLECTIVE_SMALL_BYTES,
        }


def _repeat(fn: Callable[[], None], sync: Callable[[], None], count: int | None = None) -> float:
    """Seconds per `fn()` call: the median over WINDOWS windows of (window wall time / calls).

    Whole windows, not single calls: with more ranks than cores the OS time-slices the
    ranks, and a median of single short calls would see only the uninterrupted ones.
    Local work sizes its windows to about MIN_TIME_S; collectives need the same `count`
    on every rank (else the ranks deadlock)."""
    fn()
    sync()
    if count is None:
        start = time.perf_counter()
        fn()
        count = max(1, min(10_000, int(MIN_TIME_S / max(time.perf_counter() - start, 1e-7))))
    per_call: list[float] = []
    for _ in range(WINDOWS):
        sync()
        start = time.perf_counter()
        for _ in range(count):
            fn()
        per_call.append((time.perf_counter() - start) / count)
    return statistics.median(per_call)


def _rank_measure(rank: int) -> dict[str, Any]:
    """Runs on every spawned rank (module level: picklable for spawn)."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's rename
    n = dist.get_world_size()
    barrier = dist.barrier
    out: dict[str, Any] = {"gemm": {}, "ar": {}, "ag": {}, "rs": {}, "p2p": {}}
    for size in GEMM_SIZES:
        a, b = torch.randn(size, size), torch.randn(size, size)
        barrier()
        out["gemm"][size] = 2 * size**3 / _repeat(lambda: torch.mm(a, b), barrier)
    src = torch.empty(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    src.fill_(1.0)
    barrier()
    out["copy"] = 2 * COPY_BYTES / _repeat(lambda: dst.copy_(src), barrier)
    peer = rank ^ 1
    # small collectives inside 2-rank groups (pairs 2k, 2k+1, all pairs at once): most
    # tp/pp/dp groups of a few-process job have 2 members
    pairs = [dist.new_group([2 * k, 2 * k + 1]) for k in range(n // 2)]
    mine = pairs[rank // 2] if rank // 2 < len(pairs) else None
    small = torch.ones(COLLECTIVE_SMALL_BYTES // 4)
    if mine is not None:
        half = torch.ones(small.numel() // 2)
        count = COLLECTIVE_REPEATS[COLLECTIVE_SMALL_BYTES]
        sync = lambda: dist.barrier(group=mine)  # noqa: E731
        out["ar2"] = _repeat(lambda: dist.all_reduce(small, group=mine), sync, count)
        out["ag2"] = _repeat(lambda: dist.all_gather_into_tensor(small, half, group=mine), sync, count)
    barrier()
    for nbytes in (COLLECTIVE_SMALL_BYTES, *COLLECTIVE_LARGE_BYTES):
        x = torch.ones(nbytes // 4)
        shard = torch.ones(nbytes // 4 // n)
        gathered = torch.empty(shard.numel() * n)
        count = COLLECTIVE_REPEATS[nbytes]
        barrier()
        out["ar"][nbytes] = _repeat(lambda: dist.all_reduce(x), barrier, count)
        barrier()
        out["ag"][nbytes] = _repeat(lambda: dist.all_gather_into_tensor(gathered, shard), barrier, count)
        barrier()
        out["rs"][nbytes] = _repeat(lambda: dist.reduce_scatter_tensor(shard, gathered), barrier, count)
        if peer < n:
            def pingpong() -> None:  # one message each way; time per message = half
                if rank % 2 == 0:
                    dist.send(x, peer)
                    dist.recv(x, peer)
                else:
                    dist.recv(x, peer)
                    dist.send(x, peer)
            barrier()
            out["p2p"][nbytes] = _repeat(pingpong, lambda: None, count) / 2
        else:
            barrier()
    return out


def _median_over_ranks(results: list[dict[str, Any]], key: str, sub: Any = None) -> float:
    values = [r[key] if sub is None else r[key][sub] for r in results if sub is None or sub in r[key]]
    return statistics.median(values)


def calibrate(devices: int) -> Calibration:
    """Measure with `devices` concurrent local gloo ranks (spawned here)."""
    from autopar.runtime_launch import spawn

    if devices < 2:
        raise ValueError(f"--devices must be at least 2 to measure collectives, got {devices}")
    start = time.perf_counter()
    results = spawn(_rank_measure, devices, ())
    log.info("calibrate: %d ranks measured in %.1f s", devices, time.perf_counter() - start)
    n = devices
    ar = {s: _median_over_ranks(results, "ar", s) for s in (COLLECTIVE_SMALL_BYTES, *COLLECTIVE_LARGE_BYTES)}
    ag = {s: _median_over_ranks(results, "ag", s) for s in (COLLECTIVE_SMALL_BYTES, *COLLECTIVE_LARGE_BYTES)}
    rs = {s: _median_over_ranks(results, "rs", s) for s in COLLECTIVE_LARGE_BYTES}
    p2p = {s: _median_over_ranks(results, "p2p", s) for s in (COLLECTIVE_SMALL_BYTES, *COLLECTIVE_LARGE_BYTES)}
    return Calibration(
        devices=n,
        gemm_flops_per_s=tuple((s, _median_over_ranks(results, "gemm", s)) for s in GEMM_SIZES),
        copy_bandwidth_bytes_per_s=_median_over_ranks(results, "copy"),
        all_reduce_bus_bytes_per_s=tuple((s, 2 * (n - 1) / n * s / ar[s]) for s in COLLECTIVE_LARGE_BYTES),
        all_gather_bus_bytes_per_s=tuple((s, (n - 1) / n * s / ag[s]) for s in COLLECTIVE_LARGE_BYTES),
        reduce_scatter_bus_bytes_per_s=tuple((s, (n - 1) / n * s / rs[s]) for s in COLLECTIVE_LARGE_BYTES),
        send_recv_bytes_per_s=tuple((s, s / p2p[s]) for s in COLLECTIVE_LARGE_BYTES),
        all_reduce_small_s=ar[COLLECTIVE_SMALL_BYTES],
        all_gather_small_s=ag[COLLECTIVE_SMALL_BYTES],
        send_recv_small_s=p2p[COLLECTIVE_SMALL_BYTES],
        pair_all_reduce_small_s=statistics.median(r["ar2"] for r in results if "ar2" in r),
        pair_all_gather_small_s=statistics.median(r["ag2"] for r in results if "ag2" in r),
    )


MEASURED_RATES = tuple(sorted((("gemm_efficiency", 1.0), ("memory_efficiency", 1.0), ("nvlink_bus_efficiency", 1.0),
                               ("nic_bus_efficiency", 1.0), ("collective_base_latency_s", 0.0))))
"""Efficiency overrides of a calibrated profile: its peaks ARE the measured rates."""


def to_hardware(cal: Calibration, *, name: str = "cpu") -> Hardware:
    """The profile whose achievable rates (peak x the cost model's efficiencies) are the
    measured ones; see the module docstring."""
    gemm = max(r for _, r in cal.gemm_flops_per_s)
    alpha = cal.latency_s
    bw = {kind: statistics.median(r for _, r in rows)
          for kind, rows in (("all_reduce", cal.all_reduce_bus_bytes_per_s),
                             ("all_gather", cal.all_gather_bus_bytes_per_s),
                             ("reduce_scatter", cal.reduce_scatter_bus_bytes_per_s))}
    bus = bw["all_reduce"]
    total_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    base = HARDWARE["cpu"]
    return Hardware(
        name=name,
        peak_flops_per_s=(("bfloat16", gemm), ("float32", gemm)),
        memory_bytes=int(total_ram // cal.devices),
        memory_bandwidth_bytes_per_s=cal.copy_bandwidth_bytes_per_s,
        intra_node_bandwidth_bytes_per_s=bus,
        intra_node_latency_s=alpha,
        inter_node_bandwidth_bytes_per_s=bus,
        inter_node_latency_s=alpha,
        default_gpus_per_node=base.default_gpus_per_node,
        comm_overlap=base.comm_overlap,
        collective_bandwidth_scale=tuple((kind, bw[kind] / bus) for kind in ("all_gather", "reduce_scatter")),
        efficiency=MEASURED_RATES,
    )


__all__ = ["Calibration", "calibrate", "to_hardware"]
