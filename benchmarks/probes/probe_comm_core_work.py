"""How much of gloo communication's time is core work on this machine (a probe, not a test).

On 4 local gloo ranks (the `cpu` profile's calibration world), ranks 0 and 1 time a GEMM
loop (the sweep's L model's layer GEMM at micro-batch 4: 256x384 @ 384x1024) while ranks
2 and 3 either sleep, run the same GEMMs, all-reduce a tensor of the L model's gradient
size (35 MiB) between themselves, or pass a pipeline boundary activation back and forth
(send/recv of 64 KiB, the S model's at micro-batch 2), each for the same wall time. The
GEMM ranks' slowdown under the communication, over their slowdown under GEMMs, is the share
of its time that takes a core; the rest is waiting that frees it. The cost model prices every
collective as core work on a shared CPU (the cpu profile's comm_overlap is 0.0): see
docs/cost-model.md.
Run: .venv/bin/python benchmarks/probes/probe_comm_core_work.py [--seconds 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

MODES = ("idle", "gemm", "allreduce", "p2p")
GRAD_BYTES = 35 * 2**20
P2P_BYTES = 64 * 2**10
"""A pipeline boundary activation of the sweep's S model at micro-batch 2 (2 x 64 x 128 fp32)."""


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
    elif mode == "p2p":  # ping-pong between ranks 2 and 3, as a pipeline's stages pass activations
        msg, peer = torch.randn(P2P_BYTES // 4), 5 - rank
        going = True
        while going:  # rank 2 says in each message whether another one follows
            if rank == 2:
                going = time.perf_counter() < stop
                msg[0] = float(going)
                dist.send(msg, peer)
                dist.recv(msg, peer)
            else:
                dist.recv(msg, peer)
                going = bool(msg[0])
                dist.send(msg, peer)
            n += 2
        out["p2p_ms"] = (time.perf_counter() - t0) / n * 1e3
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
    p2p: list[float] = []
    for _ in range(args.rounds):
        for mode in MODES:
            got = spawn(_rank, 4, (mode, args.seconds))
            gemm[mode] += [got[r]["gemm_ms"] for r in (0, 1)]
            allreduce += [got[r]["allreduce_ms"] for r in (2, 3) if "allreduce_ms" in got[r]]
            p2p += [got[r]["p2p_ms"] for r in (2, 3) if "p2p_ms" in got[r]]
    med = {m: statistics.median(v) for m, v in gemm.items()}

    def work(mode: str) -> float:
        return (med[mode] - med["idle"]) / (med["gemm"] - med["idle"])

    print(f"GEMM on ranks 0-1, ms per GEMM (median of {2 * args.rounds}): others sleeping {med['idle']:.2f}, "
          f"others on GEMMs {med['gemm']:.2f}, others all-reducing {GRAD_BYTES >> 20} MiB {med['allreduce']:.2f} "
          f"({statistics.median(allreduce):.1f} ms per all-reduce), others passing {P2P_BYTES >> 10} KiB messages "
          f"{med['p2p']:.2f} ({statistics.median(p2p):.3f} ms per message)")
    print(f"core work of a gloo all-reduce here: {work('allreduce'):.0%} of its time; of a send/recv pair: "
          f"{work('p2p'):.0%} (the cost model counts 100%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
