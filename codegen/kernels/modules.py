"""Module-level swap: norms and MLPs replaced by fused-op modules, on any model, where proven equal.

Where it sits: for a runtime that runs nn.Modules (not FX graphs), and before tracing for
the per-op program (autopar/placing.py, autopar/build/__init__.py: the fused ops, forward
and backward, are then ops of the traced step). Call `swap_fused_modules(model)` after
building the model and before creating the optimizer; it returns a deep copy whose
swapped modules compute the same function through autopar:: fused ops, and leaves
`model` as it was.

No rule names a model family. A module is a candidate by its structure alone, and is
swapped only where a probe shows that the fused formula computes what its own forward
does (`_equal`: same output and same input and parameter gradients on a seeded random
input, to the dtype's rounding), so a variant whose math differs (Gemma's `(1 + weight)`
norm, an exact-erf GELU, a dropout in training mode, a scaled residual) keeps its own
module. The candidates:
- a norm: no children, one parameter, a 1-D `weight`, and a float epsilon attribute
  (`eps`, `variance_epsilon` or `epsilon`) -> FusedRMSNorm   x * rsqrt(mean(x^2) + eps) * w
  (the zoo's RMSNorm, Hugging Face's LlamaRMSNorm and the like);
- `torch.nn.LayerNorm` over one dim with a weight -> FusedLayerNorm (torch's own class:
  exact by definition, no probe);
- a gated MLP: three bias-free `nn.Linear` children (gate and up: d -> f, down: f -> d)
  beside parameter-free ones (an activation module) and no parameters of its own ->
  FusedSwiGLU   down(silu(gate x) * up x) (gate and up told apart by the probe);
- a GELU MLP: two `nn.Linear` children (fc: d -> f with a bias, proj: f -> d) beside
  parameter-free ones -> FusedBiasGeluMLP   proj(gelu_tanh(x W_fc^T + b_fc)).
The probe runs once per (signature, form, roles) and its verdict holds for every module
with that key, the signature being the classes and plain attributes of the module and of
every module under it (`_signature`): modules alike in those run the same code. Modules
with meta-device parameters are not probed, and stay as they are.
Parameter names are unchanged (`weight`, `w1.weight`, `gate_proj.weight`, `fc.bias`, ...),
and so is the order of `named_parameters()`, so state dicts, plans and checkpoints keep
working.
"""

from __future__ import annotations

import copy
import itertools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from codegen.kernels import ops

EPS_NAMES = ("eps", "variance_epsilon", "epsilon")
"""Attribute names a norm module keeps its epsilon under (the zoo and torch: eps; Hugging
Face's Llama-family RMSNorm: variance_epsilon)."""

PROBE_ROWS = 3
"""Token rows of the probe input (one batch of 3): a random input on which a different
formula would differ, and cheap: forward and backward of an 8B model's MLP (4096 x 14336)
on 3 rows is about 2 GFLOP, once per signature."""


class FusedRMSNorm(nn.Module):
    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = weight

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
    """down(swiglu(gate x, up x)); the Linear children keep their names and order."""

    def __init__(self, source: nn.Module, gate: str, up: str, down: str) -> None:
        super().__init__()
        for name, child in source.named_children():
            if name in (gate, up, down):
                self.add_module(name, child)
        self.roles = (gate, up, down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, name) for name in self.roles)
        return down(ops.swiglu(gate(x), up(x)))


