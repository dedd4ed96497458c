"""benchmarks/results/gpu_h100.md from the JSON lines `benchmarks/gpu_check.sh` wrote on a GPU.

Runs on the CPU machine: it reads the runs' rows, prices the same configurations with the
built-in `h100` profile (the training step by the closed-form baseline, benchmarks/baselines/analytic/,
which has the torch.compile option the measured compiled row needs; kernels by
cost_model.compute) and writes the tables. Nothing
here is measured: every figure labelled measured comes from the rows.
Run: .venv/bin/python benchmarks/gpu_report.py benchmarks/results/gpu_h100_run1.jsonl ... \
         [--out benchmarks/results/gpu_h100.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autopar.cluster import Cluster  # noqa: E402
from cost_model.compute import compute_time_s, gemm_time_s  # noqa: E402
from cost_model.efficiency import efficiency_for  # noqa: E402

PEAK_BF16 = 989e12


def load(paths: list[Path]) -> list[list[dict[str, Any]]]:
    return [[json.loads(line) for line in p.read_text().splitlines() if line.strip()] for p in paths]


def price(model: str, batch: int, compiled: bool) -> dict[str, Any]:
    """The step of `model` at `batch` sequences on one H100, by the baseline (eager, or under
    torch.compile: RuntimeOptions.compiled), as its Estimate's JSON."""
    from benchmarks.baselines import analytic
    from autopar.config import ParallelConfig
    from autopar.models import resolve
    from autopar.trace import trace_model

    graph = trace_model(resolve(model), batch=1, dtype="bfloat16", layers_traced=2)
    est = analytic.price(graph, ParallelConfig(micro_batch=batch), Cluster.parse("h100:1x1"), global_batch=batch,
                         options=analytic.RuntimeOptions(compiled=compiled))
    return est.to_json()


def pct(measured: float, predicted: float) -> str:
    return f"{(predicted - measured) / measured * 100:+.1f}%"


