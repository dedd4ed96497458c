"""Module-level swap: zoo norms and MLP activations replaced by fused-op modules.

Where it sits: for a runtime that runs nn.Modules (not FX graphs). Call
`swap_fused_modules(model)` after building the model and before creating the optimizer,
when the model will run on a GPU; it returns a deep copy whose modules compute the same
function through autopar:: fused ops (forward and backward), and leaves `model` as it was.

Swaps (by exact type, so user subclasses with other behaviour are left alone):
- autopar.models.llama.RMSNorm     -> FusedRMSNorm
- torch.nn.LayerNorm (1-D, affine) -> FusedLayerNorm
- autopar.models.llama.FeedForward -> FusedSwiGLU        w2(swiglu(w1 x, w3 x))
- autopar.models.gpt.MLP (fc bias) -> FusedBiasGeluMLP   proj(bias_gelu(x W_fc^T, b_fc))
Parameter names are unchanged (`weight`, `w1.weight`, `fc.bias`, ...), so state dicts,
sharding plans and checkpoints keep working.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models import gpt, llama
from codegen.kernels import ops


class FusedRMSNorm(nn.Module):
    def __init__(self, source: llama.RMSNorm) -> None:
        super().__init__()
        self.eps = source.eps
        self.weight = source.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class FusedLayerNorm(nn.Module):
    def __init__(self, source: nn.LayerNorm) -> None:
        super().__init__()
        self.eps = source.eps
        self.weight = source.weight
        self.bias = source.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class FusedSwiGLU(nn.Module):
    def __init__(self, source: llama.FeedForward) -> None:
        super().__init__()
        # registration order as in FeedForward, so named_parameters() order is unchanged
        self.w1, self.w3, self.w2 = source.w1, source.w3, source.w2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(ops.swiglu(self.w1(x), self.w3(x)))


class FusedBiasGeluMLP(nn.Module):
    def __init__(self, source: gpt.MLP) -> None:
        super().__init__()
        self.fc, self.proj = source.fc, source.proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(ops.bias_gelu(F.linear(x, self.fc.weight), self.fc.bias))


def _fused(module: nn.Module) -> nn.Module | None:
    kind = type(module)
    if kind is llama.RMSNorm:
        return FusedRMSNorm(module)
    if kind is nn.LayerNorm and len(module.normalized_shape) == 1 and module.weight is not None:
        return FusedLayerNorm(module)
    if kind is llama.FeedForward:
        return FusedSwiGLU(module)
    if kind is gpt.MLP and module.fc.bias is not None:
        return FusedBiasGeluMLP(module)
    return None


def swap_fused_modules(model: nn.Module) -> nn.Module:
    """A deep copy of `model` with every swappable submodule replaced by its fused version."""
    new = copy.deepcopy(model)
    for name, module in list(new.named_modules()):
        replacement = _fused(module) if name else None
        if replacement is None:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(new.get_submodule(parent_name), child, replacement)
    return new
