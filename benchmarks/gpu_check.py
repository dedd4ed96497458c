"""One GPU, measured: the device's ceilings, the fused kernels, and a training step.

Sections (each one a separate process in `benchmarks/gpu_check.sh`, so a failure or a
hang in one leaves the others' figures), each appending JSON lines to `--out`:
- env: device, driver, torch / triton / CUDA versions.
- calib: the two ceilings (a 2 GiB device-to-device copy, bytes read + written; an
  8192^3 bf16 GEMM), the GEMMs of a llama3-8b and a ~1B Llama layer at 8192 tokens
  (forward shapes; TFLOP/s against the h100 profile's matmul rate), memory-bound op
  bandwidth (add, mul, bf16->fp32 cast), and fused attention (SDPA flash, causal, fwd+bwd)
  at the ~1B Llama's shape: what `autopar calibrate` would measure on a GPU.
- kernels: each fused Triton kernel (RMSNorm, LayerNorm, SwiGLU, bias+GeLU, chunked
  cross-entropy; forward + backward, bf16, 8192 tokens, llama3-8b / gpt3 widths) against
  eager and torch.compile of the same function: median time (triton.testing.do_bench,
  CUDA events), bytes moved as `codegen/kernels/pricing.py` counts them -> GB/s, and
  numerics: ||out - ref|| / ||ref|| of the output and every input gradient against float64
  on the same bf16 inputs, for eager and fused alike.
- train: a ~1.5B Llama (llama3 widths at 16 layers, hidden 2048: Llama 3.2 1B's shape with
  untied embeddings), bf16 autocast over fp32 parameters, fused AdamW, batch 4 x 2048,
  20 measured steps after 3 warm-up steps; variants eager / fused (the fused modules of
  codegen/kernels swapped in) / compile (torch.compile of the model) / autopar (the per-op
  program of `autopar.compile` on a one-rank NCCL world, bf16 parameters). Tokens/s, peak
  memory (torch.cuda.max_memory_allocated), first and last loss.
The report (measured against `autopar price` with the h100 profile) is written on the CPU
machine by `benchmarks/gpu_report.py` from these JSON lines.

Run (a GPU machine): bash benchmarks/gpu_check.sh OUTDIR
Smoke test of the code paths on a CPU (tiny shapes, no timings worth reading):
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/gpu_check.py --section kernels --smoke --out /tmp/g.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HIDDEN, FFN, GPT_HIDDEN, GPT_FFN, VOCAB = 4096, 14336, 2048, 8192, 128256
TRAIN_MODEL = "llama:layers=16,hidden=2048,heads=32,kv_heads=8,ffn=8192,vocab=128256,seq=2048"
TRAIN_BATCH = 4
LR = 1e-4


def emit(out: Path, section: str, **fields: Any) -> None:
    row = {"section": section, **fields}
    print(json.dumps(row), flush=True)
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_ms(fn: Callable[[], Any], *, warmup_ms: float = 50, rep_ms: float = 300) -> float:
    """Median ms per call: triton's do_bench (CUDA events, L2 flushed between calls) on a GPU,
    a wall clock elsewhere (the smoke test)."""
    if torch.cuda.is_available():
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def gpu_busy_ms(fn: Callable[[], Any], iters: int = 5) -> float:
    """Device time per call: the sum of the GPU's kernel (and copy) intervals the profiler
    records over `iters` calls, over iters. Beside `bench_ms`, which also counts the GPU
    idling while the host launches (Python dispatch of custom ops, Triton's launcher)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        sync()
    busy_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return busy_us / iters / 1e3


# ---------------------------------------------------------------------------------------
# env


def section_env(out: Path, smoke: bool) -> None:
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available(), "python": sys.version.split()[0]}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, sms=props.multi_processor_count, memory_bytes=props.total_memory,
                    capability=f"{props.major}.{props.minor}")
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem,"
                                  "power.limit,temperature.gpu", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            info["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            info["nvidia_smi"] = f"failed: {exc}"
    emit(out, "env", **info)


# ---------------------------------------------------------------------------------------
# calib: ceilings, layer GEMMs, memory-bound ops, attention


def gemm_shapes(smoke: bool) -> dict[str, tuple[int, int, int]]:
    """name -> (m, n, k) of y[m, n] = x[m, k] @ w[k, n], forward, 8192 tokens."""
    t = 64 if smoke else 8192
    s = 16 if smoke else 1
    return {
        "ceiling 8192^3": (8192 // (128 if smoke else 1),) * 3,
        "8b qkv (4096->6144)": (t, 6144 // s, HIDDEN // s),
        "8b o (4096->4096)": (t, HIDDEN // s, HIDDEN // s),
        "8b w1|w3 (4096->14336)": (t, FFN // s, HIDDEN // s),
        "8b w2 (14336->4096)": (t, HIDDEN // s, FFN // s),
        "8b logits (4096->128256)": (t, VOCAB // s, HIDDEN // s),
        "1b qkv (2048->3072)": (t, 3072 // s, 2048 // s),
        "1b o (2048->2048)": (t, 2048 // s, 2048 // s),
        "1b w1|w3 (2048->8192)": (t, 8192 // s, 2048 // s),
        "1b w2 (8192->2048)": (t, 2048 // s, 8192 // s),
    }


def section_calib(out: Path, smoke: bool) -> None:
    dev = device()
    dt = torch.bfloat16
    # copy ceiling: bytes read + written
    n = (1 << 20) if smoke else (1 << 30)  # 1 Gi bf16 elements = 2 GiB
    src = torch.randn(n, device=dev, dtype=dt)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    emit(out, "calib", kind="copy", elements=n, bytes=2 * src.nbytes, ms=ms,
         gb_per_s=2 * src.nbytes / (ms * 1e-3) / 1e9)
    for name, fn, passes in (("add", lambda: torch.add(src, src, out=dst), 3),
                             ("mul_scalar", lambda: torch.mul(src, 1.0001, out=dst), 2)):
        ms = bench_ms(fn)
        emit(out, "calib", kind="memory_op", op=name, elements=n, bytes=passes * src.nbytes, ms=ms,
             gb_per_s=passes * src.nbytes / (ms * 1e-3) / 1e9)
    wide = torch.empty(n, device=dev, dtype=torch.float32)
    ms = bench_ms(lambda: wide.copy_(src))
    emit(out, "calib", kind="memory_op", op="cast_bf16_fp32", elements=n, bytes=src.nbytes + wide.nbytes,
         ms=ms, gb_per_s=(src.nbytes + wide.nbytes) / (ms * 1e-3) / 1e9)
    del src, dst, wide
    # GEMMs: forward shapes of the layers
    for name, (m, nn_, k) in gemm_shapes(smoke).items():
        a = torch.randn(m, k, device=dev, dtype=dt)
        b = torch.randn(k, nn_, device=dev, dtype=dt) / k ** 0.5
        ms = bench_ms(lambda: a @ b)
        emit(out, "calib", kind="gemm", shape=name, m=m, n=nn_, k=k, ms=ms,
             tflops=2.0 * m * nn_ * k / (ms * 1e-3) / 1e12,
             bytes=(m * k + k * nn_ + m * nn_) * 2)
        del a, b
    # fused attention, causal, fwd + bwd, the ~1B Llama's shape (and llama3-8b's head count)
    batch, seq, hd = (1, 128, 64) if smoke else (4, 2048, 64)
    for heads in ((4,) if smoke else (32, 16)):
        q, k, v = (torch.randn(batch, heads, seq, hd, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
        grad = torch.randn(batch, heads, seq, hd, device=dev, dtype=dt)

        def fwd_bwd() -> None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y.backward(grad)

        def fwd() -> None:
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        ms_fb, ms_f = bench_ms(fwd_bwd), bench_ms(fwd)
        full = 4.0 * batch * heads * seq * seq * hd  # QK^T and PV, non-causal forward
        # fwd + bwd = 3.5x the forward's matmul work (FlashAttention-2 convention: bwd 2.5x);
        # causal halves it
        emit(out, "calib", kind="attention", batch=batch, heads=heads, seq=seq, head_dim=hd,
             ms_fwd=ms_f, ms_fwd_bwd=ms_fb,
             tflops_fwd_causal=0.5 * full / (ms_f * 1e-3) / 1e12,
             tflops_fwd_bwd_causal=0.5 * 3.5 * full / (ms_fb * 1e-3) / 1e12)
        del q, k, v, grad


# ---------------------------------------------------------------------------------------
# kernels


def kernel_cases(tokens: int, smoke: bool) -> dict[str, tuple[Callable[[], tuple[torch.Tensor, ...]],
                                                            Callable[..., torch.Tensor],
                                                            Callable[..., torch.Tensor], tuple[int, ...]]]:
    """pattern -> (make inputs, eager fn, fused fn, shape priced by pricing.py)."""
    from codegen.kernels import ops
    from codegen.kernels.cross_entropy import vocab_parallel_cross_entropy

    dev, dt = device(), torch.bfloat16
    s = 32 if smoke else 1
    hidden, ffn, gffn, vocab = HIDDEN // s, FFN // s, GPT_FFN // s, VOCAB // s

    def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=dev, dtype=dt) * scale).requires_grad_()

    labels = torch.randint(0, vocab, (tokens,), device=dev)
    return {
        "rms_norm": (lambda: (leaf(tokens, hidden), leaf(hidden)),
                     lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w,
                     lambda x, w: ops.rms_norm(x, w, 1e-5), (tokens, hidden)),
        "layer_norm": (lambda: (leaf(tokens, hidden), leaf(hidden), leaf(hidden)),
                       lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b),
                       lambda x, w, b: ops.layer_norm(x, w, b, 1e-5), (tokens, hidden)),
        "swiglu": (lambda: (leaf(tokens, ffn), leaf(tokens, ffn)),
                   lambda g, u: F.silu(g) * u, ops.swiglu, (tokens, ffn)),
        "bias_gelu": (lambda: (leaf(tokens, gffn), leaf(gffn)),
                      lambda x, b: F.gelu(x + b, approximate="tanh"), ops.bias_gelu, (tokens, gffn)),
        "cross_entropy": (lambda: (leaf(tokens, hidden), leaf(vocab, hidden, scale=0.02)),
                          lambda h, w: F.cross_entropy((h @ w.t()).float(), labels),
                          lambda h, w: vocab_parallel_cross_entropy(h, w, labels, chunk_tokens=min(1024, tokens)),
                          (tokens, vocab)),
    }


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def section_kernels(out: Path, smoke: bool) -> None:
    from codegen.kernels.pricing import fused_bytes_moved, unfused_bytes_moved

    tokens = 256 if smoke else 8192
    for pattern, (make, eager, fused, shape) in kernel_cases(tokens, smoke).items():
        inputs = make()
        # numerics: float64 reference on the same bf16 values
        ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
        ref_out = eager(*ref_inputs)
        g_out = torch.randn_like(ref_out)
        ref_out.backward(g_out)
        errors: dict[str, dict[str, float]] = {}
        for label, fn in (("eager", eager), ("fused", fused)):
            xs = [t.detach().clone().requires_grad_() for t in inputs]
            y = fn(*xs)
            y.backward(g_out.to(y.dtype))
            errors[label] = {"out": rel_err(y, ref_out),
                             **{f"grad{i}": rel_err(x.grad, r.grad) for i, (x, r) in enumerate(zip(xs, ref_inputs))}}
        del ref_inputs, ref_out
        # timing: one forward + backward, gradients dropped each call
        grad = g_out.to(torch.bfloat16 if pattern != "cross_entropy" else torch.float32)
        results: dict[str, float | str] = {}
        for label, fn in (("eager", eager), ("compile", torch.compile(eager)), ("fused", fused)):
            xs = [t.detach().clone().requires_grad_() for t in inputs]

            def step(fn: Callable[..., torch.Tensor] = fn, xs: list[torch.Tensor] = xs) -> None:
                y = fn(*xs)
                y.backward(grad if y.dim() else grad.reshape(()))
                for x in xs:
                    x.grad = None

            try:
                torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
                base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
                results[f"{label}_ms"] = bench_ms(step)
                results[f"{label}_peak_mib"] = ((torch.cuda.max_memory_allocated() - base) / 2**20
                                                if torch.cuda.is_available() else 0.0)
                if torch.cuda.is_available():
                    results[f"{label}_busy_ms"] = gpu_busy_ms(step)
            except Exception as exc:  # noqa: BLE001 (recorded: a variant that fails is a finding)
                results[f"{label}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        emit(out, "kernels", pattern=pattern, shape=list(shape), tokens=tokens,
             fused_bytes=fused_bytes_moved(pattern, shape, 2), unfused_bytes=unfused_bytes_moved(pattern, shape, 2),
             errors=errors, **results)
        del inputs
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


# ---------------------------------------------------------------------------------------
# train


def section_train(out: Path, smoke: bool, variant: str, steps: int) -> None:
    from autopar.models import resolve

    spec = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=32" if smoke else TRAIN_MODEL
    source = resolve(spec)
    torch.manual_seed(0)
    model = source.build()
    seq = source.config.seq
    dev = device()
    batch = tuple(t.to(dev) for t in source.example_inputs(TRAIN_BATCH, generator=torch.Generator().manual_seed(1)))
    params = sum(p.numel() for p in model.parameters())
    started = time.perf_counter()
    if variant == "autopar":
        step_fn = _autopar_step(model.to(torch.bfloat16), batch, smoke)
    else:
        if variant == "fused":
            from codegen.kernels.modules import swap_fused_modules

            model = swap_fused_modules(model)
        model = model.to(dev)
        if variant == "compile":
            model = torch.compile(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=dev == "cuda")

        def step_fn() -> float:
            with torch.autocast(dev, dtype=torch.bfloat16):
                loss = model(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

    losses = [step_fn() for _ in range(3)]
    setup_s = time.perf_counter() - started
    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        losses.append(step_fn())  # float(loss) synchronises
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    step_s = statistics.median(times)
    emit(out, "train", variant=variant, model=spec, params=params, batch=TRAIN_BATCH, seq=seq, steps=steps,
         step_s_median=step_s, step_s_min=min(times), step_s_max=max(times), setup_s=setup_s,
         tokens_per_s=TRAIN_BATCH * seq / step_s, peak_bytes=peak, first_loss=losses[0], last_loss=losses[-1],
         losses=losses)


def _autopar_step(model: Any, batch: tuple[torch.Tensor, ...], smoke: bool) -> Callable[[], float]:
    """The per-op program of autopar.compile on a one-rank world: NCCL where CUDA is (so the
    mesh is a CUDA mesh), gloo in the smoke test."""
    import functools
    import tempfile

    import torch.distributed as dist

    import autopar
    from autopar.config import ParallelConfig

    store = tempfile.NamedTemporaryFile(prefix="autopar-gpu-check-", delete=False).name
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", init_method=f"file://{store}",
                            rank=0, world_size=1)
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        # on the GPU before the trace: a CPU model traced with CUDA inputs fails in the
        # tracer's fake-tensor device propagation (seen on the first run, H100)
        model = model.to("cuda")
    mesh = "h100:1x1" if torch.cuda.is_available() else "cpu:1"
    compiled = autopar.compile(model, mesh, example_inputs=batch, optimizer=functools.partial(torch.optim.AdamW, lr=LR),
                               config=ParallelConfig(dp=1, tp=1, pp=1, micro_batch=TRAIN_BATCH))
    return lambda: float(compiled.step(batch))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", required=True, choices=("env", "calib", "kernels", "train"))
    parser.add_argument("--variant", default="eager", choices=("eager", "fused", "compile", "autopar"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, for a CPU check of the code paths")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.smoke and args.section != "env":
        print(f"SKIPPED {args.section}: no CUDA device (torch.cuda.is_available() is False). The fused kernels are "
              "Triton GPU kernels; on a CPU Triton runs only in its interpreter, so timings would measure the "
              "interpreter (tests/kernels checks their numerics there). --smoke runs the code paths at tiny shapes.")
        return 0
    try:
        if args.section == "env":
            section_env(args.out, args.smoke)
        elif args.section == "calib":
            section_calib(args.out, args.smoke)
        elif args.section == "kernels":
            section_kernels(args.out, args.smoke)
        else:
            section_train(args.out, args.smoke, args.variant, args.steps)
    except Exception as exc:  # noqa: BLE001 (the driver runs the next section regardless)
        emit(args.out, "error", of=args.section, variant=args.variant,
             error=f"{type(exc).__name__}: {exc}"[:2000], traceback=traceback.format_exc()[-4000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
