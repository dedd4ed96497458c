"""Grouped matrix multiply with the experts named: the op mixture-of-experts layers trace to,
in a form whose expert-parallel layout runs shard by shard.

Where it sits: shared by the trace (autopar/trace/capture.py rewrites Hugging Face's
`transformers.grouped_mm_fallback` and its backward into these ops), the strategy space
(autopar/dtensor_bridge.py registers their sharding rules), the pricing (their FLOPs in
autopar/trace/lowering.py) and the per-rank program, which runs them through DTensor's
dispatcher on each rank's shards.

Terms: rows x [S, K] are the routed token copies sorted by expert; `offs` [E] holds the
cumulative row counts (rows offs[e-1]..offs[e] go to expert e, offs[-1] read as 0);
weights w [E, K, N], one [K, N] matrix per expert. The forward is

    out[r] = x[r] @ w[e(r)]            e(r): the expert whose rows hold r

and the backward, for g = d loss / d out,

    grad_x[r] = g[r] @ w[e(r)]^T       grad_w[e] = x[rows of e]^T @ g[rows of e]

2 S K N FLOPs forward, 4 S K N backward (every row meets one expert's matrix).

Why the experts are an operand: Hugging Face's op walks `offs` from expert 0, so a rank
holding experts i..j of E (the weights split on their expert dim: expert parallelism)
could not tell which rows are its own. Here `experts` [E] is the list of expert indices
the weights' leading dim holds (arange(E) in the traced graph): split on its dim 0 like
the weights, each rank's shard names exactly its experts, and the rank computes their rows
and leaves the others zero. The outputs then sum over the ranks (a pending sum) to the
whole result, with no rank-dependent constant in the program. Whatever is not split on the
expert dim runs as the unsplit op does: the weights split on N (column-parallel, each rank
its share of the output features) or on K with x split alike (row-parallel, a pending sum).
"""

from __future__ import annotations

import torch

from autopar.ir import GROUPED_MM_BWD, GROUPED_MM_FWD

LIBRARY = "autopar"
FORWARD = "grouped_mm"
BACKWARD = "grouped_mm_backward"


def _row_ranges(offs: torch.Tensor, experts: torch.Tensor) -> list[tuple[int, int, int]]:
    """(local expert index, first row, end row) per expert of `experts` that has rows: one
    host read of `offs` and `experts` per call (as Hugging Face's fallback)."""
    ends = offs.tolist()
    ranges = []
    for j, e in enumerate(experts.tolist()):
        start = ends[e - 1] if e > 0 else 0
        if ends[e] > start:
            ranges.append((j, start, ends[e]))
    return ranges


@torch.library.custom_op(f"{LIBRARY}::{FORWARD}", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """out[r] = x[r] @ w[j] for the rows r of expert experts[j]; rows of other experts 0."""
    out = x.new_zeros(x.shape[0], w.shape[2])
    for j, start, end in _row_ranges(offs, experts):
        torch.mm(x[start:end], w[j], out=out[start:end])
    return out


@grouped_mm.register_fake
def _grouped_mm_fake(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op(f"{LIBRARY}::{BACKWARD}", mutates_args=())
def grouped_mm_backward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, experts: torch.Tensor,
                        grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_w) of `grouped_mm` for the output gradient `grad` (module docstring)."""
    grad_x = torch.zeros_like(x)
    grad_w = torch.zeros_like(w)
    for j, start, end in _row_ranges(offs, experts):
        torch.mm(grad[start:end], w[j].t(), out=grad_x[start:end])
        torch.mm(x[start:end].t(), grad[start:end], out=grad_w[j])
    return grad_x, grad_w


@grouped_mm_backward.register_fake
def _grouped_mm_backward_fake(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, experts: torch.Tensor,
                              grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(w)


def _backward(ctx, grad: torch.Tensor):
    x, w, offs, experts = ctx.saved_tensors
    grad_x, grad_w = grouped_mm_backward(x, w, offs, experts, grad)
    return grad_x, grad_w, None, None


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


grouped_mm.register_autograd(_backward, setup_context=_setup_context)

FORWARD_OP = torch.ops.autopar.grouped_mm.default
BACKWARD_OP = torch.ops.autopar.grouped_mm_backward.default


def grouped_mm_flops(name: str, x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> int:
    """2 S K N for the forward, 4 S K N for the backward (module docstring); 0 otherwise."""
    if name not in (GROUPED_MM_FWD, GROUPED_MM_BWD):
        return 0
    s, k = x_shape
    n = w_shape[2]
    return (2 if name == GROUPED_MM_FWD else 4) * s * k * n
