"""Grouped matrix multiply with the experts named: the op mixture-of-experts layers trace to,
in a form whose expert-parallel and data-parallel layouts run shard by shard.

Where it sits: shared by the trace (autopar/trace/capture.py runs Hugging Face's experts
through `experts_forward` below, which calls these ops), the strategy space
(autopar/dtensor_bridge.py registers their sharding rules), the pricing (their FLOPs in
autopar/trace/lowering.py) and the per-rank program, which runs them through DTensor's
dispatcher on each rank's shards.

Terms: rows x [S, K] are the routed token copies in token order (token t's k copies at
rows t k .. t k + k - 1); `ids` [S] names each row's expert; weights w [E, K, N], one
[K, N] matrix per expert. The forward is

    out[r] = x[r] @ w[e(r)]            e(r) = ids[r]

and the backward, for g = d loss / d out,

    grad_x[r] = g[r] @ w[e(r)]^T       grad_w[e] = x[rows of e]^T @ g[rows of e]

2 S K N FLOPs forward, 4 S K N backward (every row meets one expert's matrix).

Why rows stay in token order and the experts are an operand: Hugging Face's own experts
sort every row of the batch by expert and pass cumulative counts (`offs`), so a row's
place depends on all others and the batch could not split over data-parallel ranks; and
its op walks `offs` from expert 0, so a rank holding experts i..j of E could not tell
which rows are its own. Here each row carries its expert (the op sorts inside, per call),
so the rows may split on dim 0 beside `ids` (data parallelism: each rank its tokens, all
experts); and `experts` [E] lists the expert indices the weights' leading dim holds
(arange(E) in the traced graph): split on its dim 0 like the weights, each rank's shard
names exactly its experts, and the rank computes their rows and leaves the others zero.
The outputs then sum over the ranks (a pending sum) to the whole result, with no
rank-dependent constant in the program (Megatron-Core's all-gather token dispatcher: the
group's tokens whole on every rank, each rank its experts, the outputs reduced). Whatever
is not split on the expert dim or the rows runs as the unsplit op does: the weights split
on N (column-parallel, each rank its share of the output features) or on K with x split
alike (row-parallel, a pending sum).

Kernels: each call sorts its rows by expert and runs torch's grouped matmul
(`torch.nn.functional.grouped_mm`, the kernel Hugging Face's own experts use: one call for
all of a rank's experts) where the device has it (`grouped_kernel`), else one matmul per
expert (Hugging Face's fallback); the results are scattered back to token order. Sorting
and scattering per call, where Hugging Face sorts once per layer, has a cost: on this
project's 2-core CPU machine a single-process training step of the Mixtral and Qwen2-MoE
of benchmarks/measure_hf_moe.py took 1.07x and 1.03x the time of Hugging Face's own
experts (median of 6 alternating steps).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch
from torch import nn

from autopar.ir import GROUPED_MM_BWD, GROUPED_MM_FWD

LIBRARY = "autopar"
FORWARD = "grouped_mm"
BACKWARD = "grouped_mm_backward"
EXPERTS_IMPLEMENTATION = "autopar"
"""The name `experts_forward` is registered under in Hugging Face's experts interface."""


def grouped_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped matmul (`torch.nn.functional.grouped_mm`: all experts in one
    call) runs for rows x [S, K] and weights w [E, K, N]: on CPU, and on CUDA from compute
    capability 8.0 (the test Hugging Face's experts apply, transformers/integrations/moe.py
    `_can_use_grouped_mm`), with K and N rows a multiple of 16 bytes (the kernel's stride
    rule); otherwise the op loops over its experts."""
    if not hasattr(torch.nn.functional, "grouped_mm") or x.dtype != w.dtype:
        return False
    if any(d * x.element_size() % 16 for d in (x.shape[1], w.shape[2])):
        return False
    if x.device.type == "cpu":
        return True
    return x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) >= (8, 0)


def _local_rows(ids: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The rows of `experts`' experts grouped by expert in `experts`' order (each group in
    ascending row order), their cumulative counts `offs` [E_local] (int32, as the grouped
    kernel takes them) and the counts: one stable sort of `ids` and one host read per call
    (as Hugging Face's fallback reads its `offs` once)."""
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    starts = torch.searchsorted(sorted_ids, experts).tolist()
    ends = torch.searchsorted(sorted_ids, experts, right=True).tolist()
    counts = [b - a for a, b in zip(starts, ends)]
    rows = torch.cat([order[a:b] for a, b in zip(starts, ends)]) if counts else order[:0]
    offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=ids.device)
    return rows, offs, counts


def _groups(counts: list[int]) -> list[tuple[int, int, int]]:
    """(local expert, first, end) of each non-empty group of rows, for the loop."""
    ends = list(itertools.accumulate(counts))
    return [(j, e - c, e) for j, (c, e) in enumerate(zip(counts, ends)) if c]


