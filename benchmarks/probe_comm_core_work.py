"""How much of a gloo all-reduce's time is core work on this machine (a probe, not a test).

On 4 local gloo ranks (the `cpu` profile's calibration world), ranks 0 and 1 time a GEMM
loop (the sweep's L model's layer GEMM at micro-batch 4: 256x384 @ 384x1024) while ranks
2 and 3 either sleep, run the same GEMMs, or all-reduce a tensor of the L model's gradient
size (35 MiB) between themselves, each for the same wall time. The GEMM ranks' slowdown
under the all-reduce, over their slowdown under GEMMs, is the share of the all-reduce's
time that takes a core; the rest is waiting that frees it. The cost model prices every
collective as core work on a shared CPU (the cpu profile's comm_overlap is 0.0): see the
README's cost-model section.
Run: .venv/bin/python benchmarks/probe_comm_core_work.py [--seconds 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

MODES = ("idle", "gemm", "allreduce")
GRAD_BYTES = 35 * 2**20


def _rank(rank: int, mode: str, seconds: float) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    pair = dist.new_group([2, 3])
    a, b = torch.randn(256, 384), torch.randn(384, 1024)
    grad = torch.randn(GRAD_BYTES // 4)
    dist.barrier()
    stop = time.perf_counter() + seconds
    out: dict[str, float] = {}
    t0, n = time.perf_counter(), 0
    if rank < 2 or mode == "gemm":
        while time.perf_counter() < stop:
            for _ in range(20):
                a @ b
            n += 20
        out["gemm_ms"] = (time.perf_counter() - t0) / n * 1e3
    elif mode == "allreduce":
        while time.perf_counter() < stop:
            dist.all_reduce(grad, group=pair)
            n += 1
        out["allreduce_ms"] = (time.perf_counter() - t0) / n * 1e3
    else:
        time.sleep(seconds)
    dist.barrier()
    return out


def main(argv: list[str] | None = None) -> int:
    from autopar.runtime.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    gemm: dict[str, list[float]] = {m: [] for m in MODES}
    allreduce: list[float] = []
    for _ in range(args.rounds):
        for mode in MODES:
            got = spawn(_rank, 4, (mode, args.seconds))
            gemm[mode] += [got[r]["gemm_ms"] for r in (0, 1)]
            allreduce += [got[r]["allreduce_ms"] for r in (2, 3) if "allreduce_ms" in got[r]]
    med = {m: statistics.median(v) for m, v in gemm.items()}
    share = (med["allreduce"] - med["idle"]) / (med["gemm"] - med["idle"])
    print(f"GEMM on ranks 0-1, ms per GEMM (median of {2 * args.rounds}): others sleeping {med['idle']:.2f}, "
          f"others on GEMMs {med['gemm']:.2f}, others all-reducing {GRAD_BYTES >> 20} MiB {med['allreduce']:.2f} "
          f"({statistics.median(allreduce):.1f} ms per all-reduce)")
    print(f"core work of a gloo all-reduce here: {share:.0%} of its time (the cost model counts 100%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