class FusedBiasGeluMLP(nn.Module):
    """proj(bias_gelu(x W_fc^T, b_fc)); the Linear children keep their names and order."""

    def __init__(self, source: nn.Module, fc: str, proj: str) -> None:
        super().__init__()
        for name, child in source.named_children():
            if name in (fc, proj):
                self.add_module(name, child)
        self.roles = (fc, proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc, proj = (getattr(self, name) for name in self.roles)
        return proj(ops.bias_gelu(F.linear(x, fc.weight), fc.bias))


def _signature(module: nn.Module) -> tuple:
    """What decides which code `module`'s forward runs: its class and plain (non-tensor)
    attributes (eps, flags, sizes, training), and those of every module under it (an
    activation's kind, a dropout's p)."""
    return tuple((name, type(m), tuple(sorted((k, v) for k, v in vars(m).items() if not k.startswith("_")
                                              and isinstance(v, (int, float, bool, str, type(None))))))
                 for name, m in module.named_modules())


def _linears(module: nn.Module) -> dict[str, nn.Linear] | None:
    """The module's Linear children by name, if every other child holds no parameter and
    the module has none of its own; None otherwise."""
    if any(True for _ in module.named_parameters(recurse=False)):
        return None
    found = {}
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            found[name] = child
        elif any(True for _ in child.parameters()):
            return None
    return found


def _candidates(module: nn.Module) -> list[tuple[Callable[[], nn.Module], tuple]]:
    """(make the fused module, probe key) for each fused form `module`'s structure admits."""
    kind = type(module)
    if kind is nn.LayerNorm:
        return []  # handled without a probe (`_fused`)
    params = dict(module.named_parameters(recurse=False))
    plain = _signature(module)
    if not any(True for _ in module.children()) and list(params) == ["weight"] and params["weight"].dim() == 1:
        eps = next((getattr(module, n) for n in EPS_NAMES if isinstance(getattr(module, n, None), float)), None)
        if eps is not None:
            return [(lambda: FusedRMSNorm(module.weight, eps), (kind, plain, "rms_norm"))]
    linears = _linears(module)
    if linears is None:
        return []
    out: list[tuple[Callable[[], nn.Module], tuple]] = []
    if len(linears) == 3 and all(lin.bias is None for lin in linears.values()):
        for gate, up, down in itertools.permutations(linears, 3):
            g, u, d = linears[gate], linears[up], linears[down]
            if g.weight.shape == u.weight.shape and d.in_features == g.out_features \
                    and d.out_features == g.in_features:
                out.append((lambda gate=gate, up=up, down=down: FusedSwiGLU(module, gate, up, down),
                            (kind, plain, "swiglu", gate, up, down)))
    if len(linears) == 2:
        for fc, proj in itertools.permutations(linears, 2):
            a, b = linears[fc], linears[proj]
            if a.bias is not None and b.in_features == a.out_features and b.out_features == a.in_features:
                out.append((lambda fc=fc, proj=proj: FusedBiasGeluMLP(module, fc, proj),
                            (kind, plain, "bias_gelu", fc, proj)))
    return out


def _input_width(module: nn.Module) -> int:
    weight = next(module.parameters())
    if weight.dim() == 1:
        return weight.shape[0]
    return next(lin.in_features for lin in module.children() if type(lin) is nn.Linear)


def _equal(module: nn.Module, fused: nn.Module) -> bool:
    """Whether `fused` computes `module`'s function: output, input gradient and parameter
    gradients on one seeded random input, to the parameters' dtype's rounding. The
    gradients are returned by autograd.grad, not accumulated: no parameter's `.grad` is
    touched. Any error (a module that wants another input) is a no."""
    weight = next(module.parameters())
    if weight.is_meta:
        return False
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, PROBE_ROWS, _input_width(module), generator=generator).to(weight.device, weight.dtype)
    cotangent = None
    tol = 1e-5 if weight.dtype == torch.float32 else 2e-2
    results = []
    try:
        for m in (module, fused):
            xi = x.clone().requires_grad_(True)
            params = [p for _, p in m.named_parameters()]
            y = m(xi)
            if not isinstance(y, torch.Tensor) or y.shape[:-1] != x.shape[:-1]:
                return False
            if cotangent is None:
                cotangent = torch.randn(y.shape, generator=generator).to(y.device, y.dtype)
            grads = torch.autograd.grad(y, [xi, *params], cotangent)
            results.append((y.detach(), *grads))
    except Exception:  # noqa: BLE001 (whatever the module raises, it is not this form)
        return False
    first, second = results
    return len(first) == len(second) and all(
        a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=tol, atol=tol) for a, b in zip(first, second))


def _fused(module: nn.Module, verdicts: dict[tuple, bool]) -> nn.Module | None:
    if type(module) is nn.LayerNorm:
        if len(module.normalized_shape) == 1 and module.weight is not None:
            return FusedLayerNorm(module)
        return None
    for make, key in _candidates(module):
        if key not in verdicts:
            verdicts[key] = _equal(module, make())
        if verdicts[key]:
            return make()
    return None


def swap_fused_modules(model: nn.Module) -> nn.Module:
    """A deep copy of `model` with every module that a fused form provably computes
    replaced by it (module docstring)."""
    new = copy.deepcopy(model)
    verdicts: dict[tuple, bool] = {}
    for name, module in list(new.named_modules()):
        if not name:
            continue
        replacement = _fused(module, verdicts)
        if replacement is None:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(new.get_submodule(parent_name), child, replacement)
    return new