def report(runs: list[list[dict[str, Any]]], names: list[str]) -> str:
    hw = Cluster.parse("h100:1x1").hardware
    eff = efficiency_for(hw, None)
    lines: list[str] = []
    env = next(r for r in runs[0] if r["section"] == "env")
    lines += ["# One H100, measured", "",
              f"Device: {env['name']}, {env['sms']} SMs, {env['memory_bytes'] / 2**30:.1f} GiB; driver and "
              f"clocks (nvidia-smi: driver, max SM MHz, max memory MHz, power limit, temperature): "
              f"`{env['nvidia_smi']}`; torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, "
              f"Python {env['python']}.", "",
              "Runs (`bash benchmarks/gpu_check.sh OUT [steps]` on a lent machine, 2026-11-27; raw rows: "
              + ", ".join(f"`{n}`" for n in names) + "). Run 1: every section, kernels as they were; "
              "run 2: kernels after the first fixes (norm backwards on 4 programs per SM, bias+GeLU "
              "backward on a 2-D grid, the cross-entropy weight-gradient GEMM in bf16), training steps "
              "again; run 3: kernels again with GPU-busy time. Each run started a fresh machine.", "",
              "torch 2.11 is what the machine has (nothing can be installed there beyond small wheels); "
              "autopar requires torch >= 2.13, so the per-op program's failure below is on an "
              "unsupported torch, and everything else ran on the machine's own torch.", ""]
    # ceilings and calibration
    calib = [r for r in runs[0] if r["section"] == "calib"]
    copy = next(r for r in calib if r["kind"] == "copy")
    bw = hw.memory_bandwidth_bytes_per_s
    lines += ["## Calibration: what the `h100` profile assumes against what ran (run 1, one run each)", "",
              "Memory-bound ops (1 Gi bf16 elements; bytes read + written; do_bench median, L2 flushed):", "",
              "| op | GB/s measured | of the datasheet 3350 GB/s | profile's achievable (memory_efficiency) |",
              "| --- | ---: | ---: | ---: |"]
    for r in calib:
        if r["kind"] in ("copy", "memory_op"):
            name = r.get("op", "copy")
            gbps = r["gb_per_s"]
            note = ""
            if name == "add":  # torch.add(src, src): one tensor read twice in one kernel
                gbps = r["bytes"] * 2 / 3 / (r["ms"] * 1e-3) / 1e9
                note = " (src + src: the one input is read once, so 2 passes)"
            lines.append(f"| {name}{note} | {gbps:,.0f} | {gbps * 1e9 / bw:.2f} | {eff.memory_efficiency:.3f} |")
    lines += ["", "GEMMs (forward shapes at 8192 tokens, bf16, random inputs):", "",
              "| GEMM (m x n x k) | measured ms | TFLOP/s | of 989 | priced ms | priced / measured |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in calib:
        if r["kind"] == "gemm":
            priced = gemm_time_s(1, r["m"], r["n"], r["k"], r["bytes"], hw, "bfloat16") * 1e3
            lines.append(f"| {r['shape']} {r['m']}x{r['n']}x{r['k']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                         f"{r['tflops'] * 1e12 / PEAK_BF16:.3f} | {priced:.3f} | {priced / r['ms']:.2f} |")
    lines += ["", "Fused attention (SDPA flash, causal, head dim 64, batch 4 x 2048; FLOPs: forward "
              "4·b·h·s²·d halved for causality, backward 2.5x the forward):", "",
              "| heads | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | priced fwd+bwd ms | priced / measured |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in calib:
        if r["kind"] == "attention":
            work = 4.0 * r["batch"] * r["heads"] * r["seq"] ** 2 * r["head_dim"]
            io = 4 * r["batch"] * r["heads"] * r["seq"] * r["head_dim"] * 2
            priced = (compute_time_s(work, io, hw, "bfloat16", op_class="attention", causal=True)
                      + compute_time_s(2.5 * work, 2 * io, hw, "bfloat16", op_class="attention", causal=True)) * 1e3
            lines.append(f"| {r['heads']} | {r['ms_fwd']:.3f} | {r['tflops_fwd_causal']:.0f} | {r['ms_fwd_bwd']:.3f} | "
                         f"{r['tflops_fwd_bwd_causal']:.0f} | {priced:.3f} | {priced / r['ms_fwd_bwd']:.2f} |")
    rate = PEAK_BF16 * hw.attention_fraction * eff.flash_attention_efficiency
    lines += ["", f"The profile prices attention at {rate / 1e12:.0f} TFLOP/s (989 x attention_fraction "
              f"{hw.attention_fraction} x flash_attention_efficiency {eff.flash_attention_efficiency}) and a "
              f"large GEMM at {PEAK_BF16 * hw.matmul_fraction * eff.gemm_efficiency / 1e12:.0f} TFLOP/s (989 x "
              f"matmul_fraction {hw.matmul_fraction} x gemm_efficiency {eff.gemm_efficiency}); the copy "
              f"ceiling measured {copy['gb_per_s']:,.0f} GB/s.", ""]
    # kernels
    lines += ["## Fused kernels vs eager vs torch.compile (forward + backward, bf16, 8192 tokens)", "",
              "ms: do_bench median (CUDA events around one forward + backward; includes the GPU waiting "
              "on the host's launches). busy: the profiler's GPU kernel time per call (run 3 only). "
              "GB/s: the pricing hook's bytes for the fused kernel (`codegen/kernels/pricing.py`) over "
              "its busy time. err: ||y - ref|| / ||ref|| against float64 on the same bf16 inputs, worst "
              "of the output and every input gradient.", "",
              "| pattern (shape) | eager ms | compile ms | fused ms run 1 | fused ms run 2 | fused ms run 3 | "
              "eager / compile / fused busy ms | fused GB/s (of 3350) | err eager | err fused |",
              "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    by_run = [{r["pattern"]: r for r in run if r["section"] == "kernels"} for run in runs]
    for pattern, last in by_run[-1].items():
        fused = [b[pattern].get("fused_ms") for b in by_run if pattern in b]
        busy = [last.get(f"{v}_busy_ms") for v in ("eager", "compile", "fused")]
        gbps = last["fused_bytes"] / (last["fused_busy_ms"] * 1e-3) / 1e9 if last.get("fused_busy_ms") else float("nan")
        err = {v: max(last["errors"][v].values()) for v in ("eager", "fused")}
        lines.append(f"| {pattern} {tuple(last['shape'])} | {last['eager_ms']:.3f} | {last['compile_ms']:.3f} | "
                     + " | ".join(f"{f:.3f}" for f in fused) + " | "
                     + " / ".join(f"{b:.3f}" for b in busy) + f" | {gbps:,.0f} ({gbps * 1e9 / bw:.2f}) | "
                     f"{err['eager']:.4f} | {err['fused']:.4f} |")
    lines.append("")
    # training step
    trains = [r for run in runs for r in run if r["section"] == "train"]
    model = trains[0]["model"]
    batch = trains[0]["batch"]
    priced = {False: price(model, batch, False), True: price(model, batch, True)}
    model_flops = priced[False]["model_tflops_per_device"] * 1e12 * priced[False]["step_time_s"]
    lines += [f"## A training step: `{model}` ({trains[0]['params'] / 1e9:.2f}B parameters), batch "
              f"{batch} x {trains[0]['seq']}", "",
              "bf16 autocast over fp32 parameters, fused AdamW, 20 measured steps after 3 warm-up steps, "
              "one GPU; step = median. Priced: the closed-form baseline (`benchmarks/baselines/analytic/`, the "
              f"configuration `--global-batch {batch} --micro-batch {batch}` on `h100:1x1`, bf16; its torch.compile "
              "option for the compiled row). MFU: the price's model FLOPs per step "
              f"({model_flops / 1e12:.1f} TFLOP) over the step time and 989 TFLOP/s.", "",
              "| variant | run | step s (min-max) | tokens/s | MFU | peak GiB | priced step s | step error | "
              "priced peak GiB | peak error | first / last loss |",
              "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for i, run in enumerate(runs, 1):
        for r in run:
            if r["section"] != "train":
                continue
            p = priced[r["variant"] == "compile"]
            step = r["step_s_median"]
            peak = r["peak_bytes"] / 2**30
            ppeak = p["peak_memory_bytes"] / 2**30
            lines.append(f"| {r['variant']} | {i} | {step:.4f} ({r['step_s_min']:.4f}-{r['step_s_max']:.4f}) | "
                         f"{r['tokens_per_s']:,.0f} | {model_flops / step / PEAK_BF16:.1%} | {peak:.2f} | "
                         f"{p['step_time_s']:.4f} | {pct(step, p['step_time_s'])} | {ppeak:.2f} | "
                         f"{pct(peak, ppeak)} | {r['first_loss']:.3f} / {r['last_loss']:.4f} |")
    failures = [r for run in runs for r in run if r["section"] == "error"]
    for i, run in enumerate(runs, 1):
        for r in run:
            if r["section"] == "error":
                lines.append(f"| {r['variant']} (autopar per-op program) | {i} | failed: "
                             f"{r['error'].splitlines()[0][:160]} | | | | | | | | |")
    lines.append("")
    bd = priced[False]["time_breakdown"]
    lines += [f"Priced terms (eager): compute {bd['compute_s'] * 1e3:.1f} ms, optimizer "
              f"{bd['optimizer_s'] * 1e3:.1f} ms. Priced terms (compiled): compute "
              f"{priced[True]['time_breakdown']['compute_s'] * 1e3:.1f} ms.", ""]
    if not failures:
        lines.append("No section failed.")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    try:
        runs = load(args.runs)
        if not any(r.get("section") == "env" for r in runs[0]):
            raise ValueError("its first file has no env row")
    except (OSError, ValueError) as exc:
        parser.error(f"{exc}; give the gpu_check.jsonl files a GPU run wrote (benchmarks/gpu_check.sh OUT), "
                     "e.g. benchmarks/results/gpu_h100_run1.jsonl")
    text = report(runs, [str(p.relative_to(ROOT)) if p.is_absolute() else str(p) for p in args.runs])
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
