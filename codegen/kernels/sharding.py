"""Sharding strategies of the fused ops, registered into DTensor's registry.

Where it sits: codegen/kernels, imported by ops.py when the fused ops are registered, so
any process that has the ops also has their strategies: the strategy enumeration
(solver/intra_op/space.py) offers them to the ILP and DTensor's dispatcher runs them in the
per-rank program (codegen/apply.py). These are the project rules for ops the registry
lacks (DESIGN: "project rules only where it lacks an op"); each is written for one mesh
axis and expanded over the mesh by DTensor's `expand_to_full_mesh_op_strategy`.

Per op (R replicated, S(d) sharded on dim d, P pending sum), every rule also has
all-replicated:
- rms_norm(x, w) -> (y, rstd); layer_norm(x, w, b) -> (y, mean, rstd): rows split, i.e.
  x, y and the statistics S(d) for any dim d but the normalised last one, w and b R.
- rms_norm_backward(dy, x, w, rstd) -> (dx, dw); layer_norm_backward(dy, x, w, mean,
  rstd) -> (dx, dw, db): the same row split; the weight (and bias) gradients are sums
  over the rows, so P.
- swiglu(gate, up) -> y and swiglu_backward(dy, gate, up) -> (dgate, dup): elementwise, S(d)
  for any dim.
- bias_gelu(x, bias) -> y: S(d) of x for any dim but the last with the bias R; the last
  dim (features) sharded with the bias S(0). bias_gelu_backward(dy, x, bias) -> (dx,
  dbias): the same, dbias P when rows are split, S(0) when features are.
The vocabulary-parallel cross-entropy (cross_entropy.py) needs collectives inside the op
and has no DTensor rule: in the per-op program the loss stays ATen ops, which DTensor
shards (its rule keeps the vocabulary whole).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy

R, P = Replicate(), Partial()


def _ndim(schema: OpSchema, arg: int) -> int:
    return schema.args_schema[arg].ndim


def _expand(schema: OpSchema, rows: list[list[Any]], num_outputs: int) -> OpStrategy:
    mesh = schema.get_mesh_from_args(validate=False)
    return expand_to_full_mesh_op_strategy(mesh, schema, rows, input_index=num_outputs)


def _norm(schema: OpSchema, stats: int) -> OpStrategy:
    # rms_norm(x, w, eps) -> (y, rstd); layer_norm(x, w, b or None, eps) -> (y, mean, rstd)
    tensors = sum(1 for a in schema.args_schema if isinstance(a, OpStrategy))
    nd = _ndim(schema, 0)
    rows = [[R] * (1 + stats + tensors)]
    rows += [[Shard(d)] * (1 + stats) + [Shard(d)] + [R] * (tensors - 1) for d in range(nd - 1)]
    return _expand(schema, rows, num_outputs=1 + stats)


def _norm_backward(schema: OpSchema, grads: int) -> OpStrategy:
    # rms: (dy, x, w, rstd) -> (dx, dw); layer: (dy, x, w, mean, rstd) -> (dx, dw, db)
    tensors = sum(1 for a in schema.args_schema if isinstance(a, OpStrategy))
    nd = _ndim(schema, 0)
    rows = [[R] * (grads + tensors)]
    for d in range(nd - 1):
        stats = [Shard(d)] * (tensors - 3)
        rows.append([Shard(d)] + [P] * (grads - 1) + [Shard(d), Shard(d), R] + stats)
    return _expand(schema, rows, num_outputs=grads)


def _swiglu(schema: OpSchema) -> OpStrategy:
    nd = _ndim(schema, 0)
    return _expand(schema, [[R, R, R]] + [[Shard(d)] * 3 for d in range(nd)], num_outputs=1)


def _swiglu_backward(schema: OpSchema) -> OpStrategy:
    nd = _ndim(schema, 0)
    return _expand(schema, [[R] * 5] + [[Shard(d)] * 5 for d in range(nd)], num_outputs=2)


def _bias_gelu(schema: OpSchema) -> OpStrategy:
    nd = _ndim(schema, 0)
    rows = [[R, R, R]] + [[Shard(d), Shard(d), R] for d in range(nd - 1)]
    rows.append([Shard(nd - 1), Shard(nd - 1), Shard(0)])
    return _expand(schema, rows, num_outputs=1)


def _bias_gelu_backward(schema: OpSchema) -> OpStrategy:
    # (dy, x, bias) -> (dx, dbias)
    nd = _ndim(schema, 0)
    rows = [[R] * 5] + [[Shard(d), P, Shard(d), Shard(d), R] for d in range(nd - 1)]
    rows.append([Shard(nd - 1), Shard(0), Shard(nd - 1), Shard(nd - 1), Shard(0)])
    return _expand(schema, rows, num_outputs=2)


RULES = {
    "rms_norm": (functools.partial(_norm, stats=1), 2), "layer_norm": (functools.partial(_norm, stats=2), 3),
    "rms_norm_backward": (functools.partial(_norm_backward, grads=2), 4),
    "layer_norm_backward": (functools.partial(_norm_backward, grads=3), 5),
    "swiglu": (_swiglu, 2), "swiglu_backward": (_swiglu_backward, 3),
    "bias_gelu": (_bias_gelu, 2), "bias_gelu_backward": (_bias_gelu_backward, 3),
}
"""op name in the autopar library -> (strategy function, index of its first non-tensor
argument, which keys DTensor's sharding cache)."""


@functools.lru_cache(maxsize=1)
def register() -> None:
    """Register RULES (once per process; needs the ops registered: ops.py calls this)."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    for name, (fn, static_from) in RULES.items():
        op = getattr(torch.ops.autopar, name).default
        if op not in propagator.op_strategy_funcs:
            register_op_strategy(op, schema_info=RuntimeSchemaInfo(static_from))(fn)
