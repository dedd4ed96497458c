"""The autopar IR: a frozen, torch-free picture of one traced training step.

Where it sits: `autopar.trace.lower(gm)` builds a `Graph` from the joint forward+backward
FX graph; every later stage (strategies, costs, solvers, plan) reads it and nothing
writes it. FX stops at the tracer: from here on a node is a `NodeId` (an int, its
position in `Graph.nodes`), never an `fx.Node`.

Terms:
- node: one ATen op (or placeholder) of the joint graph, with its output tensors' metadata.
- role: what a node's value is to the training step (parameter, input, activation,
  gradient, loss, ...). Gradients are the values the step returns for parameters.
- phase: forward or backward, as the tracer's partitioner tags say.
- layer: index of the repeated block (`layers.<i>`) a node came from, or None.
- segment: which part of the step a node belongs to, stamped once by `lower()` (the
  pipeline's first stage holds "pre", every stage some "layer" nodes, the last "post"):
  "layer" for a node of the repeated layers; "post" for the loss; otherwise "pre" when
  the node precedes the first layer node or its module was seen before it (the
  embedding's backward and parameters), else "post" (final norm, head, loss). A module
  is named by its path down to one level below where it leaves the layer container's
  path (`wte` beside `layers`; `hf.transformer.ln_f` beside `hf.transformer.h`).
- layer group: layers with the same structure (same ops, shapes and wiring). A group's
  `multiplicity` is how many layers of the real model it stands for: a trace of 2
  layers of a 126-layer model has one group with multiplicity 126, so a cost computed
  for one representative layer scales to the whole model.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Sequence

from autopar.precision import of_model, unrecorded_dtype
from autopar.units import DTYPE_BYTES  # noqa: F401  (re-exported: the IR's tensors count bytes by it)

NodeId = int

SEGMENTS: tuple[str, ...] = ("pre", "layer", "post")
"""The values of `Node.segment`, in pipeline order (module doc)."""


GROUPED_MM_FWD = "autopar.grouped_mm.default"
GROUPED_MM_BWD = "autopar.grouped_mm_backward.default"
"""The experts' grouped matmul and its backward (autopar/grouped_mm.py), by IR name."""
GEMM_OPS: frozenset[str] = frozenset({
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
    GROUPED_MM_FWD, GROUPED_MM_BWD,
})
"""The matmul ops (tensor-core work priced as GEMMs, kept by selective recomputation)."""
ATTENTION_FWD_OPS: frozenset[str] = frozenset({
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
})
"""The fused attention kernels SDPA dispatches to (CPU flash, flash, memory-efficient,
cuDNN), forward. The one home of this set: the tracer's FLOPs, the cost model's and the
ILP's op classes, recomputation and the pipeline chunks' checkpoint policy read it."""
ATTENTION_BWD_OPS: frozenset[str] = frozenset({
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
    "aten._scaled_dot_product_flash_attention_backward.default",
    "aten._scaled_dot_product_efficient_attention_backward.default",
    "aten._scaled_dot_product_cudnn_attention_backward.default",
})
"""Their backward ops (inputs start with grad_out, then q, k, v)."""
ATTENTION_OPS: frozenset[str] = ATTENTION_FWD_OPS | ATTENTION_BWD_OPS
_IS_CAUSAL_POSITION: dict[str, int] = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": 4,
    "aten._scaled_dot_product_flash_attention.default": 4,
    "aten._scaled_dot_product_efficient_attention.default": 6,
    "aten._scaled_dot_product_cudnn_attention.default": 6,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": 7,
    "aten._scaled_dot_product_flash_attention_backward.default": 11,
    "aten._scaled_dot_product_efficient_attention_backward.default": 11,
    "aten._scaled_dot_product_cudnn_attention_backward.default": 14,
}
"""Position of `is_causal` among each attention op's positional arguments (ATen schemas of
torch 2.13; tests/unit/test_trace.py checks them against torch's own schemas)."""


