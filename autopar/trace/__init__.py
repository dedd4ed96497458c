"""Tracer: capture one training step (forward + backward) on fake tensors and lower it.

Where it sits: the first stage of the flow (trace -> Graph -> strategies -> costs -> solve
-> Plan -> apply -> run), in two steps:

- capture (autopar/trace/capture.py): `trace(model, example_inputs)` returns the joint
  forward+backward `torch.fx.GraphModule` of model + loss (a `Traced`), captured on the
  CPU fake device and cleaned up for lowering; the recomputation rewrite
  (autopar/recompute.py) runs on it before lowering;
- lowering (autopar/trace/lowering.py): `lower(traced, ...)` turns it into the frozen,
  torch-free `autopar.ir.Graph` that every later stage reads.

This module is the stage's public surface and its entry points: `trace_model(...)` does
both for a zoo model, building it under the fake mode so a 405B model costs no memory;
`trace_step(...)` does both for a user's model on one microbatch, optionally cast to a
precision policy's compute dtype (`to_compute_dtype`, `with_precision`).

Terms: a *layer* is a child of the model's largest `nn.ModuleList` (`layers.<i>`); each
node carries the module path it ran in (capture.py says how).

The optimizer is not traced: its memory and time are priced per parameter downstream.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.batch import batch_size, map_tensors, seq_len
from autopar.ir import Graph
from autopar.models.zoo import ModelSource
from autopar.precision import cast_parameters
from autopar.recompute import recompute_copy
from autopar.trace.capture import LossFn, Traced, TraceError, hf_capture_patch, sdpa_backends, trace, updated_buffers
from autopar.trace.lowering import VIEW_OPS, lower

__all__ = ["LossFn", "Traced", "TraceError", "VIEW_OPS", "hf_capture_patch", "lower", "sdpa_backends",
           "to_compute_dtype", "trace", "trace_model", "trace_step", "updated_buffers", "with_precision"]


def with_precision(graph: Graph, precision: Any) -> Graph:
    """`graph` recording the master and reduction dtypes of `precision` (an
    autopar.precision.Precision whose compute dtype is the graph's): what the cost model
    charges the weights, optimizer state and gradient syncs in."""
    if graph.model.dtype != precision.compute:
        raise ValueError(f"the step was traced in {graph.model.dtype}, but the precision policy computes in "
                         f"{precision.compute}")
    return replace(graph, model=replace(graph.model, master_dtype=precision.master, reduce_dtype=precision.reduce))


def to_compute_dtype(model: nn.Module, microbatch: Sequence[Any], dtype: str) -> tuple[Any, ...]:
    """`autopar.precision.cast_parameters(model, dtype)`, and `microbatch` with its
    floating-point tensors cast to `dtype` (what the step computes in: FSDP2's
    `cast_forward_inputs`); integer tensors (tokens, labels, counters) are unchanged."""
    cast_parameters(model, dtype)
    target = getattr(torch, dtype)
    return tuple(map_tensors(lambda t: t.to(target) if t.is_floating_point() else t, microbatch))


def trace_model(
    source: ModelSource,
    *,
    batch: int,
    dtype: str = "float32",
    layers_traced: int | None = None,
    recompute: str = "none",
    captured: dict[tuple[int, str, int], Traced] | None = None,
) -> Graph:
    """Trace a zoo model on fake tensors and lower it.

    `layers_traced` traces only that many layers and scales the layer group to the real
    depth (costs of a uniform model are per-layer sums, so this is exact for them).
    `recompute` rewrites the step for that policy, as the runtime traces it.
    `captured`: the caller's memo of the policy-free captures by (batch, dtype, depth);
    each policy is rewritten on a copy of the memoised capture
    (autopar/recompute.py `recompute_copy`).
    """
    if source.config is None:
        assert source.factory is not None
        model, inputs = source.factory()
        traced = trace(model, inputs, recompute=recompute)
        return lower(traced, name=source.name, batch=_batch_of(inputs), seq=_seq_of(inputs))
    if batch <= 0:
        raise ValueError(f"global batch must be a positive integer, got {batch}")
    cfg = source.config
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use float32 or bfloat16")
    depth = cfg.layers if layers_traced is None else max(1, min(layers_traced, cfg.layers))

    key = (batch, dtype, depth)
    if captured is None or key not in captured:
        with FakeTensorMode():
            # built as the ranks build it (float32), then its parameters cast to `dtype`, as the
            # runtime casts them (`cast_parameters`): the same traced step, node for node
            model = source.build(layers=depth)
            cast_parameters(model, dtype)
            tokens, labels = source.example_inputs(batch)
        if captured is None:
            traced = trace(model, (tokens, labels), recompute=recompute)
            return lower(traced, name=source.name, batch=batch, seq=cfg.seq, real_layers=cfg.layers, config=cfg)
        captured[key] = trace(model, (tokens, labels))

    traced = recompute_copy(captured[key], recompute)
    return lower(traced, name=source.name, batch=batch, seq=cfg.seq, real_layers=cfg.layers, config=cfg)


def trace_step(model: nn.Module, microbatch: Sequence[Any], *, loss_fn: LossFn | None = None,
               recompute: str = "none", precision: Any = None) -> tuple[Any, Graph]:
    """Trace and lower the training step of `model` on one global microbatch, rewritten
    for the recomputation policy (autopar/recompute.py). With a `precision` policy
    (autopar.precision.Precision) the model and the microbatch's floating-point tensors are
    first cast to its compute dtype, in place (`to_compute_dtype`), and the graph records
    the policy."""
    if precision is not None:
        microbatch = to_compute_dtype(model, microbatch, precision.compute)
    traced = trace(model, tuple(microbatch), loss_fn=loss_fn, recompute=recompute)
    batch, seq = batch_size(microbatch), seq_len(microbatch)
    graph = lower(traced, name=type(model).__name__, batch=batch, seq=seq, config=getattr(model, "cfg", None))
    if precision is not None:
        graph = with_precision(graph, precision)
    return traced, graph


def _batch_of(inputs: Sequence[Any]) -> int:
    return batch_size(inputs)


def _seq_of(inputs: Sequence[Any]) -> int:
    return seq_len(inputs)

