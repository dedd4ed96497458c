"""The torch side of placements: DTensor's sharding registry and redistribution planner.

Where it sits: shared by the strategy enumeration (solver/intra_op/space.py), the pricing of
resharding (cost_model/table.py) and the apply step (codegen/apply.py), so that the three
agree by construction: the strategies the ILP chooses from are DTensor's own, the
collectives an edge is priced for are the ones DTensor's redistribute performs, and the
program runs the chosen strategies through DTensor's dispatcher.

What it holds:
- conversions between autopar's torch-free placements (autopar/placement.py) and
  DTensor's (`to_dtensor`, `from_dtensor`);
- `spec_mesh(mesh_shape)`: a DeviceMesh with no process group behind it, enough for
  strategy functions and the redistribution planner (they read only its shape);
- `resolve_op`, `op_args`: an IR node's ATen overload and its arguments rebuilt with
  torch types (dtype, device, layout, memory format from their text form);
- `register_project_rules()`: strategies for the ops DTensor has no rule for that the
  traced graphs contain (CPU flash attention, forward and backward; the experts' grouped
  matmul of autopar/grouped_mm.py), registered into
  DTensor's own registry so enumeration and dispatch both see them;
- `transforms(...)`: the per-axis collectives DTensor's planner uses for a reshard;
- `dispatching(op, outputs)`: DTensor's dispatch of one op of the plan takes the plan's
  strategy for it without searching every strategy again (below).

Terms: "axis" is a mesh axis, "dim" a tensor dimension.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor import _sharding_prop
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, RuntimeSchemaInfo, TupleStrategy
from torch.distributed.tensor._ops.single_dim_strategy import _PreparedSingleDimStrategy
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy
from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached
from torch.distributed.tensor.placement_types import _MaskPartial, _StridedShard

from autopar import grouped_mm
from autopar.ir import Ref, contiguous_strides
from autopar.placement import Partial, Placement, Placements, Replicate, Shard, redistribute_supported

aten = torch.ops.aten
PROPAGATOR = DTensor._op_dispatcher.sharding_propagator


class UnsupportedPlacement(ValueError):
    """A DTensor placement autopar's strategy space leaves out (strided shards, max/min partials)."""


# ---------------------------------------------------------------------------------------
# placements


def to_dtensor(p: Placement) -> Any:
    if isinstance(p, Replicate):
        return DReplicate()
    if isinstance(p, Shard):
        return DShard(p.dim)
    if isinstance(p, Partial):
        return DPartial(p.reduce_op)
    raise TypeError(f"not a placement: {p!r}")


def from_dtensor(p: Any) -> Placement:
    # the exact classes first: torch's placement classes answer isinstance through an
    # opaque-object metaclass whose misses cost about a microsecond each, and strategy
    # enumeration converts millions of placements (a 70B search: 4.2M isinstance calls)
    t = type(p)
    if t is DReplicate:
        return Replicate()
    if t is DShard:
        return Shard(p.dim)
    if t is DPartial and p.reduce_op in ("sum", "avg"):
        return Partial(p.reduce_op)
    if isinstance(p, _StridedShard):
        raise UnsupportedPlacement(f"strided shard {p}")
    if isinstance(p, DReplicate):
        return Replicate()
    if isinstance(p, DShard):
        return Shard(p.dim)
    if isinstance(p, _MaskPartial):
        # a vocabulary-sharded embedding's pending sum: codegen/apply.py zeroes the rows
        # outside each shard right after the lookup, so it is a plain pending sum
        return Partial("sum")
    if isinstance(p, DPartial):
        if p.reduce_op not in ("sum", "avg"):
            raise UnsupportedPlacement(f"partial {p.reduce_op}")
        return Partial(p.reduce_op)
    raise UnsupportedPlacement(f"placement {p!r}")


def to_dtensor_placements(placements: Placements) -> tuple[Any, ...]:
    return tuple(to_dtensor(p) for p in placements)


def from_dtensor_placements(placements: Any) -> Placements:
    return tuple(from_dtensor(p) for p in placements)


# ---------------------------------------------------------------------------------------
# meshes, ops, arguments


@functools.lru_cache(maxsize=None)
def spec_mesh(mesh_shape: tuple[int, ...]) -> DeviceMesh:
    """A DeviceMesh of this shape with no process group (rank 0's view): strategy
    functions and the redistribution planner read only its shape."""
    ranks = torch.arange(max(1, int(torch.tensor(mesh_shape).prod().item()))).view(*mesh_shape)
    return DeviceMesh("cpu", ranks, _init_backend=False, _rank=0)


