"""`autopar calibrate [--devices N] [--out profile.json] [--json]`: measure this machine.

Runs autopar/calibrate.py on N local gloo ranks and prints the measured rates and the
`cpu` Hardware profile built from them. `--out` writes `{"hardware": ..., "measurements":
...}`; load it with `autopar.cluster.load_hardware(path)` and price with
`Cluster.parse("cpu:N", hardware=hw)`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from autopar.calibrate import calibrate, to_hardware


def run(args: argparse.Namespace) -> int:
    cal = calibrate(args.devices)
    hw = to_hardware(cal)
    out = {"hardware": hw.to_json(), "measurements": cal.to_json()}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    m = cal
    print(f"calibrated with {m.devices} concurrent gloo ranks (1 thread each; medians over repeats)")
    for n, r in m.gemm_flops_per_s:
        print(f"  GEMM fp32 {n}x{n}x{n}: {r / 1e9:8.2f} GFLOP/s per rank")
    print(f"  copy bandwidth:          {m.copy_bandwidth_bytes_per_s / 1e9:8.2f} GB/s per rank")
    for name, rows in (("all-reduce busBW", m.all_reduce_bus_bytes_per_s),
                       ("all-gather busBW", m.all_gather_bus_bytes_per_s),
                       ("reduce-scatter busBW", m.reduce_scatter_bus_bytes_per_s), ("send/recv", m.send_recv_bytes_per_s)):
        for n, r in rows:
            print(f"  {name} {n / 2**20:.0f} MiB: {r / 1e9:8.3f} GB/s")
    print(f"  4 KiB on {m.devices} ranks: all-reduce {m.all_reduce_small_s * 1e3:.3f} ms, all-gather "
          f"{m.all_gather_small_s * 1e3:.3f} ms, send/recv {m.send_recv_small_s * 1e3:.3f} ms")
    print(f"  4 KiB in 2-rank groups: all-reduce {m.pair_all_reduce_small_s * 1e3:.3f} ms, all-gather "
          f"{m.pair_all_gather_small_s * 1e3:.3f} ms; fitted alpha per ring step {m.latency_s * 1e3:.3f} ms")
    print(f"profile '{hw.name}': peak {hw.peak_flops('float32') / 1e9:.2f} GFLOP/s, memory bandwidth "
          f"{hw.memory_bandwidth_bytes_per_s / 1e9:.2f} GB/s, link {hw.intra_node_bandwidth_bytes_per_s / 1e9:.3f} "
          f"GB/s, alpha {hw.intra_node_latency_s * 1e6:.0f} us (peaks = measured / cost-model efficiency); "
          f"busBW vs all-reduce: " + ", ".join(f"{k} x{v:.2f}" for k, v in hw.collective_bandwidth_scale))
    print(f"written to {args.out}" if args.out else "not written (use --out profile.json)")
    return 0