@torch.library.custom_op(f"{LIBRARY}::{FORWARD}", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """out[r] = x[r] @ w[j] for the rows r with ids[r] = experts[j]; rows of other experts 0."""
    out = x.new_zeros(x.shape[0], w.shape[2])
    rows, offs, counts = _local_rows(ids, experts)
    if not rows.numel():
        return out
    xr = x.index_select(0, rows)
    if grouped_kernel(x, w):
        part = torch.nn.functional.grouped_mm(xr, w, offs=offs)
    else:
        part = xr.new_empty(xr.shape[0], w.shape[2])
        for j, a, b in _groups(counts):
            torch.mm(xr[a:b], w[j], out=part[a:b])
    return out.index_copy_(0, rows, part)


@grouped_mm.register_fake
def _grouped_mm_fake(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op(f"{LIBRARY}::{BACKWARD}", mutates_args=())
def grouped_mm_backward(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, experts: torch.Tensor,
                        grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_w) of `grouped_mm` for the output gradient `grad` (module docstring)."""
    grad_x = torch.zeros_like(x)
    rows, offs, counts = _local_rows(ids, experts)
    if not rows.numel():
        return grad_x, torch.zeros_like(w)
    g, xr = grad.index_select(0, rows), x.index_select(0, rows)
    if grouped_kernel(x, w) and grad.dtype == w.dtype:
        part = torch.nn.functional.grouped_mm(g, w.transpose(-2, -1), offs=offs)
        grad_w = _weight_gradient(xr, g, offs, w)
    else:
        part, grad_w = g.new_empty(xr.shape), torch.zeros_like(w)
        for j, a, b in _groups(counts):
            torch.mm(g[a:b], w[j].t(), out=part[a:b])
            torch.mm(xr[a:b].t(), g[a:b], out=grad_w[j])
    return grad_x.index_copy_(0, rows, part), grad_w


def _weight_gradient(xr: torch.Tensor, g: torch.Tensor, offs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """grad_w[e] = xr[rows of e]^T g[rows of e] by the grouped kernel, laid out with w's
    strides (the traced graph's fake result is `empty_like(w)`, and the ops after it view it
    so): a weight stored transposed gets its gradient computed transposed, with no copy."""
    if w.transpose(-2, -1).is_contiguous():
        return torch.nn.functional.grouped_mm(g.t(), xr, offs=offs).transpose(-2, -1)
    out = torch.nn.functional.grouped_mm(xr.t(), g, offs=offs)
    return out if out.stride() == w.stride() else torch.empty_like(w).copy_(out)


@grouped_mm_backward.register_fake
def _grouped_mm_backward_fake(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, experts: torch.Tensor,
                              grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(w)


def _backward(ctx, grad: torch.Tensor):
    x, w, ids, experts = ctx.saved_tensors
    grad_x, grad_w = grouped_mm_backward(x, w, ids, experts, grad)
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


def _linear(rows: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, experts: torch.Tensor,
            transposed: bool) -> torch.Tensor:
    """Each row through its expert's linear map, as Hugging Face's `_grouped_linear` lays
    the weights out ([E, in, out] where `transposed`, else [E, out, in])."""
    w = weight if transposed else weight.transpose(-2, -1)
    return grouped_mm(rows.to(w.dtype), w, ids, experts)


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """Hugging Face's experts forward (`transformers.integrations.moe`, the grouped-matmul
    implementation) with the rows in token order: the same maths, expert by expert, with
    each row's expert passed beside it instead of a batch-wide sort (module docstring).

        rows  = each token repeated k times          [T k, H]
        h     = gate(rows @ W_up[e(r)])              (or act(rows @ W_up[e(r)]) without a gate)
        out_t = sum over t's k rows of p_r (h_r @ W_down[e(r)])

    Biases are gathered per row, and the post-expert norm applied, where the module has them."""
    tokens, hidden = hidden_states.shape
    k = top_k_index.shape[-1]
    rows = hidden_states.unsqueeze(1).expand(tokens, k, hidden).reshape(tokens * k, hidden)
    ids = top_k_index.reshape(-1)
    experts = torch.arange(module.num_experts, device=hidden_states.device)
    up = module.gate_up_proj if module.has_gate else module.up_proj
    h = _linear(rows, up, ids, experts, module.is_transposed)
    if module.has_bias:
        h = h + (module.gate_up_proj_bias if module.has_gate else module.up_proj_bias)[ids]
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    h = _linear(h, module.down_proj, ids, experts, module.is_transposed)
    if module.has_bias:
        h = h + module.down_proj_bias[ids]
    if module.has_post_expert_norm:
        h = module.post_expert_norm(h)
    h = h * top_k_weights.reshape(-1, 1)
    return h.view(tokens, k, hidden).sum(dim=1).to(hidden_states.dtype)


@contextlib.contextmanager
def experts_for_trace(model: nn.Module) -> Iterator[None]:
    """Run the Hugging Face models inside `model` through `experts_forward` while the
    tracer captures them, and restore each model's own experts implementation after.

    Models whose experts class takes Hugging Face's `use_experts_implementation` decorator
    (Mixtral, Qwen2/3-MoE, DeepSeek, gpt-oss, ...) are switched through their public
    `set_experts_implementation`; other models, and transformers versions without the
    interface, are left as they are."""
    models = [m for m in model.modules() if hasattr(m, "set_experts_implementation")
              and hasattr(m, "get_experts_implementation") and m._can_set_experts_implementation()]
    if not models:
        yield
        return
    from transformers.integrations.moe import ExpertsInterface  # lazy: transformers is an optional dependency

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, experts_forward)
    saved = [(m, m.get_experts_implementation()) for m in models]
    try:
        for m in models:
            m.set_experts_implementation(EXPERTS_IMPLEMENTATION)
        yield
    finally:
        for m, implementation in reversed(saved):
            m.set_experts_implementation(implementation)
