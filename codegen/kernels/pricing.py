"""Bytes moved by each fusable pattern, fused vs unfused: the cost model's pricing hook.

Where it sits: torch-free, so `cost_model/` can import it without loading torch or triton.
A memory-bound op's time is bytes / bandwidth; the cost model prices a pattern at
`fused_bytes_moved(...)` when codegen will fuse it (GPU targets) and at
`unfused_bytes_moved(...)` otherwise.

Unit: bytes moved to and from device memory for ONE training step of the pattern
(forward + backward), each tensor read or written counted once per kernel that touches it.
Terms for `shape` (the pattern's main activation) and `dtype_bytes` (its element size):
num_rows = prod(shape[:-1]), row_len = shape[-1], numel = num_rows * row_len. Per-row
statistics (rstd, mean, lse) are float32. Weight-sized vectors are row_len elements.

Pattern shapes:
- "rms_norm", "layer_norm": x, (..., hidden)
- "swiglu": the gate (w1 x) activation, (..., ffn)
- "bias_gelu": the fc output before the bias, (..., ffn)
- "cross_entropy": the logits, (tokens, local_vocab); passes over the logits only (GEMM
  reads of hidden and weight are the same fused or not and are priced with the GEMM).

Passes (full-size tensor reads + writes), counted from the traced eager ATen graphs of the
zoo models (`autopar.trace.trace(...).gm`) and from the kernels in `triton_kernels.py`:
- rms_norm: unfused fwd pow, mean, mul, mul = 7; bwd (13 pointwise/reduction ops) = 23.
  fused fwd read x, write y = 2; bwd read dy, x, write dx = 3.
- layer_norm: ATen's native_layer_norm is already one kernel each way: 2 + 3 both ways.
- swiglu: unfused fwd silu 2 + mul 3; bwd mul 3 + mul 3 + silu_backward 3 = 14.
  fused fwd read gate, up, write y = 3; bwd read dy, gate, up, write dgate, dup = 5.
- bias_gelu: unfused is mm, add(bias), gelu (a row-parallel layer keeps the bias apart):
  fwd add 2 + gelu 2; bwd gelu_backward 3 + bias-grad sum 1 = 8. fused fwd 2, bwd read dy,
  x, write dx = 3, dbias reduced in registers (5 in all). Against addmm+gelu (bias in the
  GEMM epilogue, 6) the saving is only the bias-grad pass.
- cross_entropy: unfused: mm writes logits 1, log_softmax 2, nll_loss_backward 1,
  log_softmax_backward 3, mm backward reads the grad twice 2 = 9. fused (chunked, recomputed):
  write 1 + stats read 1, recompute write 1 + grad kernel 2 + GEMM reads 2 = 7. The fused
  version's real gain is capacity: (chunk x vocab) live instead of (tokens x vocab).
"""

from __future__ import annotations

import math

STAT_BYTES = 4
"""Per-row statistics are float32."""

# pattern -> (fused passes, unfused passes, weight-sized vectors moved, per-row stats moved)
_FUSED: dict[str, tuple[int, int, int]] = {
    "rms_norm": (5, 3, 2),        # w read fwd+bwd, dw written; rstd written then read
    "layer_norm": (5, 5, 4),      # w, b read; dw, db written; mean, rstd written then read
    "swiglu": (8, 0, 0),
    "bias_gelu": (5, 3, 0),       # bias read fwd+bwd, dbias written
    "cross_entropy": (7, 0, 3),   # lse written, read back; label per row ~ one stat
}
_UNFUSED: dict[str, tuple[int, int, int]] = {
    "rms_norm": (30, 4, 6),       # w read twice, dw written via a sum; rstd-sized temporaries
    "layer_norm": (5, 5, 4),
    "swiglu": (14, 0, 0),
    "bias_gelu": (8, 3, 0),
    "cross_entropy": (9, 0, 3),
}
PATTERNS = tuple(sorted(_FUSED))


def _bytes(table: dict[str, tuple[int, int, int]], pattern: str, shape: tuple[int, ...], dtype_bytes: int) -> int:
    if pattern not in table:
        raise ValueError(f"unknown fusion pattern {pattern!r}; known patterns: {', '.join(PATTERNS)}")
    if not shape or any(d <= 0 for d in shape):
        raise ValueError(f"{pattern}: shape must be non-empty with positive dims, given {shape}")
    if dtype_bytes <= 0:
        raise ValueError(f"{pattern}: dtype_bytes must be positive, given {dtype_bytes}")
    passes, vectors, stats = table[pattern]
    num_rows = math.prod(shape[:-1])
    row_len = shape[-1]
    return (passes * num_rows * row_len * dtype_bytes + vectors * row_len * dtype_bytes
            + stats * num_rows * STAT_BYTES)


def fused_bytes_moved(pattern: str, shape: tuple[int, ...], dtype_bytes: int) -> int:
    """Bytes the fused kernel moves for one forward + backward of `pattern` on `shape`."""
    return _bytes(_FUSED, pattern, shape, dtype_bytes)


def unfused_bytes_moved(pattern: str, shape: tuple[int, ...], dtype_bytes: int) -> int:
    """Bytes eager ATen moves for the same forward + backward (the traced op sequence)."""
    return _bytes(_UNFUSED, pattern, shape, dtype_bytes)
