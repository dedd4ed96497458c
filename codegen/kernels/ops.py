"""Fused ops as `torch.library` custom ops: RMSNorm, LayerNorm, SwiGLU, bias+GeLU(tanh).

Where it sits: the fusion pass (`fusion_pass.py`) and the fused modules (`modules.py`)
call the public functions below; they are what a rewritten graph contains
(`torch.ops.autopar.rms_norm`, ...). Each op has a fake implementation (`register_fake`)
so it traces under FakeTensorMode / make_fx / torch.compile, and an autograd formula
(`register_autograd`) whose backward is itself a custom op, so a traced backward holds one
fused node too.

Backend choice, per call: Triton when the tensor is on CUDA, or on CPU when the process
runs Triton's interpreter (`TRITON_INTERPRET=1`, the only way Triton runs without a GPU);
otherwise the pure-PyTorch reference (`reference.py`), which computes the same values.
Triton is imported on first Triton use only.

Statistics saved for backward (float32, one per row): RMSNorm `rstd`; LayerNorm `mean`,
`rstd`. They are op outputs because a custom op's backward may only see its inputs and
outputs; the public wrappers drop them.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import torch

from codegen.kernels import reference

LIB = "autopar"


def _use_triton(t: torch.Tensor) -> bool:
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def kernel_backend(t: torch.Tensor) -> ModuleType:
    if not _use_triton(t):
        return reference
    try:
        from codegen.kernels import triton_kernels  # lazy: imports triton
    except ImportError as exc:
        raise RuntimeError(
            f"fused kernels on {t.device.type} tensors need triton, which is not installed ({exc}); "
            "install it (pip install 'autopar[triton]') or run without the fusion pass") from exc
    return triton_kernels


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1, t.shape[-1])


# ---------------------------------------------------------------------------------------
# RMSNorm: y = x * rsqrt(mean(x^2) + eps) * weight


@torch.library.custom_op(f"{LIB}::rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    kern = kernel_backend(x)
    if kern is reference:
        y, rstd = reference.rms_norm_fwd(x, weight, eps)
        return y, rstd.reshape(x.shape[:-1])
    y, rstd = kern.rms_norm_fwd(_rows(x), weight.contiguous(), eps)
    return y.view(x.shape), rstd.view(x.shape[:-1])


@_rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op(f"{LIB}::rms_norm_backward", mutates_args=())
def _rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                       rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    kern = kernel_backend(x)
    if kern is reference:
        return reference.rms_norm_bwd(dy, x, weight, rstd)
    dx, dw = kern.rms_norm_bwd(_rows(dy), _rows(x), weight.contiguous(), rstd.contiguous().reshape(-1))
    return dx.view(x.shape), dw


@_rms_norm_backward.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
      rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, weight, _eps = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_grad(ctx: Any, dy: torch.Tensor, _drstd: torch.Tensor) -> tuple[Any, ...]:
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward(dy, x, weight, rstd)
    return dx, dw, None


_rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fused RMSNorm over the last dim; same value as `autopar.models.llama.RMSNorm`."""
    return _rms_norm(x, weight, eps)[0]


# ---------------------------------------------------------------------------------------
# LayerNorm: y = (x - mean) * rstd * weight + bias


@torch.library.custom_op(f"{LIB}::layer_norm", mutates_args=())
def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kern = kernel_backend(x)
    if kern is reference:
        y, mean, rstd = reference.layer_norm_fwd(x, weight, bias, eps)
        return y, mean.reshape(x.shape[:-1]), rstd.reshape(x.shape[:-1])
    y, mean, rstd = kern.layer_norm_fwd(_rows(x), weight.contiguous(),
                                        None if bias is None else bias.contiguous(), eps)
    return y.view(x.shape), mean.view(x.shape[:-1]), rstd.view(x.shape[:-1])


@_layer_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    stat = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x), stat, torch.empty_like(stat)


