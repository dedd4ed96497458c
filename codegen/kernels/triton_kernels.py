"""Triton kernels (forward and backward) for the memory-bound hot spots, plus launchers.

Where it sits: `codegen/kernels/ops.py` imports this module lazily, only when an op runs on
a CUDA tensor or under `TRITON_INTERPRET=1` (this CPU-only machine runs Triton solely in the
interpreter). Nothing else in autopar imports triton.

Each kernel reads its inputs once, computes in float32 registers, and writes its outputs
once: that single pass over memory is the whole point (these ops are bandwidth-bound).
Row kernels (norms, cross-entropy) give one program a full row; `BLOCK_N` is the next power
of two of the row length, so rows up to 64K elements fit. No `@triton.autotune`: it needs a
GPU driver (fails in the interpreter); block sizes are fixed per launch instead.

Launchers take contiguous tensors (the ops make them so) flattened to (num_rows, row_len).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

ELEMENTWISE_BLOCK = 1024
"""Elements per program for pointwise kernels: large enough to amortise launch overhead."""
VOCAB_BLOCK = 1024
"""Vocabulary entries per loop step in the cross-entropy kernels (online max/sum-exp)."""
NORM_BWD_PROGRAMS = 64
"""Programs in a row-blocked backward off a GPU (the interpreter); on a GPU, BWD_PROGRAMS_PER_SM
per multiprocessor. Each reduces its rows' weight grads before one final sum."""
BWD_PROGRAMS_PER_SM = 4
"""64 programs of one row at a time occupy under half of an H100's 132 SMs; four per SM keep
every SM busy, and the partial sums they leave are 528 x N floats, summed once. Measured after
the change only (benchmarks/results/gpu_h100.md, run 3): LayerNorm forward + backward at
8192 x 4096 bf16 takes 0.167 ms of GPU time, torch.compile's 0.170, eager's 0.220."""
COLUMN_BLOCK = 1024
"""Columns per program in the bias+GeLU backward, which needs no row reduction: a 2-D grid of
row blocks x column blocks, instead of whole rows (8192-16384 floats in registers) per program."""

_GELU_K = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


# ---------------------------------------------------------------------------------------
# RMSNorm


@triton.jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, N, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW_PARTIAL, M, N, rows_per_program,
                         BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(0, rows_per_program):
        row = pid * rows_per_program + i
        # a vector mask: the interpreter rejects scalar-and-vector mask combinations
        mask = cols < tl.where(row < M, N, 0)
        safe_row = tl.minimum(row, M - 1)  # rows past M read real stats, their dy is 0
        x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + safe_row)
        g = dy * w
        dx = rstd * g - x * rstd * rstd * rstd * (tl.sum(g * x, axis=0) / N)
        tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * x * rstd
    tl.store(DW_PARTIAL + pid * N + cols, dw, mask=col_mask)


