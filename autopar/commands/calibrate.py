"""`autopar calibrate [--devices N] [--repeats R] [--out profile.json] [--json] [--refit profile.json]`: measure this machine.

Runs autopar/calibrate.py on N local gloo ranks and prints the measured rates and the
`cpu` Hardware profile built from them. `--out` writes `{"hardware": ..., "measurements":
...}`; load it with `autopar.cluster.load_hardware(path)` and price with
`Cluster.parse("cpu:N", hardware=hw)`. The profile is per dedicated core (cores_per_node):
the cost model applies the core sharing of whatever N it prices, so a profile measured on
4 ranks also prices `cpu:8`. `--repeats R` runs the measurement R times and keeps the
median of each figure (autopar.calibrate.combine): on a shared machine, one burst of load
then skews no fit. `--refit PROFILE` measures nothing: it derives the profile again from the
measurements an earlier `--out` file keeps, with this version's fits (a fit that changed
applies to a profile measured before it; the file's own "hardware" is ignored).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from autopar.calibrate import Calibration, calibrate, fit, latency_share_exponent, to_hardware


def stored_measurements(path: str) -> Calibration:
    """The measurements an `autopar calibrate --out` file keeps (ValueError: what is wrong)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--refit {path}: cannot read it ({exc}); give a file `autopar calibrate --out` wrote") \
            from exc
    if not isinstance(data, dict) or not isinstance(data.get("measurements"), dict):
        raise ValueError(f"--refit {path}: no \"measurements\" object in it (a bare profile keeps none); give a "
                         "file `autopar calibrate --out` wrote, e.g. autopar/cpu_profile.json")
    try:
        return Calibration.from_json(data["measurements"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"--refit {path}: its measurements are incomplete or malformed ({type(exc).__name__}: "
                         f"{exc}); measure again with `autopar calibrate --out`") from exc


def run(args: argparse.Namespace) -> int:
    refit = getattr(args, "refit", None)
    if refit and getattr(args, "repeats", 1) != 1:
        raise ValueError(f"--refit measures nothing, so --repeats {args.repeats} does not apply; leave it out")
    cal = stored_measurements(refit) if refit else calibrate(args.devices, repeats=getattr(args, "repeats", 1))
    if refit and args.devices not in (2, cal.devices):  # 2: the flag's default
        raise ValueError(f"--refit {refit}: its measurements were made on {cal.devices} ranks, not the --devices "
                         f"{args.devices} given; leave --devices out (a refit keeps the file's ranks)")
    hw = to_hardware(cal)
    f = fit(cal)
    out = {"hardware": hw.to_json(), "measurements": cal.to_json()}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    if refit:
        print(f"refitted from the measurements kept in {refit} (nothing measured now; they were taken with "
              f"{cal.devices} concurrent gloo ranks on {cal.cores} cores); figures below per dedicated core "
              f"(measured x {cal.sharing:.1f} ranks per core)")
    else:
        print(f"calibrated with {cal.devices} concurrent gloo ranks on {cal.cores} cores (1 thread each; medians "
              f"over ranks and {getattr(args, 'repeats', 1)} run(s)); figures below per dedicated core (measured x "
              f"{cal.sharing:.1f} ranks per core)")
    print(f"  GEMM fp32: peak {f.gemm_flops_per_s / 1e9:.2f} GFLOP/s, K-ramp {f.gemm_k_ramp:.0f}, "
          f"per-call {f.gemm_overhead_s * 1e6:.1f} us")
    print(f"  copy: {f.copy_bytes_per_s / 1e9:.2f} GB/s, per-call {f.copy_overhead_s * 1e6:.1f} us")
    path = "as the per-rank program runs them" if cal.program_op_s else "eager, autograd forward+backward"
    print(f"  per op ({path}): {f.eager_op_s * 1e6:.1f} us; view: {f.view_op_s * 1e6:.2f} us; "
          f"DTensor op extra: {f.dtensor_op_overhead_s * 1e6:.1f} us")
    print(f"  fused attention: {f.attention_efficiency:.2f} of the GEMM peak")
    if f.optimizer_s and f.accumulate_s:
        print(f"  optimizer step (fused AdamW): {f.optimizer_s * 1e9:.2f} ns per parameter "
              f"({f.optimizer_s * f.copy_bytes_per_s:.1f} bytes of copy traffic); in-place gradient accumulation: "
              f"{f.accumulate_s * 1e12:.1f} ps per byte ({f.accumulate_s * f.copy_bytes_per_s:.2f} bytes per byte)")
    if f.param_tensor_s:
        print(f"  step epilogue per parameter tensor (DTensor gradient, fused AdamW dispatch, zero_grad): "
              f"{f.param_tensor_s * 1e6:.1f} us")
    skew_us = cal.sync_skew_s / cal.sharing * 1e6
    g = latency_share_exponent(hw)
    print(f"  gloo: launch {f.base_latency_s * 1e6:.0f} us (rank skew {skew_us:.0f} us measured, not priced) + "
          f"{f.hop_latency_s * 1e6:.0f} us per ring step (latencies: measured / {cal.sharing:.1f} ** {g:g}, the "
          "built-in profile's share law); busBW "
          + ", ".join(f"{k} {v / 1e9:.3f} GB/s" for k, v in f.bus_bytes_per_s.items())
          + f"; send/recv {f.p2p_bytes_per_s / 1e9:.3f} GB/s")
    if f.scalar_hop_latency_s:
        print(f"  gloo one-element all-reduce (a loss): {f.scalar_hop_latency_s * 1e6:.0f} us per ring step "
              "(gloo skips its ring's empty segments)")
    else:
        print("  gloo one-element all-reduce: not measured (a profile from an older calibrate): priced as the ring")
    print(f"profile '{hw.name}': cores_per_node {hw.cores_per_node}, busBW vs all-reduce: "
          + ", ".join(f"{k} x{v:.2f}" for k, v in hw.collective_bandwidth_scale))
    wait = dict(hw.efficiency).get("stage_collective_wait_s", 0.0)
    gemm_bytes = dict(hw.efficiency).get("gemm_memory_efficiency", 1.0)
    call = dict(hw.efficiency).get("pipeline_call_host_s", 0.0)
    print(f"  not measured, from the built-in profile: stage collective wait {wait * 1e6:.0f} us, GEMM bytes at "
          f"{gemm_bytes:.2f} of the copy bandwidth, collective latency x (ranks per core) ** {g:g}, a pipeline "
          f"stage's chunk call {call * 1e6:.0f} us of host time (fitted on the recorded CPU sweeps, "
          "benchmarks/fit/fit_cpu_constants.py)")
    print(f"written to {args.out}" if args.out else "not written (use --out profile.json)")
    return 0