@torch.library.custom_op(f"{LIB}::layer_norm_backward", mutates_args=())
def _layer_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                         rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kern = kernel_backend(x)
    if kern is reference:
        return reference.layer_norm_bwd(dy, x, weight, mean, rstd)
    dx, dw, db = kern.layer_norm_bwd(_rows(dy), _rows(x), weight.contiguous(),
                                     mean.contiguous().reshape(-1), rstd.contiguous().reshape(-1))
    return dx.view(x.shape), dw, db


@_layer_norm_backward.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
      rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)


def _layer_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    x, weight, bias, _eps = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, output[1], output[2])


def _layer_norm_grad(ctx: Any, dy: torch.Tensor, _dmean: torch.Tensor, _drstd: torch.Tensor) -> tuple[Any, ...]:
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _layer_norm_backward(dy, x, weight, mean, rstd)
    return dx, dw, db if ctx.has_bias else None, None


_layer_norm.register_autograd(_layer_norm_grad, setup_context=_layer_norm_setup)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Fused LayerNorm over the last dim; same value as `F.layer_norm(x, (n,), weight, bias, eps)`."""
    return _layer_norm(x, weight, bias, eps)[0]


# ---------------------------------------------------------------------------------------
# SwiGLU activation: silu(gate) * up (the two inputs are the w1 and w3 projections)


@torch.library.custom_op(f"{LIB}::swiglu", mutates_args=())
def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    kern = kernel_backend(gate)
    if kern is reference:
        return reference.swiglu_fwd(gate, up)
    return kern.swiglu_fwd(gate.contiguous(), up.contiguous())


@_swiglu.register_fake
def _(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op(f"{LIB}::swiglu_backward", mutates_args=())
def _swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    kern = kernel_backend(gate)
    if kern is reference:
        return reference.swiglu_bwd(dy, gate, up)
    return kern.swiglu_bwd(dy.contiguous(), gate.contiguous(), up.contiguous())


@_swiglu_backward.register_fake
def _(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    fmt = torch.contiguous_format
    return torch.empty_like(gate, memory_format=fmt), torch.empty_like(up, memory_format=fmt)


def _swiglu_setup(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = ctx.saved_tensors
    return _swiglu_backward(dy, gate, up)


_swiglu.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Fused `F.silu(gate) * up`; gate and up have the same shape."""
    if gate.shape != up.shape:
        raise ValueError(
            f"swiglu: gate and up must have the same shape, given {tuple(gate.shape)} and "
            f"{tuple(up.shape)}; pass the w1 and w3 projections of the same input")
    return _swiglu(gate, up)


# ---------------------------------------------------------------------------------------
# bias + GeLU(tanh): y = gelu_tanh(x + bias), bias broadcast over the last dim


@torch.library.custom_op(f"{LIB}::bias_gelu", mutates_args=())
def _bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    kern = kernel_backend(x)
    if kern is reference:
        return reference.bias_gelu_fwd(x, bias)
    return kern.bias_gelu_fwd(x.contiguous(), bias.contiguous())


@_bias_gelu.register_fake
def _(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op(f"{LIB}::bias_gelu_backward", mutates_args=())
def _bias_gelu_backward(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    kern = kernel_backend(x)
    if kern is reference:
        return reference.bias_gelu_bwd(dy, x, bias)
    return kern.bias_gelu_bwd(dy.contiguous(), x.contiguous(), bias.contiguous())


@_bias_gelu_backward.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(bias)


def _bias_gelu_setup(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _bias_gelu_grad(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, bias = ctx.saved_tensors
    return _bias_gelu_backward(dy, x, bias)


_bias_gelu.register_autograd(_bias_gelu_grad, setup_context=_bias_gelu_setup)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Fused `F.gelu(x + bias, approximate="tanh")`; bias has shape (x.shape[-1],)."""
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(
            f"bias_gelu: bias must have shape ({x.shape[-1]},) to match x's last dim, given "
            f"{tuple(bias.shape)}; pass the linear layer's bias vector")
    return _bias_gelu(x, bias)


# the ops' sharding strategies, for the per-op compiler (DTensor's registry)
from codegen.kernels import sharding as _sharding  # noqa: E402

_sharding.register()