class Role(str, enum.Enum):
    PARAMETER = "parameter"
    BUFFER = "buffer"
    INPUT = "input"
    TANGENT = "tangent"
    ACTIVATION = "activation"
    GRADIENT = "gradient"
    LOSS = "loss"


class Phase(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True, slots=True)
class Ref:
    """A reference to another node's value inside `Node.args`."""

    node: NodeId


@functools.lru_cache(maxsize=8192)
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a contiguous (row-major) tensor of `shape`, as torch gives them
    (a zero-size dim steps as a size-1 one). Arithmetic only: no tensor is made. Cached:
    the search's reshard pricing asks for the same few shapes about a million times on a
    DeepSeek-V3-like model."""
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= max(d, 1)
    return tuple(reversed(out))


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str
    stride: tuple[int, ...] = ()
    """Element strides as traced; empty means contiguous."""

    @property
    def strides(self) -> tuple[int, ...]:
        """`stride`, or the contiguous strides of `shape` when none were recorded."""
        return self.stride or contiguous_strides(self.shape)

    @property
    def is_floating(self) -> bool:
        return self.dtype.startswith(("float", "bfloat", "complex"))

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def size_bytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    id: NodeId
    name: str
    """The FX node name, for people reading explain output."""
    op: str
    """`aten.mm.default`, `placeholder`, `getitem`, ..."""
    inputs: tuple[NodeId, ...]
    """Tensor-valued inputs in argument order (duplicates kept)."""
    args: tuple[Any, ...]
    """All positional arguments, tensors as `Ref`, lists as tuples, dtypes as strings."""
    kwargs: tuple[tuple[str, Any], ...] = ()
    outputs: tuple[TensorMeta, ...]
    """Output tensors; a multi-output op has several, read through `getitem` nodes."""
    output_slots: tuple[int, ...] = ()
    """For a multi-output op: the position in the op's result tuple of each entry of
    `outputs` (results that are None, e.g. masked gradients, have none). Empty: 0, 1, ..."""
    role: Role
    phase: Phase
    flops: int = 0
    bytes_moved: int = 0
    """Bytes read plus written if the op ran alone (views and getitem move nothing)."""
    is_view: bool = False
    module_path: str = ""
    layer: int | None = None
    param_name: str | None = None
    """For parameters and buffers their state-dict name; for gradients the parameter's."""
    segment: str = ""
    """"pre", "layer" or "post" (module doc), stamped by `autopar.trace.lower`; "" on a
    node built by hand."""

    def output_position(self, slot: int) -> int:
        """Index into `outputs` of result-tuple position `slot` (what a getitem reads)."""
        return self.output_slots.index(slot) if self.output_slots else slot

    @property
    def output(self) -> TensorMeta:
        assert len(self.outputs) == 1, f"node {self.id} ({self.op}) has {len(self.outputs)} outputs"
        return self.outputs[0]

    @property
    def output_bytes(self) -> int:
        return sum(t.size_bytes for t in self.outputs)

    @property
    def is_causal(self) -> bool:
        """A fused attention op (ATTENTION_OPS) with a causal mask: its `is_causal` argument,
        by keyword or at its schema position; False for every other op."""
        position = _IS_CAUSAL_POSITION.get(self.op)
        if position is None:
            return False
        kwargs = dict(self.kwargs)
        if "is_causal" in kwargs:
            return bool(kwargs["is_causal"])
        return len(self.args) > position and self.args[position] is True


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerGroup:
    index: int
    signature: str
    """Structural hash shared by every layer of the group."""
    layers: tuple[int, ...]
    """Traced layer indices in this group."""
    nodes: tuple[tuple[NodeId, ...], ...]
    """Per traced layer, its nodes in graph order; position k means the same op in every layer."""
    multiplicity: int
    """Number of layers of the real model this group stands for."""

    @property
    def scale(self) -> float:
        """Weight of each traced layer: multiplicity / traced layers."""
        return self.multiplicity / len(self.layers)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInfo:
    name: str
    num_parameters: int
    """Parameters of the real model (after layer scaling, tied weights counted once)."""
    num_layers: int
    """Repeated layers of the real model."""
    batch: int
    seq: int
    dtype: str
    family: str = ""
    hidden: int = 0
    heads: int = 0
    kv_heads: int = 0
    vocab: int = 0
    ffn: int = 0
    master_dtype: str = ""
    """The dtype of the weights the optimizer updates, and of its state; "" is float32
    (autopar/precision.py `of_model`: the trace's `dtype` is the compute dtype)."""
    reduce_dtype: str = ""
    """The dtype gradients are accumulated and reduced in; "" is float32."""

    @property
    def precision(self) -> Any:
        """The precision policy this step is priced and run under (autopar.precision.Precision)."""
        return of_model(self.dtype, self.master_dtype, self.reduce_dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class Graph:
    model: ModelInfo
    nodes: tuple[Node, ...]
    loss: NodeId
    param_grads: tuple[tuple[NodeId, NodeId], ...]
    """(parameter node, gradient node) for every parameter that receives a gradient."""
    layer_groups: tuple[LayerGroup, ...]
    tied_params: tuple[tuple[NodeId, NodeId], ...] = ()
    """(alias, canonical) parameter nodes that are one tensor (tied embeddings): the joint
    graph has an input and a gradient per name; memory and the optimizer count it once and
    the two gradients are summed."""
    buffer_updates: tuple[tuple[NodeId, NodeId], ...] = ()
    """(buffer node, node computing its new value) for each buffer the forward updates in
    place (BatchNorm's running statistics and batch count, a step counter): the program
    writes the value back into the buffer, in the buffer's placement, after every
    microbatch, as a single process running the same microbatches does (the ILP prices
    the edge value -> buffer like any other)."""
    trace_time_s: float = 0.0
    compiled: bool = False
    """The program runs this step's graphs through Inductor (ParallelConfig.compiled,
    codegen/inductor.py): every price of its ops reads this (cost_model/table.py)."""
    _users: tuple[tuple[NodeId, ...], ...] = field(default=(), repr=False, compare=False)
    _weights: tuple[float, ...] = field(default=(), repr=False, compare=False)
    _derived: frozenset[NodeId] = field(default=frozenset(), repr=False, compare=False)

    def grad_meta(self, grad: NodeId) -> TensorMeta:
        """Gradient node `grad`'s tensor as it is accumulated over microbatches and synced:
        in the precision policy's reduction dtype (ModelInfo.precision; float32 where a
        bf16-mixed step computes it in bfloat16). Every price of a gradient's accumulation
        and sync reads this, as the program's gradient buckets are (codegen/apply.py)."""
        meta = self[grad].output
        reduce = self.model.reduce_dtype or unrecorded_dtype(self.model.dtype)
        if meta.dtype == reduce or meta.dtype not in ("float32", "bfloat16", "float16", "float64"):
            return meta
        return replace(meta, dtype=reduce)

    def parameter_derived(self) -> frozenset[NodeId]:
        """Nodes computed from parameters alone (a weight, its transpose, a cast of it): on a
        data-parallel axis these may be gathered (ZeRO), activations may not; their gathers
        travel in groups (autopar/buckets.py gather_group). Computed once per graph (the
        search's solves read it several times each)."""
        return self._derived

    def __post_init__(self) -> None:
        for i, node in enumerate(self.nodes):
            assert node.id == i, f"node ids must be positions: node {node.id} at {i}"
        users: list[list[NodeId]] = [[] for _ in self.nodes]
        for node in self.nodes:
            for src in dict.fromkeys(node.inputs):
                users[src].append(node.id)
        object.__setattr__(self, "_users", tuple(tuple(u) for u in users))
        weights = [1.0] * len(self.nodes)
        for group in self.layer_groups:
            for layer_nodes in group.nodes:
                for nid in layer_nodes:
                    weights[nid] = group.scale
        object.__setattr__(self, "_weights", tuple(weights))
        derived: set[NodeId] = set()
        for node in self.nodes:
            if node.role is Role.PARAMETER or (node.inputs and node.op != "placeholder"
                                               and all(i in derived for i in node.inputs)):
                derived.add(node.id)
        object.__setattr__(self, "_derived", frozenset(derived))

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __getitem__(self, node_id: NodeId) -> Node:
        return self.nodes[node_id]

    def users(self, node_id: NodeId) -> tuple[NodeId, ...]:
        return self._users[node_id]

    def by_role(self, role: Role) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.role is role)

    def weight(self, node_id: NodeId) -> float:
        """How many real-model copies this traced node stands for (1 outside layers)."""
        return self._weights[node_id]

    @property
    def flops_per_step(self) -> int:
        """Forward+backward FLOPs of the real model for one step of `model.batch` sequences."""
        w = self._weights
        return int(round(sum(n.flops * w[n.id] for n in self.nodes)))

    @property
    def ops(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return dict(sorted(counts.items()))

    def fingerprint(self) -> str:
        """sha256 of the structure (ops, wiring, shapes, dtypes, multiplicities)."""
        h = hashlib.sha256()
        for n in self.nodes:
            h.update(
                json.dumps(
                    [n.op, n.inputs, [[t.shape, t.dtype] for t in n.outputs], n.role.value],
                    separators=(",", ":"),
                ).encode()
            )
        h.update(json.dumps([[g.layers, g.multiplicity] for g in self.layer_groups]).encode())
        if self.buffer_updates:
            h.update(json.dumps(self.buffer_updates).encode())
        return h.hexdigest()

    def node_keys(self) -> tuple[str, ...]:
        """A name per node that does not depend on how many layers were traced: `L<sig>.<k>`
        for the k-th node of a layer of the group with structural signature <sig> (every
        layer of a group shares it: layer sharing gives them one placement), `N<i>` for
        the i-th node outside the repeated layers. A plan searched on a two-layer trace
        names the same ops as the full model's trace."""
        keys: dict[NodeId, str] = {}
        for group in self.layer_groups:
            for layer_nodes in group.nodes:
                for k, nid in enumerate(layer_nodes):
                    keys[nid] = f"L{group.signature[:16]}.{k}"
        out, i = [], 0
        for node in self.nodes:
            if node.id in keys:
                out.append(keys[node.id])
            else:
                out.append(f"N{i}")
                i += 1
        return tuple(out)

    def summary(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "num_parameters": self.model.num_parameters,
            "num_layers": self.model.num_layers,
            "batch": self.model.batch,
            "seq": self.model.seq,
            "dtype": self.model.dtype,
            "flops_per_step": self.flops_per_step,
            "num_nodes": len(self.nodes),
            "num_ops": len(self.ops),
            "ops": self.ops,
            "layer_groups": [
                {
                    "index": g.index,
                    "signature": g.signature[:12],
                    "traced_layers": list(g.layers),
                    "multiplicity": g.multiplicity,
                    "nodes_per_layer": len(g.nodes[0]),
                }
                for g in self.layer_groups
            ],
            "trace_time_s": round(self.trace_time_s, 3),
            "fingerprint": self.fingerprint(),
        }


def layer_signature(nodes: Sequence[Node], members: Sequence[NodeId]) -> str:
    """Structural hash of one layer: ops, shapes, dtypes, and wiring relative to the layer
    (`LayerGroup.signature`)."""
    pos = {nid: k for k, nid in enumerate(members)}
    h = hashlib.sha256()
    for nid in members:
        nd = nodes[nid]
        wiring = [pos[i] if i in pos else f"ext:{nodes[i].role.value}" for i in nd.inputs]
        scalars = tuple(a for a in nd.args if not isinstance(a, Ref)
                        and not (isinstance(a, tuple) and any(isinstance(x, Ref) for x in a)))
        h.update(repr((nd.op, nd.phase.value, [(t.shape, t.dtype) for t in nd.outputs], wiring, scalars)).encode())
    return h.hexdigest()


class _NotABatchScaling(Exception):
    pass


def extrapolate_batch(one: Graph, two: Graph, batch: int) -> Graph | None:
    """The traced step at `batch` sequences from its traces at b and 2b sequences (`one`,
    `two`: the same model, tracer and options; `batch` a multiple of b), or None where the
    two do not differ as a batch scaling.

    Every integer the two traces hold at the same place (shapes, strides, scalar arguments)
    must be equal (independent of the batch) or double (proportional to it); FLOPs and bytes
    moved are affine in the batch (weights' bytes are fixed, activations' grow); every other
    value (ops, wiring, dtypes, floats, names) must be equal. Anything else gives None and
    the caller traces. b = 1 is not used: a one-sequence trace records the strides of its
    size-1 batch dimension as the input slice had them. A search traces a model at many
    microbatches of one structure (solver/spmd_search.py `traced`); a trace costs about a
    second, this a few milliseconds. tests/unit/test_trace.py checks it equals the trace
    for the zoo's families and recompute policies."""
    b = one.model.batch
    if b < 2 or two.model.batch != 2 * b or len(one.nodes) != len(two.nodes) or batch < 1 or batch % b:
        return None
    if batch in (b, 2 * b):
        return one if batch == b else two
    k = batch // b

    def same(x: Any, y: Any) -> Any:
        if type(x) is not type(y):
            raise _NotABatchScaling
        if isinstance(x, int) and not isinstance(x, bool):
            if x == y:
                return x
            if y == 2 * x:
                return x * k
            raise _NotABatchScaling
        if isinstance(x, TensorMeta):
            if x.dtype != y.dtype:
                raise _NotABatchScaling
            return TensorMeta(shape=same(x.shape, y.shape), dtype=x.dtype, stride=same(x.stride, y.stride))
        if isinstance(x, (tuple, list)):
            if len(x) != len(y):
                raise _NotABatchScaling
            return type(x)(same(u, v) for u, v in zip(x, y))
        if x != y:
            raise _NotABatchScaling
        return x

    def affine(x: int, y: int) -> int:
        return x + (y - x) * (k - 1)

    try:
        nodes = []
        for x, y in zip(one.nodes, two.nodes):
            if (x.op, x.inputs, x.role, x.phase, x.layer, x.module_path, x.param_name, x.is_view, x.segment,
                    x.output_slots, x.name) != (y.op, y.inputs, y.role, y.phase, y.layer, y.module_path, y.param_name,
                                                y.is_view, y.segment, y.output_slots, y.name):
                raise _NotABatchScaling
            nodes.append(replace(x, args=same(x.args, y.args), kwargs=same(x.kwargs, y.kwargs),
                                 outputs=same(x.outputs, y.outputs), flops=affine(x.flops, y.flops),
                                 bytes_moved=affine(x.bytes_moved, y.bytes_moved)))
    except _NotABatchScaling:
        return None
    if (one.loss, one.param_grads, one.tied_params, one.buffer_updates) \
            != (two.loss, two.param_grads, two.tied_params, two.buffer_updates) \
            or [(g.layers, g.nodes, g.multiplicity) for g in one.layer_groups] \
            != [(g.layers, g.nodes, g.multiplicity) for g in two.layer_groups] \
            or replace(one.model, batch=two.model.batch) != two.model or one.compiled != two.compiled:
        return None
    groups = tuple(replace(g, signature=layer_signature(nodes, g.nodes[0])) for g in one.layer_groups)
    return Graph(model=replace(one.model, batch=batch), nodes=tuple(nodes), loss=one.loss,
                 param_grads=one.param_grads, layer_groups=groups, tied_params=one.tied_params,
                 buffer_updates=one.buffer_updates, compiled=one.compiled)