def rms_norm_fwd(x2d: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x2d.shape
    y = torch.empty_like(x2d)
    rstd = torch.empty(m, dtype=torch.float32, device=x2d.device)
    block = triton.next_power_of_2(n)
    _rms_norm_fwd_kernel[(m,)](x2d, weight, y, rstd, n, eps, BLOCK_N=block, num_warps=_row_warps(block))
    return y, rstd


def _program_cap(device: torch.device) -> int:
    """Programs a row-blocked backward spreads its rows over on `device`."""
    if device.type == "cuda":
        return BWD_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return NORM_BWD_PROGRAMS


def _row_split(m: int, device: torch.device, column_blocks: int = 1) -> tuple[int, int]:
    """(row blocks, rows per block) of a backward over m rows whose grid also has
    `column_blocks` column blocks: about `_program_cap` programs in all."""
    programs = max(1, min(m, -(-_program_cap(device) // column_blocks)))
    return programs, -(-m // programs)


def _row_warps(block_n: int) -> int:
    """Warps for a program holding a whole row of block_n elements: 8 for rows of 2048 and
    more, so a 4096-wide row is 16 floats per thread, not 32 (Triton's layer-norm tutorial
    sizes them the same way)."""
    return min(max(block_n // 256, 1), 8)


def rms_norm_bwd(dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor,
                 rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x2d.shape
    programs, rows = _row_split(m, x2d.device)
    dx = torch.empty_like(x2d)
    dw_partial = torch.empty(programs, n, dtype=torch.float32, device=x2d.device)
    block = triton.next_power_of_2(n)
    _rms_norm_bwd_kernel[(programs,)](dy2d, x2d, weight, rstd, dx, dw_partial, m, n, rows,
                                      BLOCK_N=block, num_warps=_row_warps(block))
    return dx, dw_partial.sum(0).to(weight.dtype)


# ---------------------------------------------------------------------------------------
# LayerNorm


@triton.jit
def _layer_norm_fwd_kernel(X, W, B, Y, MEAN, RSTD, N, eps, HAS_BIAS: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / N + eps)
    y = xc * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _layer_norm_bwd_kernel(DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, M, N,
                           rows_per_program, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(0, rows_per_program):
        row = pid * rows_per_program + i
        # a vector mask: the interpreter rejects scalar-and-vector mask combinations
        mask = cols < tl.where(row < M, N, 0)
        safe_row = tl.minimum(row, M - 1)  # rows past M read real stats, their dy is 0
        x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + safe_row)
        rstd = tl.load(RSTD + safe_row)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        g = dy * w
        dx = rstd * (g - tl.sum(g, axis=0) / N - xhat * (tl.sum(g * xhat, axis=0) / N))
        tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    tl.store(DW_PARTIAL + pid * N + cols, dw, mask=col_mask)
    tl.store(DB_PARTIAL + pid * N + cols, db, mask=col_mask)


def layer_norm_fwd(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, n = x2d.shape
    y = torch.empty_like(x2d)
    mean = torch.empty(m, dtype=torch.float32, device=x2d.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x2d.device)
    # With no bias, weight stands in for the pointer; HAS_BIAS=False never reads it.
    block = triton.next_power_of_2(n)
    _layer_norm_fwd_kernel[(m,)](x2d, weight, weight if bias is None else bias, y, mean, rstd, n, eps,
                                 HAS_BIAS=bias is not None, BLOCK_N=block, num_warps=_row_warps(block))
    return y, mean, rstd


def layer_norm_bwd(dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                   rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, n = x2d.shape
    programs, rows = _row_split(m, x2d.device)
    dx = torch.empty_like(x2d)
    dw_partial = torch.empty(programs, n, dtype=torch.float32, device=x2d.device)
    db_partial = torch.empty(programs, n, dtype=torch.float32, device=x2d.device)
    block = triton.next_power_of_2(n)
    _layer_norm_bwd_kernel[(programs,)](dy2d, x2d, weight, mean, rstd, dx, dw_partial, db_partial,
                                        m, n, rows, BLOCK_N=block, num_warps=_row_warps(block))
    return dx, dw_partial.sum(0).to(weight.dtype), db_partial.sum(0).to(weight.dtype)


# ---------------------------------------------------------------------------------------
# SwiGLU: silu(gate) * up


@triton.jit
def _swiglu_fwd_kernel(GATE, UP, Y, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, GATE, UP, DGATE, DUP, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(DGATE + offs, (dy * u * (s + g * s * (1.0 - s))).to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + offs, (dy * g * s).to(DUP.dtype.element_ty), mask=mask)


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(gate)
    numel = gate.numel()
    _swiglu_fwd_kernel[(triton.cdiv(numel, ELEMENTWISE_BLOCK),)](gate, up, y, numel, BLOCK=ELEMENTWISE_BLOCK)
    return y


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    numel = gate.numel()
    _swiglu_bwd_kernel[(triton.cdiv(numel, ELEMENTWISE_BLOCK),)](dy, gate, up, dgate, dup, numel,
                                                                 BLOCK=ELEMENTWISE_BLOCK)
    return dgate, dup


# ---------------------------------------------------------------------------------------
# bias + GeLU (tanh approximation)


@triton.jit
def _bias_gelu_fwd_kernel(X, BIAS, Y, numel, N, K: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) + \
        tl.load(BIAS + offs % N, mask=mask, other=0.0).to(tl.float32)
    # tanh(u) = 2 sigmoid(2u) - 1: tl has no tanh that also runs in the interpreter, and a
    # nested @triton.jit helper breaks when triton was imported before TRITON_INTERPRET was set.
    t = 2.0 * tl.sigmoid(2.0 * K * (z + C * z * z * z)) - 1.0
    tl.store(Y + offs, (0.5 * z * (1.0 + t)).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(DY, X, BIAS, DX, DBIAS_PARTIAL, M, N, rows_per_program, K: tl.constexpr,
                          C: tl.constexpr, BLOCK_C: tl.constexpr):
    # A 2-D grid: program (r, c) walks rows [r * rows_per_program, ...) of column block c.
    # dbias is reduced in registers, so dx is written once and never read back for the bias
    # gradient; no program holds a whole row.
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < N
    bias = tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)
    dbias = tl.zeros([BLOCK_C], dtype=tl.float32)
    for i in range(0, rows_per_program):
        row = pid * rows_per_program + i
        mask = cols < tl.where(row < M, N, 0)  # vector mask (see _rms_norm_bwd_kernel)
        z = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32) + bias
        t = 2.0 * tl.sigmoid(2.0 * K * (z + C * z * z * z)) - 1.0
        dgelu = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * K * (1.0 + 3.0 * C * z * z)
        dx = tl.load(DY + row * N + cols, mask=mask, other=0.0).to(tl.float32) * dgelu
        tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dbias += tl.where(mask, dx, 0.0)
    tl.store(DBIAS_PARTIAL + pid * N + cols, dbias, mask=col_mask)


def bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    numel = x.numel()
    _bias_gelu_fwd_kernel[(triton.cdiv(numel, ELEMENTWISE_BLOCK),)](
        x, bias, y, numel, bias.numel(), K=_GELU_K, C=_GELU_C, BLOCK=ELEMENTWISE_BLOCK)
    return y


def bias_gelu_bwd(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = bias.numel()
    m = x.numel() // n
    block = min(COLUMN_BLOCK, triton.next_power_of_2(n))
    column_blocks = triton.cdiv(n, block)
    programs, rows = _row_split(m, x.device, column_blocks)
    dx = torch.empty_like(x)
    dbias_partial = torch.empty(programs, n, dtype=torch.float32, device=x.device)
    _bias_gelu_bwd_kernel[(programs, column_blocks)](dy, x, bias, dx, dbias_partial, m, n, rows, K=_GELU_K,
                                                     C=_GELU_C, BLOCK_C=block)
    return dx, dbias_partial.sum(0).to(bias.dtype)


# ---------------------------------------------------------------------------------------
# cross-entropy over a (local) vocabulary slice, one chunk of rows at a time


@triton.jit
def _ce_stats_kernel(LOGITS, LABELS, MAX, SUMEXP, TARGET, V, vocab_start, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = LOGITS + row * V
    m = -float("inf")
    s = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # online softmax: rescale the running sum to the new max
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    local = tl.load(LABELS + row) - vocab_start
    here = (local >= 0) & (local < V)
    target = tl.load(base + tl.where(here, local, 0)).to(tl.float32)
    tl.store(MAX + row, m)
    tl.store(SUMEXP + row, s)
    tl.store(TARGET + row, tl.where(here, target, 0.0))


@triton.jit
def _ce_grad_kernel(LOGITS, LABELS, LSE, SCALE, GRAD, V, vocab_start, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    lse = tl.load(LSE + row)
    scale = tl.load(SCALE + row)
    local = tl.load(LABELS + row) - vocab_start
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(LOGITS + row * V + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(cols == local, 1.0, 0.0)
        tl.store(GRAD + row * V + cols, g * scale, mask=mask)


def ce_chunk_stats(logits: torch.Tensor, labels: torch.Tensor,
                   vocab_start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, v = logits.shape
    out = [torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3)]
    block = min(VOCAB_BLOCK, triton.next_power_of_2(v))
    _ce_stats_kernel[(rows,)](logits, labels, *out, v, vocab_start, BLOCK_V=block)
    return out[0], out[1], out[2]


def ce_chunk_grad(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                  vocab_start: int) -> torch.Tensor:
    rows, v = logits.shape
    grad = torch.empty(rows, v, dtype=torch.float32, device=logits.device)
    block = min(VOCAB_BLOCK, triton.next_power_of_2(v))
    _ce_grad_kernel[(rows,)](logits, labels, lse, scale, grad, v, vocab_start, BLOCK_V=block)
    return grad
