"""Fused kernels vs eager vs torch.compile on a GPU: time and peak memory, forward + backward.

Shapes are Llama-3-8B / GPT-3-like per-rank activations (8192 tokens, bf16). Each case runs
one forward and one backward of the pattern; time is the median over `--iters` after warm-up,
memory is the peak allocated above the inputs (torch.cuda.max_memory_allocated).
Without CUDA (this CPU-only machine) it prints the pricing hook's bytes-moved figures and
says why it cannot time anything: Triton only runs in its interpreter here (~1000x slower
than eager), so CPU timings would measure the interpreter, not the kernels.
Run: .venv/bin/python benchmarks/bench_kernels.py [--iters 20] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from codegen.kernels.pricing import PATTERNS, fused_bytes_moved, unfused_bytes_moved

HIDDEN, FFN, GPT_FFN, VOCAB = 4096, 14336, 16384, 128256


def _cases(tokens: int) -> dict[str, tuple[Callable[[], tuple[torch.Tensor, ...]], Callable[..., torch.Tensor],
                                           Callable[..., torch.Tensor], tuple[int, ...]]]:
    """pattern -> (make inputs, eager fn, fused fn, shape priced by pricing.py)."""
    from codegen.kernels import ops
    from codegen.kernels.cross_entropy import vocab_parallel_cross_entropy

    dev, dt = "cuda", torch.bfloat16

    def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=dev, dtype=dt) * scale).requires_grad_()

    labels = torch.randint(0, VOCAB, (tokens,), device=dev)
    return {
        "rms_norm": (lambda: (leaf(tokens, HIDDEN), leaf(HIDDEN)),
                     lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w,
                     lambda x, w: ops.rms_norm(x, w, 1e-5), (tokens, HIDDEN)),
        "layer_norm": (lambda: (leaf(tokens, HIDDEN), leaf(HIDDEN), leaf(HIDDEN)),
                       lambda x, w, b: F.layer_norm(x, (HIDDEN,), w, b),
                       lambda x, w, b: ops.layer_norm(x, w, b, 1e-5), (tokens, HIDDEN)),
        "swiglu": (lambda: (leaf(tokens, FFN), leaf(tokens, FFN)),
                   lambda g, u: F.silu(g) * u, ops.swiglu, (tokens, FFN)),
        "bias_gelu": (lambda: (leaf(tokens, GPT_FFN), leaf(GPT_FFN)),
                      lambda x, b: F.gelu(x + b, approximate="tanh"), ops.bias_gelu, (tokens, GPT_FFN)),
        "cross_entropy": (lambda: (leaf(tokens, HIDDEN), leaf(VOCAB, HIDDEN, scale=0.02)),
                          lambda h, w: F.cross_entropy((h @ w.t()).float(), labels),
                          lambda h, w: vocab_parallel_cross_entropy(h, w, labels, chunk_tokens=1024),
                          (tokens, VOCAB)),
    }


def _measure(fn: Callable[..., torch.Tensor], make: Callable[[], tuple[torch.Tensor, ...]],
             iters: int) -> tuple[float, int]:
    inputs = make()

    def step() -> None:
        out = fn(*inputs)
        out.backward(torch.ones_like(out))
        for t in inputs:
            t.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times_s = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times_s.append(time.perf_counter() - start)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return statistics.median(times_s), torch.cuda.max_memory_allocated() - base


def _print_pricing(tokens: int) -> None:
    shapes = {"rms_norm": (tokens, HIDDEN), "layer_norm": (tokens, HIDDEN), "swiglu": (tokens, FFN),
              "bias_gelu": (tokens, GPT_FFN), "cross_entropy": (tokens, VOCAB)}
    print(f"pricing hook, bf16, {tokens} tokens (bytes moved per forward+backward):")
    for pattern in PATTERNS:
        fused = fused_bytes_moved(pattern, shapes[pattern], 2)
        unfused = unfused_bytes_moved(pattern, shapes[pattern], 2)
        print(f"  {pattern:<14} {str(shapes[pattern]):<16} fused {fused / 2**30:7.2f} GiB  "
              f"unfused {unfused / 2**30:7.2f} GiB  ({unfused / fused:4.2f}x)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    _print_pricing(args.tokens)
    if not torch.cuda.is_available():
        print("SKIPPED timings: no CUDA device (torch.cuda.is_available() is False). The fused kernels "
              "are Triton GPU kernels; on CPU Triton runs only in its interpreter, so CPU timings would "
              "measure the interpreter. Their correctness is covered by tests/kernels (interpreter mode).")
        return 0
    print(f"\n{torch.cuda.get_device_name()}, bf16, {args.tokens} tokens, fwd+bwd, median of {args.iters}:")
    print(f"  {'pattern':<14} {'eager ms':>9} {'compile ms':>10} {'fused ms':>9} "
          f"{'eager MiB':>10} {'compile MiB':>11} {'fused MiB':>10}")
    for pattern, (make, eager, fused, _shape) in _cases(args.tokens).items():
        rows = [_measure(fn, make, args.iters) for fn in (eager, torch.compile(eager), fused)]
        times = " ".join(f"{t * 1e3:9.3f}" if i != 1 else f"{t * 1e3:10.3f}" for i, (t, _) in enumerate(rows))
        mems = " ".join(f"{m / 2**20:10.1f}" if i != 1 else f"{m / 2**20:11.1f}" for i, (_, m) in enumerate(rows))
        print(f"  {pattern:<14} {times} {mems}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