@functools.lru_cache(maxsize=None)
def resolve_op(name: str) -> Any:
    """`aten.mm.default` -> torch.ops.aten.mm.default (None for non-op nodes)."""
    parts = name.split(".")
    if len(parts) < 3:
        return None
    namespace, op, overload = parts[0], ".".join(parts[1:-1]), parts[-1]
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except AttributeError:
        return None


_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format,
                   "channels_last": torch.channels_last, "channels_last_3d": torch.channels_last_3d}


def _torch_scalar(value: Any, type_text: str) -> Any:
    """Undo the IR's text form of a non-tensor argument, by its schema type."""
    if not isinstance(value, str):
        return value
    if "ScalarType" in type_text:
        return getattr(torch, value)
    if "Layout" in type_text:
        return getattr(torch, value)
    if "MemoryFormat" in type_text:
        return _MEMORY_FORMATS[value]
    if "Device" in type_text:
        return torch.device(value)
    return value


def op_args(op: Any, args: tuple[Any, ...], kwargs: tuple[tuple[str, Any], ...],
            tensor: Callable[[Any], Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Rebuild an IR node's (args, kwargs) for `op`: tensor references become `tensor(ref)`,
    tuples become lists where the schema takes a list, text becomes torch types."""
    schema_args = {a.name: a for a in op._schema.arguments}
    positional = list(op._schema.arguments)

    def conv(value: Any, type_text: str) -> Any:
        if isinstance(value, Ref):
            return tensor(value)
        if isinstance(value, tuple):
            items = [conv(v, type_text) for v in value]
            return items if ("[]" in type_text or "List" in type_text) else tuple(items)
        return _torch_scalar(value, type_text)

    def type_of(arg: Any) -> str:  # real_type names ScalarType/Layout/MemoryFormat (type says int)
        return str(getattr(arg, "real_type", arg.type))

    out_args = tuple(conv(v, type_of(positional[i]) if i < len(positional) else "") for i, v in enumerate(args))
    out_kwargs = {k: conv(v, type_of(schema_args[k]) if k in schema_args else "") for k, v in kwargs}
    return out_args, out_kwargs


def tensor_meta(shape: tuple[int, ...], stride: tuple[int, ...], dtype: str) -> TensorMeta:
    """DTensor's TensorMeta; empty `stride` means contiguous.

    The contiguous strides are computed, not read off a tensor: apply calls this while
    make_fx traces the per-rank step (`dispatching`'s traced metadata), where creating even
    a meta tensor is recorded into the program, as an `aten.empty` node run at every step."""
    return TensorMeta(torch.Size(shape), tuple(stride or contiguous_strides(shape)), getattr(torch, dtype))


def spec(mesh: DeviceMesh, placements: Placements, meta: TensorMeta) -> DTensorSpec:
    return DTensorSpec(mesh, to_dtensor_placements(placements), tensor_meta=meta)


# ---------------------------------------------------------------------------------------
# project rules: ops the registry lacks


def _expand(op_schema: OpSchema, single: list[list[Any]], num_outputs: int) -> Any:
    mesh = op_schema.get_mesh_from_args(validate=False)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, single, input_index=num_outputs)


def _attention_masks(op_schema: OpSchema) -> list[Any]:
    """Tensor kwargs of an attention op (its `attn_mask`, as torch.export's graphs of
    Hugging Face models pass it: shape (batch, 1, q, k), broadcast over heads). They follow
    the batch split where they have a batch (a mask of batch 1, as T5's cross-attention
    bias of zeros, is broadcast: whole) and stay whole under a head split (the placements
    list ends with them). One placement per mask under the batch split."""
    masks = [a for a in op_schema.kwargs_schema.values() if isinstance(a, OpStrategy)]
    return [DReplicate() if len(m.shape) and m.shape[0] == 1 else DShard(0) for m in masks]


def _cpu_flash_attention(op_schema: OpSchema) -> Any:
    # (q, k, v[, attn_mask]) -> (out, logsumexp); as DTensor's rule for the CUDA kernels:
    # replicated, batch-sharded or head-sharded, every tensor alike (a mask: see above)
    r, b, h = DReplicate(), DShard(0), DShard(1)
    masks = _attention_masks(op_schema)
    return _expand(op_schema, [[r] * (5 + len(masks)), [b] * 5 + masks, [h] * 5 + [r] * len(masks)], num_outputs=2)


def _cpu_flash_attention_backward(op_schema: OpSchema) -> Any:
    # (grad_out, q, k, v, out, logsumexp[, attn_mask]) -> (grad_q, grad_k, grad_v)
    tensors = sum(1 for a in op_schema.args_schema if isinstance(a, OpStrategy))
    masks = _attention_masks(op_schema)
    r, b, h = DReplicate(), DShard(0), DShard(1)
    return _expand(op_schema, [[r] * (3 + tensors + len(masks)), [b] * (3 + tensors) + masks,
                               [h] * (3 + tensors) + [r] * len(masks)], num_outputs=3)


def _dims(op_schema: OpSchema, k: int) -> int:
    return len(op_schema.args_schema[k].shape)


def _follows_input(op_schema: OpSchema) -> Any:
    # (self) -> a copy of it (lift_fresh_copy: a traced constant made a fresh tensor):
    # any layout of the input, the output alike
    r = DReplicate()
    return _expand(op_schema, [[r, r]] + [[DShard(d), DShard(d)] for d in range(_dims(op_schema, 0))], num_outputs=1)


def _fill_tensor(op_schema: OpSchema) -> Any:
    # (self, value: 0-dim) -> self's shape, every element `value` (T5's decoder inputs set
    # their first position to the start token): filled shard by shard, the value whole
    r = DReplicate()
    return _expand(op_schema, [[r, r, r]] + [[DShard(d), DShard(d), r] for d in range(_dims(op_schema, 0))],
                   num_outputs=1)


def _copy(op_schema: OpSchema) -> Any:
    # (self, src) -> src's values in self's layout (functional copy_): elementwise where the
    # shapes agree, a whole (broadcast) src where they do not
    r = DReplicate()
    same = tuple(op_schema.args_schema[0].shape) == tuple(op_schema.args_schema[1].shape)
    n = _dims(op_schema, 0)
    return _expand(op_schema, [[r, r, r]] + [[DShard(d), DShard(d), DShard(d) if same else r] for d in range(n)],
                   num_outputs=1)


def _grouped_mm(op_schema: OpSchema) -> Any:
    # (x [S, K], w [E, K, N], ids [S], experts [E]) -> out [S, N] (autopar/grouped_mm.py):
    # whole; the rows split (x, ids and out on S, the weights whole: each rank its own
    # tokens); expert-parallel (weights and experts split on E, x whole, each rank its
    # experts' rows: a pending sum); column-parallel (w on N, out on N); row-parallel (x and
    # w on K: a pending sum)
    r, p, s0 = DReplicate(), DPartial(), DShard(0)
    return _expand(op_schema, [[r] * 5, [s0, s0, r, s0, r], [p, r, s0, r, s0], [DShard(1), r, DShard(2), r, r],
                               [p, DShard(1), DShard(1), r, r]], num_outputs=1)


def _grouped_mm_backward(op_schema: OpSchema) -> Any:
    # (x, w, ids, experts, grad [S, N]) -> (grad_x [S, K], grad_w [E, K, N]): the forward's
    # five layouts, each gradient laid out as its tensor (grad_w a pending sum where the
    # rows are split; grad_x one where x was whole and only part of the contraction over N
    # or of the experts is local)
    r, p = DReplicate(), DPartial()
    s0, s1, s2 = DShard(0), DShard(1), DShard(2)
    return _expand(op_schema, [[r] * 7, [s0, p, s0, r, s0, r, s0], [p, s0, r, s0, r, s0, r],
                               [p, s2, r, s2, r, r, s1], [s1, s1, s1, s1, r, r, r]], num_outputs=2)


PROJECT_RULES: dict[Any, tuple[Callable[[OpSchema], Any], int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: (_cpu_flash_attention, 3),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (_cpu_flash_attention_backward, 6),
    aten.lift_fresh_copy.default: (_follows_input, 1),
    aten.fill.Tensor: (_fill_tensor, 2),
    aten.copy.default: (_copy, 2),
    grouped_mm.FORWARD_OP: (_grouped_mm, 4),
    grouped_mm.BACKWARD_OP: (_grouped_mm_backward, 5),
}
"""op -> (strategy function, index of the first non-tensor argument that keys the cache)."""


@functools.lru_cache(maxsize=1)
def register_project_rules() -> None:
    """Register PROJECT_RULES into DTensor's registry (once per process; ops DTensor
    already covers are left alone), and let dispatch take the plan's strategies
    (`dispatching`)."""
    for op, (fn, static_from) in PROJECT_RULES.items():
        if op not in PROPAGATOR.op_strategy_funcs and op not in PROPAGATOR.op_single_dim_strategy_funcs:
            register_op_strategy(op, schema_info=RuntimeSchemaInfo(static_from))(fn)
    if _sharding_prop._expand_single_dim_strategy_to_mesh is not _expand_chosen_first:
        _FULL_EXPANSION.append(_sharding_prop._expand_single_dim_strategy_to_mesh)
        _sharding_prop._expand_single_dim_strategy_to_mesh = _expand_chosen_first
    if not _FAKE_RUN:
        _FAKE_RUN.append(PROPAGATOR._propagate_tensor_meta_non_cached)
        PROPAGATOR._propagate_tensor_meta_non_cached = _meta_traced_first


# ---------------------------------------------------------------------------------------
# dispatching the plan's strategy
#
# For an op with single-axis rules (most of ATen's in torch 2.13), DTensor's sharding
# propagation expands the rules to every combination over the mesh's axes and prices the
# redistribution of every input to each (S^N combinations for S rules on N axes), then
# takes the cheapest. It does so for every distinct op schema, and under make_fx (which
# builds the per-rank program, codegen/apply.py) without its cache: measured on a
# two-layer Llama's dp2 x tp2 and pp2 x dp2 programs, that search was about a third of
# the apply step's time on each rank. The apply step has already redistributed the op's
# inputs to the placements the plan chose, so the search would only find again what the
# ILP chose. Under `dispatching(op, outputs)`, DTensor first matches the inputs against
# its own single-axis rules axis by axis (`_PreparedSingleDimStrategy.try_propagate`, the
# fast path of DTensor's own Dijkstra search): where that match gives the plan's output
# placements, it is the strategy, at zero redistribution cost; otherwise (several rules
# for the same inputs, strided shards, tensor keyword arguments) the full search runs as
# before. Either way the apply step checks the output placements against the plan's.
#
# Before either, DTensor computes the op's global output shape, strides and dtype by
# running it on fake tensors of the inputs' global shapes (about a tenth of the apply
# step's time in the same measurement). The traced step recorded exactly that when it ran the
# same op on the same global shapes: where the apply step passes the traced output
# (`traced`: a single-tensor op whose inputs have the traced shapes and dtypes), DTensor
# takes it.

_CHOSEN: contextvars.ContextVar[tuple[Any, tuple[tuple[Any, ...], ...], Any] | None] = \
    contextvars.ContextVar("autopar_chosen_strategy", default=None)
_FULL_EXPANSION: list[Callable[..., Any]] = []
"""DTensor's own expansion, kept when `register_project_rules` installs `_expand_chosen_first`."""
_FAKE_RUN: list[Callable[..., Any]] = []
"""DTensor's own output-metadata propagation (a fake run of the op), kept when
`register_project_rules` installs `_meta_traced_first`."""


@contextlib.contextmanager
def dispatching(op: Any, outputs: tuple[Placements, ...],
                traced: tuple[tuple[tuple[tuple[int, ...], str], ...], TensorMeta] | None = None) -> Any:
    """While DTensor dispatches `op`, whose inputs are already in the plan's placements,
    its sharding propagation takes the strategy whose outputs are `outputs` (autopar
    placements, one tuple per tensor output) when its rules match the inputs directly.
    `traced`: (the tensor inputs' global (shape, dtype) pairs, the output's TensorMeta) as
    the traced step recorded them, for an op with one tensor output; DTensor takes that
    output metadata where its inputs have those shapes and dtypes."""
    token = _CHOSEN.set((op, tuple(to_dtensor_placements(o) for o in outputs), traced))
    try:
        yield
    finally:
        _CHOSEN.reset(token)


def _meta_traced_first(op_schema: OpSchema) -> Any:
    """DTensor's `_propagate_tensor_meta_non_cached` (same argument and result): the traced
    output's metadata where `dispatching` gives it for this op and these input shapes,
    DTensor's fake run otherwise."""
    chosen = _CHOSEN.get()
    if chosen is not None and chosen[2] is not None and chosen[0] is op_schema.op:
        shapes, meta = chosen[2]
        specs = [a for a in op_schema.args_schema if isinstance(a, DTensorSpec)]
        nested = any(isinstance(a, (list, tuple)) and any(isinstance(x, DTensorSpec) for x in a)
                     for a in op_schema.args_schema)
        if not nested and not any(isinstance(v, DTensorSpec) for v in op_schema.kwargs_schema.values()) \
                and tuple((tuple(s.tensor_meta.shape), str(s.tensor_meta.dtype).removeprefix("torch."))
                          for s in specs) == shapes:
            return meta
    return _FAKE_RUN[0](op_schema)


def _chosen_match(mesh: DeviceMesh, op_schema: OpSchema, info: Any, out_meta: Any,
                  outputs: tuple[tuple[Any, ...], ...]) -> OpStrategy | None:
    """The one-strategy OpStrategy DTensor's rules give for the inputs as they are, if its
    outputs are `outputs`; None where the rules do not match them directly."""
    specs = []
    for arg in op_schema.args_schema:
        if isinstance(arg, TupleStrategy):  # a list of tensors: the full search models it
            return None
        if isinstance(arg, OpStrategy):
            if len(arg.strategies) != 1:
                return None
            specs.append(arg.strategies[0].output_spec)
    if not specs or any(isinstance(v, (OpStrategy, TupleStrategy)) for v in op_schema.kwargs_schema.values()):
        return None
    if any(isinstance(p, _StridedShard) for s in specs for p in s.placements):
        return None
    prepared = _PreparedSingleDimStrategy(info, op_schema, out_meta, num_inputs=len(specs))
    found = prepared.try_propagate(mesh, tuple(s.placements for s in specs), specs)
    if found is None:
        return None
    made = found.strategies[0].output_specs
    made = made if isinstance(made, tuple) else (made,)
    if tuple(m.placements for m in made if m is not None) != outputs:
        return None
    return found


def _expand_chosen_first(mesh: DeviceMesh, op_schema: OpSchema, info: Any, out_meta: Any) -> Callable[..., Any]:
    """DTensor's `_expand_single_dim_strategy_to_mesh` (same arguments, same result type):
    the plan's strategy where `dispatching` names this op and DTensor's rules match it
    directly, DTensor's full expansion otherwise."""
    full = _FULL_EXPANSION[0](mesh, op_schema, info, out_meta)
    chosen = _CHOSEN.get()
    if chosen is None or chosen[0] is not op_schema.op:
        return full

    def expanded(op: Any, args_schema: Any, kwargs_schema: Any) -> Any:
        found = _chosen_match(mesh, op_schema, info, out_meta, chosen[1])
        return found if found is not None else full(op, args_schema, kwargs_schema)

    return expanded


# ---------------------------------------------------------------------------------------
# redistribution


def comm_kind(src: Any, dst: Any) -> str:
    """What one per-axis transform of DTensor's planner does: all_reduce, reduce_scatter,
    all_gather, all_to_all, or local (chunking, partitioning: no communication)."""
    if src.is_partial() and dst.is_replicate():
        return "all_reduce"
    if src.is_partial() and (dst.is_shard() or isinstance(dst, _StridedShard)):
        return "reduce_scatter"
    if (src.is_shard() or isinstance(src, _StridedShard)) and dst.is_replicate():
        return "all_gather"
    if (src.is_shard() or isinstance(src, _StridedShard)) and (dst.is_shard() or isinstance(dst, _StridedShard)):
        return "all_to_all"
    return "local"


def transforms(shape: tuple[int, ...], stride: tuple[int, ...], dtype: str, src: Placements,
               dst: Placements, mesh_shape: tuple[int, ...]) -> list[tuple[str, int, tuple[int, ...]]]:
    """(kind, mesh axis, logical shape on that axis) per step DTensor's redistribute takes
    from `src` to `dst`; the logical shape is the tensor as that axis sees it (already
    divided by the shards of the other axes at that step). Raises ValueError where DTensor
    cannot redistribute (see `redistribute_supported`)."""
    if not redistribute_supported(src, dst):
        raise ValueError(f"DTensor cannot redistribute {src} to {dst}")
    if src == dst:
        return []
    mesh = spec_mesh(tuple(mesh_shape))
    meta = tensor_meta(shape, stride, dtype)
    infos = _gen_transform_infos_non_cached(spec(mesh, src, meta), spec(mesh, dst, meta))
    return [(comm_kind(*t.src_dst_placements), t.mesh_dim, tuple(int(d) for d in t.logical_shape))
            for t in infos]
