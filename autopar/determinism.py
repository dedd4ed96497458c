"""Random ops in a training step, and a mode that makes them deterministic for `--check`.

Where it sits: beside the runtime, used by `autopar train --check` (autopar/commands/train.py)
and the training jobs (autopar/runtime/jobs.py). The check compares a parallel run with a
single-process reference; with dropout the two draw different masks (different RNG
streams, batch slices and call orders), so their losses differ by noise that a broken
plan could hide behind. Two pieces make the check meaningful again:

- `random_ops(gm)`: the random ops of a traced joint graph (autopar/trace/), found by
  torch's own `nondeterministic_seeded` op tag; attention and RNN ops carry that tag for
  their dropout and count only when their dropout probability is above 0.
- `deterministic_random()`: a context manager (a TorchDispatchMode below autograd, plus the
  math attention backend, so attention dropout is a visible op too) that replaces every
  random draw by a fixed pseudo-random field. The parallel ranks and the reference enter
  it around their training steps and so draw identical masks.

The field: for a tensor whose last dim has size n, element [..., j] gets
u = hash32(j, n) / 2**32 in [0, 1), the same for every leading index (sample, token,
head). So a mask does not depend on which samples a rank holds (data parallelism,
microbatches), on heads or tokens being split across ranks (tensor and sequence
parallelism), on the order or number of calls (pipelining) or on recomputation
(activation checkpointing re-draws the same mask). It assumes the last dim of a random
op's tensor is not sharded, as in Megatron-style plans (dropout acts on the full hidden
or key dim). Dropout with such a mask keeps the same channels in every row: still a
dropout (masking and 1/(1-p) scaling, forward and backward), not an unbiased one; it is
for checks, training without `--check` draws real random masks.

Terms: a random op is an ATen op whose output depends on the RNG state.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
from torch import fx
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_DROPOUT_ARGS = ("dropout_p", "dropout")
"""Argument names of ops that are random only when this probability is above 0 (SDPA, RNNs)."""

_HASH_MUL_1 = 0x7FEB352D
_HASH_MUL_2 = 0x2C1B3C6D
"""Odd multipliers below 2**31 (a 32-bit x 31-bit product fits in int64): an integer hash
in the style of lowbias32, good enough to look random, exact on every device."""
_SIZE_SALT = 0x9E3779B1
_MASK32 = 0xFFFFFFFF


class UnsupportedRandomOpError(ValueError):
    """A random op has no deterministic stand-in, so `--check` cannot compare runs with it."""


def _bind(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in."""
    bound: dict[str, Any] = {}
    for i, arg in enumerate(op._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def is_random(op: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> bool:
    """True for an ATen op overload whose result depends on the RNG with these arguments."""
    if not isinstance(op, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    bound = _bind(op, args, kwargs or {})
    if bound.get("train", True) is False:  # dropout and RNNs in eval mode
        return False
    probability = next((bound[name] for name in _DROPOUT_ARGS if name in bound), None)
    return probability is None or float(probability or 0.0) > 0.0


def random_ops(gm: fx.GraphModule) -> dict[str, int]:
    """Random ops of a traced graph with their counts, e.g. {'aten.native_dropout.default': 7}."""
    found: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and is_random(node.target, tuple(node.args), dict(node.kwargs)):
            found[str(node.target)] = found.get(str(node.target), 0) + 1
    return dict(sorted(found.items()))


def _uniform(shape: torch.Size | tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The fixed field u in [0, 1) for `shape` (module docstring), broadcast to it."""
    n = shape[-1] if len(shape) else 1
    x = torch.arange(n, dtype=torch.int64, device=device)
    x = (x + n * _SIZE_SALT) & _MASK32
    for mul in (_HASH_MUL_1, _HASH_MUL_2):
        x = x ^ (x >> 16)
        x = (x * mul) & _MASK32
    x = x ^ (x >> 16)
    u = (x.to(torch.float64) + 0.5) / 2.0**32
    return u.to(dtype if dtype.is_floating_point else torch.float32).reshape(
        (1,) * max(len(shape) - 1, 0) + (n,)).expand(shape)


def _normal(shape: torch.Size | tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    u = _uniform(shape, device, torch.float64)
    return (math.sqrt(2.0) * torch.erfinv(2.0 * u - 1.0)).to(dtype)


def _factory_options(bound: dict[str, Any], like: torch.Tensor | None = None) -> tuple[torch.device, torch.dtype]:
    device = bound.get("device") or (like.device if like is not None else torch.device("cpu"))
    dtype = bound.get("dtype") or (like.dtype if like is not None else torch.get_default_dtype())
    return torch.device(device), dtype


def _stand_in(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The deterministic result of random op `op` (module docstring), or raise
    UnsupportedRandomOpError."""
    name, a = str(op), _bind(op, args, kwargs)
    if name == "aten.native_dropout.default":
        x, p = a["input"], float(a["p"])
        keep = _uniform(x.shape, x.device, torch.float32) < 1.0 - p  # as F.dropout's bernoulli_(1 - p) draws
        return x * keep * (0.0 if p >= 1.0 else 1.0 / (1.0 - p)), keep.contiguous()
    if name in ("aten.bernoulli_.float", "aten.bernoulli_.Tensor", "aten.bernoulli.p", "aten.bernoulli.Tensor",
                "aten.bernoulli.default"):
        x = a["self"]
        draw = (_uniform(x.shape, x.device, torch.float32) < a.get("p", x)).to(x.dtype)
        return x.copy_(draw) if name.startswith("aten.bernoulli_") else draw.contiguous()
    if name in ("aten.uniform_.default", "aten.uniform.default"):
        x = a["self"]
        draw = (a["from"] + (a["to"] - a["from"]) * _uniform(x.shape, x.device, torch.float64)).to(x.dtype)
        return x.copy_(draw) if name == "aten.uniform_.default" else draw.contiguous()
    if name == "aten.normal_.default":
        x = a["self"]
        return x.copy_(a["mean"] + a["std"] * _normal(x.shape, x.device, torch.float64))
    if name in ("aten.rand.default", "aten.rand.generator", "aten.randn.default", "aten.randn.generator"):
        device, dtype = _factory_options(a)
        draw = _uniform if name.startswith("aten.rand.") else _normal
        return draw(tuple(a["size"]), device, dtype).contiguous()
    if name in ("aten.rand_like.default", "aten.rand_like.generator", "aten.randn_like.default",
                "aten.randn_like.generator"):
        device, dtype = _factory_options(a, like=a["self"])
        draw = _uniform if name.startswith("aten.rand_like") else _normal
        return draw(a["self"].shape, device, dtype).contiguous()
    raise UnsupportedRandomOpError(
        f"{op} draws random numbers and has no deterministic stand-in for --check (supported: dropout, "
        "bernoulli, rand, randn, uniform, normal_ and their _like forms); run without --check, or "
        "check a model without this op")


SUPPORTED = frozenset({
    "aten.native_dropout.default", "aten.bernoulli_.float", "aten.bernoulli_.Tensor", "aten.bernoulli.p",
    "aten.bernoulli.Tensor", "aten.bernoulli.default", "aten.uniform_.default", "aten.uniform.default",
    "aten.normal_.default", "aten.rand.default", "aten.rand.generator", "aten.randn.default",
    "aten.randn.generator", "aten.rand_like.default", "aten.rand_like.generator", "aten.randn_like.default",
    "aten.randn_like.generator",
})
"""Op overloads `deterministic_random` replaces; attention dropout becomes one of them under
the math attention backend the mode enters."""


def unsupported(found: dict[str, int]) -> list[str]:
    """The ops of `random_ops(...)` the mode cannot make deterministic (attention ops are
    fine: under the mode they run as math attention with a visible dropout)."""
    return [name for name in found if name not in SUPPORTED and "attention" not in name]


class _DeterministicRandomMode(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not is_random(func, args, kwargs):
            return func(*args, **kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if any(type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter) for t in tensors):
            raise UnsupportedRandomOpError(
                f"{func} on a {type(tensors[0]).__name__}: deterministic random ops need plain (local) tensors")
        self.counts[str(func)] = self.counts.get(str(func), 0) + 1
        return _stand_in(func, args, kwargs)


@contextlib.contextmanager
def deterministic_random() -> Iterator[dict[str, int]]:
    """Inside, random ops draw the fixed field of the module docstring; yields the counts of
    replaced ops by name (filled as ops run). Enter it on every rank and in the reference."""
    mode = _DeterministicRandomMode()
    # fused attention kernels draw their dropout inside; the math backend calls dropout as an op
    with sdpa_kernel([SDPBackend.MATH]), mode:
        yield mode.counts
