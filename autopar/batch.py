"""A batch as users write it: positional inputs that are tensors or pytrees of tensors
(dicts, lists, tuples, named tuples), and keyword inputs.

Where it sits: shared by every stage that touches example inputs or batches (the tracer,
the search, the runtime, the launcher). One batch is a tuple of positional inputs whose
last element may be a `Keywords` dict: the model is called as
`model(*positional, **keywords)` (`call`). Everything else sees the batch's tensor leaves
in one fixed order (`leaves`: torch's pytree flattening of (positional, keywords), the
order AOT autograd gives the traced step's data inputs), and splits microbatches on the
batch dimension: every tensor leaf whose first dim is the batch size (`batch_size`: the
first tensor leaf with a dim) is sliced, others (a scalar, a shared mask) pass whole.

Factories may return `(model, positional)` or `(model, positional, keywords)`
(`from_factory`), the keyword form for a forward with keyword-only arguments.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree


class Keywords(dict):
    """The keyword inputs of one batch (the last element of the batch tuple)."""


def split(batch: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(positional inputs, keyword inputs) of a batch."""
    items = tuple(batch)
    if items and isinstance(items[-1], Keywords):
        return items[:-1], dict(items[-1])
    return items, {}


def join(args: Sequence[Any], kwargs: dict[str, Any] | None) -> tuple[Any, ...]:
    """The batch tuple of positional and keyword inputs."""
    return tuple(args) + ((Keywords(kwargs),) if kwargs else ())


def from_factory(made: Any, where: str) -> tuple[Any, tuple[Any, ...]]:
    """(model, batch) from a factory's `(model, inputs)` or `(model, inputs, keywords)`."""
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise ValueError(f"{where} must return (model, example_inputs) or (model, example_inputs, "
                         f"example_kwargs), got {type(made).__name__}")
    model, inputs = made[0], made[1]
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    kwargs = made[2] if len(made) == 3 else None
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"{where}: example_kwargs must be a dict of keyword inputs, got {type(kwargs).__name__}")
    return model, join(inputs, kwargs)


def leaves(batch: Sequence[Any]) -> list[Any]:
    """Every leaf of the batch (tensors and other values), in the traced step's input order."""
    return pytree.tree_leaves(split(batch))


def tensors(batch: Sequence[Any]) -> list[torch.Tensor]:
    return [t for t in leaves(batch) if isinstance(t, torch.Tensor)]


def batch_size(batch: Sequence[Any]) -> int:
    """Dim 0 of the first tensor leaf with a dim (1 when there is none)."""
    first = next((t for t in tensors(batch) if t.dim() > 0), None)
    return int(first.shape[0]) if first is not None else 1


def seq_len(batch: Sequence[Any]) -> int:
    """Tokens per sample: dim 1 of the first integer tensor leaf with two dims (token ids,
    batch x sequence); 1 when there is none (images, features: samples have no tokens, and
    throughput is counted in samples, `throughput_unit`)."""
    first = next((t for t in tensors(batch) if t.dim() > 1 and not t.is_floating_point()
                  and not t.is_complex() and t.dtype != torch.bool), None)
    return int(first.shape[1]) if first is not None else 1


def throughput_unit(seq: int) -> str:
    """"tokens/s" where samples are token sequences (seq > 1), else "samples/s"."""
    return "tokens/s" if seq > 1 else "samples/s"


def rows(batch: Sequence[Any], start: int, stop: int, size: int | None = None) -> tuple[Any, ...]:
    """Rows start:stop of every tensor leaf whose dim 0 is the batch size `size` (default:
    `batch_size(batch)`), the same structure back."""
    size = batch_size(batch) if size is None else size
    args, kwargs = split(batch)

    def cut(x: Any) -> Any:
        return x[start:stop] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == size else x

    args, kwargs = pytree.tree_map(cut, (args, kwargs))
    return join(args, kwargs)


def map_tensors(fn: Any, batch: Sequence[Any]) -> tuple[Any, ...]:
    """`fn` applied to every tensor leaf, the same structure back."""
    args, kwargs = split(batch)
    args, kwargs = pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
    return join(args, kwargs)


def call(model: Any, batch: Sequence[Any]) -> Any:
    """model(*positional, **keywords)."""
    args, kwargs = split(batch)
    return model(*args, **kwargs)


def is_flat(batch: Sequence[Any]) -> bool:
    """Positional tensors (or plain values) only: no containers, no keyword inputs."""
    args, kwargs = split(batch)
    return not kwargs and all(not isinstance(a, (dict, list, tuple)) for a in args)


__all__ = ["Keywords", "batch_size", "call", "from_factory", "is_flat", "join", "leaves", "map_tensors", "rows", "seq_len",
           "split", "tensors", "throughput_unit"]
