"""Strategy enumeration: which placements each op of the joint graph can run in.

Where it sits: `enumerate_strategies(graph, mesh_shape) -> StrategySpace`, read by
cost_model/table.py and the intra-op ILP; its output is torch-free. The strategies come from
DTensor's sharding registry (torch 2.13: ~160 op-strategy functions and ~1,000
single-dim strategies, `DTensor._op_dispatcher.sharding_propagator`), so what the ILP
chooses among is exactly what DTensor's dispatcher executes (codegen/apply.py runs the
chosen strategies through it). autopar/dtensor_bridge.py holds the project rules for ops
the registry lacks (CPU flash attention).

How, per node:
- placeholders: parameters, buffers and inputs may be replicated or sharded on any
  evenly dividing dim per axis (never pending sums); the loss tangent is replicated.
  A parameter's strategy also names where its weight update runs (`update_layouts`):
  the compute layout itself, or one sharded further over axes the compute layout
  replicates (weight-update sharding: ZeRO-1/2 over those axes).
- `getitem` follows its producer; ops without tensor inputs (factories) are replicated.
- single-dim strategy ops: the op's per-axis rules ([outputs, inputs] with "any shard"
  placeholders filled by the dim they name, plus all-replicated), combined over the
  mesh axes (product; a size-1 axis takes the replicated rule only).
- op-strategy functions: called once per candidate placement of the op's leading tensor
  argument(s) (every replicated/sharded/pending-sum layout over the mesh), the other
  tensor arguments replicated; the functions return the inputs they want with the
  output they make.
- neither: DTensor's decomposition-based strategy (the op traced through its
  decomposition); failing that, replicated, with a warning naming the op and module.
Kept: combinations whose every sharded dim divides evenly (inputs and outputs), with
no pending sum on an integer tensor and one kind of pending reduction per tensor, and
no strided shards or max/min partials (autopar/placement.py). A pending average
(`P(avg)`, what a mean over a sharded dim leaves) is kept as an output only: as an
input it would only double every linear op's options (an average can always be
reduced first), which multiplies the ILP's edge variables for no plan it could not
express otherwise. An embedding's masked
(vocab-parallel) indices are asked for as replicated: the dispatcher masks them locally.
Infeasible strategies are absent, never priced high.

Terms: "axis" is a mesh axis, "dim" a tensor dimension.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Replicate as DReplicate, Shard as DShard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
from torch.distributed.tensor.placement_types import _MaskPartial

from autopar import dtensor_bridge as bridge
from autopar.ir import Graph, Node, Ref, Role, TensorMeta
from autopar.placement import Partial, Placements, Replicate, Shard, evenly_divisible
from autopar.sharding import NodeStrategy, StrategySpace

log = logging.getLogger(__name__)

R = Replicate()
AVG = Partial("avg")

SOURCE_OPS = ("placeholder", "constant")


_PLAIN_PLACEMENTS = frozenset({"Shard", "Replicate", "Partial"})
"""DTensor placement class names that are not its _MaskPartial (a subclass of Partial)."""


def _is_mask(p: Any) -> bool:
    if type(p).__name__ in _PLAIN_PLACEMENTS:  # torch's opaque placement metaclass makes isinstance misses slow
        return False
    return isinstance(p, _MaskPartial)



@dataclass(frozen=True, slots=True)
class _Candidates:
    """Strategies found for one (op, shapes, scalar args) key, before expansion is cached."""

    strategies: tuple[NodeStrategy, ...]
    derived: str
    """"registry", "decomposition" or "replicated" (no rule)."""


def _valid(meta: TensorMeta, placements: Placements, mesh_shape: tuple[int, ...]) -> bool:
    if not evenly_divisible(meta.shape, placements, mesh_shape):
        return False
    partial_kinds = {str(p) for p in placements if isinstance(p, Partial)}
    if partial_kinds and not meta.is_floating:
        return False
    return len(partial_kinds) <= 1


def _layouts(meta: TensorMeta, mesh_shape: tuple[int, ...], *, partial: bool) -> list[Placements]:
    """Every replicated/sharded (and with `partial`, pending-sum/avg) layout of `meta`."""
    per_axis: list[Any] = [R] + [Shard(d) for d in range(len(meta.shape)) if meta.shape[d] > 1]
    if partial:
        per_axis.append(Partial("sum"))
    options = [per_axis if n > 1 else [R] for n in mesh_shape]
    return [c for c in itertools.product(*options) if _valid(meta, c, mesh_shape)]


def _source_strategies(node: Node, mesh_shape: tuple[int, ...]) -> tuple[NodeStrategy, ...]:
    (meta,) = node.outputs
    if node.role is Role.TANGENT or node.op == "constant":
        layouts = [(R,) * len(mesh_shape)]
    else:
        layouts = _layouts(meta, mesh_shape, partial=False)
    plain = tuple(NodeStrategy(outputs=(pl,), inputs=()) for pl in layouts)
    if node.role is not Role.PARAMETER:
        return plain
    return plain + tuple(NodeStrategy(outputs=(pl,), inputs=(), update=u)
                         for pl in layouts for u in update_layouts(pl, layouts))


def update_layouts(compute: Placements, layouts: list[Placements]) -> list[Placements]:
    """The weight-update placements a parameter computed in `compute` may take besides
    `compute` itself (autopar.sharding.NodeStrategy.update): the parameter's own layouts
    that shard it further on one axis where `compute` replicates it and equal `compute`
    on every other axis, sharding no dim on two axes (the update shard is gathered back to
    `compute` once per step by one all-gather). Compute Replicate and update Shard over
    the data-parallel axis is ZeRO-1/2 (Xu et al. 2020). One axis, not several at once:
    the update is sharded over the replicas of one mesh axis, as Megatron's distributed
    optimizer and ZeRO shard it over data parallelism, and the ILP's parameter options
    stay few (every option is a column of the gradient's edge)."""
    out = []
    for u in layouts:
        differ = [k for k, (c, p) in enumerate(zip(compute, u)) if c != p]
        if len(differ) != 1 or not isinstance(compute[differ[0]], Replicate):
            continue
        dims = [p.dim for p in u if isinstance(p, Shard)]
        if len(dims) == len(set(dims)):
            out.append(u)
    return out


def _getitem_strategies(node: Node, producer: Node, strategies: tuple[NodeStrategy, ...]) -> tuple[NodeStrategy, ...]:
    pos = producer.output_position(node.args[1])
    seen: dict[NodeStrategy, None] = {}
    for s in strategies:
        seen.setdefault(NodeStrategy(outputs=(s.outputs[pos],), inputs=(s.outputs[pos],)), None)
    return tuple(seen)


_CANDIDATES: dict[tuple, dict[tuple, _Candidates]] = {}
"""Candidates per mesh class (`mesh_class`: the number of axes and which have size 1),
memoised across enumerations (`_Enumerator.key`): a search enumerates one model's step at
many microbatches on many submeshes, and most nodes recur with sizes that differ only in
ways the strategies do not read (which products of mesh axes divide them). Cleared past
MAX_MEMO_ENTRIES (a long-lived process)."""
MAX_MEMO_ENTRIES = 200_000
EXACT_INTS = 16
"""Integers up to this magnitude key the memo exactly (dims, small sizes); larger ones (sizes
that scale with the batch) by `divisibility_signature`'s reading: which products of mesh
axes divide them."""


def mesh_class(mesh_shape: tuple[int, ...]) -> tuple:
    """What a node's candidates read of the mesh beside its sizes' divisibility: the number
    of axes and which have size 1 (DTensor's rules see a size-1 axis as nothing to split)."""
    return (len(mesh_shape), tuple(s == 1 for s in mesh_shape))


def axis_products(mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The products of every non-empty set of mesh axes, in a fixed order of the sets (so two
    meshes of one class read an integer's divisibility position by position alike)."""
    return tuple(math.prod(c) for r in range(1, len(mesh_shape) + 1)
                 for c in itertools.combinations(mesh_shape, r))


class _Enumerator:
    """DTensor-backed candidates per node, memoised by (op, input metas, scalar args)."""

    def __init__(self, graph: Graph, mesh_shape: tuple[int, ...]) -> None:
        bridge.register_project_rules()
        self.bridge = bridge
        self.graph = graph
        self.mesh_shape = mesh_shape
        self.mesh = bridge.spec_mesh(mesh_shape)
        if sum(len(c) for c in _CANDIDATES.values()) > MAX_MEMO_ENTRIES:
            _CANDIDATES.clear()
        self.cache: dict[tuple, _Candidates] = _CANDIDATES.setdefault(mesh_class(mesh_shape), {})
        self.products = axis_products(mesh_shape)

    # -- helpers ----------------------------------------------------------------------

    def _in_metas(self, node: Node) -> list[TensorMeta]:
        return [self.graph[i].outputs[0] for i in node.inputs]

    def _schema(self, op: Any, node: Node, placements_of: Any) -> Any:
        """OpSchema of `node` with each tensor argument as DTensorSpec(placements_of(k))."""
        bridge = self.bridge
        metas = self._in_metas(node)
        counter = itertools.count()

        def tensor(_ref: Ref) -> Any:
            k = next(counter)
            meta = metas[k]
            return bridge.spec(self.mesh, placements_of(k), bridge.tensor_meta(meta.shape, meta.strides, meta.dtype))

        args, kwargs = bridge.op_args(op, node.args, node.kwargs, tensor)
        return OpSchema(op, args, kwargs, schema_info=bridge.PROPAGATOR.op_to_schema_info.get(op))

    def _drivers(self, node: Node) -> list[set[int]]:
        """Groups of positions (in node.inputs) to lay out together when probing an
        op-strategy function: each tensor argument alone, and all tensors of a list
        argument (cat, stack) at once. Functions follow one argument (view follows its
        input, nll_loss_backward its logits, not its scalar grad_output); which one is
        op-specific, so every argument takes the lead in turn."""
        groups, k = [], 0
        for a in tuple(node.args) + tuple(v for _, v in node.kwargs):
            if isinstance(a, Ref):
                groups.append({k})
                k += 1
            elif isinstance(a, tuple):
                refs = sum(1 for x in a if isinstance(x, Ref))
                if refs:
                    groups.append(set(range(k, k + refs)))
                k += refs
        return groups

    def _convert(self, node: Node, outs: Any, ins: Any) -> NodeStrategy | None:
        """A DTensor (outputs, inputs) pair as a NodeStrategy aligned with the IR node, or
        None when it uses a layout autopar leaves out or does not fit the shapes."""
        bridge = self.bridge
        if any(sum(_is_mask(p) for p in o) > 1 for o in outs if o is not None):
            return None  # a table sharded by vocabulary over two axes: DTensor's masking
            # traces a data-dependent check there (aten.equal); one axis is supported
        # masked embedding indices arrive replicated: the dispatcher masks them locally
        ins = [tuple(DReplicate() if _is_mask(p) else p for p in pl) for pl in ins]
        try:
            out_pl = [None if o is None else bridge.from_dtensor_placements(o) for o in outs]
            in_pl = [bridge.from_dtensor_placements(i) for i in ins]
        except bridge.UnsupportedPlacement:
            return None
        slots = node.output_slots or tuple(range(len(node.outputs)))
        if len(out_pl) == 1 and len(node.outputs) == 1:
            chosen_outs = [out_pl[0]]
        else:
            if max(slots, default=-1) >= len(out_pl):
                return None
            chosen_outs = [out_pl[s] for s in slots]
        if any(o is None for o in chosen_outs) or len(in_pl) != len(node.inputs):
            return None
        if any(p == AVG for pl in in_pl for p in pl):
            return None
        metas = self._in_metas(node)
        if not all(_valid(m, pl, self.mesh_shape) for m, pl in zip(metas, in_pl)):
            return None
        if not all(_valid(m, pl, self.mesh_shape) for m, pl in zip(node.outputs, chosen_outs)):
            return None
        return NodeStrategy(outputs=tuple(chosen_outs), inputs=tuple(in_pl))

    # -- registry paths -----------------------------------------------------------------

    def _single_dim(self, op: Any, node: Node) -> list[tuple[Any, Any]]:
        bridge = self.bridge
        info = bridge.PROPAGATOR.op_single_dim_strategy_funcs[op]
        metas = self._in_metas(node)
        counter = itertools.count()

        def tensor(_ref: Ref) -> Any:
            meta = metas[next(counter)]
            return bridge.tensor_meta(meta.shape, meta.strides, meta.dtype)

        args, kwargs = bridge.op_args(op, node.args, node.kwargs, tensor)
        rows = [[DShard(p.dim) if isinstance(p, _ShardingPlaceholder) else p for p in row]
                for row in info.func(op, args, kwargs)]
        num_in = len(node.inputs)
        num_out = (len(rows[0]) - num_in) if rows else len(node.output_slots or node.outputs)
        rows.append([DReplicate()] * (num_out + num_in))
        per_axis = [rows if n > 1 else rows[-1:] for n in self.mesh_shape]
        pairs = []
        for combo in itertools.product(*per_axis):
            outs = [None if any(r[k] is None for r in combo) else tuple(r[k] for r in combo) for k in range(num_out)]
            ins = [tuple(r[num_out + k] for r in combo) for k in range(num_in)]
            if any(p is None for pl in ins for p in pl):
                continue
            pairs.append((outs, ins))
        return pairs

    def _op_strategy(self, op: Any, node: Node, strategy_fn: Any) -> list[tuple[Any, Any]]:
        bridge = self.bridge
        metas = self._in_metas(node)
        replicated = (R,) * len(self.mesh_shape)
        pairs = []
        # the project's rules list their strategies whatever the inputs: one probe
        drivers = [set()] if op in bridge.PROJECT_RULES else self._drivers(node)
        for g, group in enumerate(drivers):
            layouts = _layouts(metas[min(group)], self.mesh_shape, partial=True) if group else [replicated]
            for layout in layouts:
                if layout == replicated and g:
                    continue  # all-replicated probed once
                schema = self._schema(op, node, lambda k: layout if k in group else replicated)
                try:
                    strategy = strategy_fn(bridge.PROPAGATOR._wrap_with_op_strategy(schema))
                except Exception:  # a strategy function refusing this layout: not a candidate
                    continue
                for spec in getattr(strategy, "strategies", ()):
                    outs = spec.output_specs
                    outs = [outs.placements] if isinstance(outs, DTensorSpec) else [
                        None if o is None else o.placements for o in outs]
                    if spec.input_specs is None:
                        if len(outs) != 1:
                            continue
                        ins = [outs[0]] * len(node.inputs)
                    else:
                        ins = [s.placements for s in spec.input_specs if s is not None]
                    pairs.append((outs, ins))
        return pairs

    def _decomposition(self, op: Any, node: Node) -> list[tuple[Any, Any]]:
        """DTensor's decomposition-derived strategies. It tries the placements present in
        the inputs it is given (Shard on any dim once one input is sharded), so it is asked
        twice: with the first non-scalar input sharded, and with it a pending sum."""
        bridge = self.bridge
        decomp = bridge.PROPAGATOR.decomp_strategy
        if not decomp.has_decomp(op):
            return []
        decomp.ensure_schema_info(op)
        replicated = (R,) * len(self.mesh_shape)
        axis = next((i for i, n in enumerate(self.mesh_shape) if n > 1), 0)
        metas = self._in_metas(node)
        first = next((k for k, m in enumerate(metas) if m.shape), 0)  # the first non-scalar input
        pairs = []
        for seed in (Shard(0), Partial("sum")):
            lead = tuple(seed if i == axis else R for i in range(len(self.mesh_shape)))
            try:
                strategy = decomp.propagate_strategy(self._schema(op, node, lambda k: lead if k == first else replicated))
            except Exception:  # decomposition not traceable for sharding: no candidates from it
                continue
            for spec in getattr(strategy, "strategies", ()):
                outs = spec.output_specs
                outs = [outs.placements] if isinstance(outs, DTensorSpec) else [
                    None if o is None else o.placements for o in outs]
                ins = [s.placements for s in spec.input_specs if s is not None] if spec.input_specs else []
                pairs.append((outs, ins))
        return pairs

    def _resolve_ambiguous(self, op: Any, node: Node, inputs: Placements, choices: list[NodeStrategy]) -> NodeStrategy | None:
        """Several outputs for the same inputs: keep the one DTensor's dispatcher makes."""
        bridge = self.bridge
        try:
            result = bridge.PROPAGATOR.propagate_op_sharding_non_cached(self._schema(op, node, lambda k: inputs[k]))
        except Exception:
            return None
        out = result.output_spec
        outs = [out.placements] if hasattr(out, "placements") else [None if o is None else o.placements for o in out]
        made = self._convert(node, outs, [bridge.to_dtensor_placements(pl) for pl in inputs])
        return next((c for c in choices if made is not None and c.outputs == made.outputs), None)

    # -- per node -----------------------------------------------------------------------

    def key(self, node: Node) -> tuple:
        """What a node's candidates depend on: its op, output slots, input and output dtypes
        and ranks, and its integers (shapes, strides, scalar arguments) as
        divisibility_signature reads them: which products of mesh axes divide them, small
        ones exactly as well. Two nodes of one key get equal candidates, on any mesh of one
        class (the premise divisibility_signature's whole-graph sharing rests on;
        tests/unit/test_intra_op.py checks it across microbatches and submeshes)."""
        products = self.products

        def norm(x: Any) -> Any:
            if isinstance(x, bool) or x is None or isinstance(x, (float, str)):
                return x
            if isinstance(x, int):
                divides = tuple(x % p == 0 for p in products)
                return (x, divides) if -EXACT_INTS <= x <= EXACT_INTS else divides
            if isinstance(x, (tuple, list)):
                return tuple(norm(y) for y in x)
            return x

        def meta(t: TensorMeta) -> tuple:
            return (norm(t.shape), t.dtype, norm(t.stride))

        return (node.op, tuple(meta(t) for t in self._in_metas(node)), tuple(meta(t) for t in node.outputs),
                node.output_slots, norm(_scalar_args(node)))

    def candidates(self, node: Node) -> _Candidates:
        key = self.key(node)
        hit = self.cache.get(key)
        if hit is None:
            hit = self.cache[key] = self._candidates(node)
        return hit

    def _candidates(self, node: Node) -> _Candidates:
        bridge = self.bridge
        op = bridge.resolve_op(node.op)
        pairs: list[tuple[Any, Any]] = []
        derived = "replicated"
        if op is not None:
            prop = bridge.PROPAGATOR
            if op in prop.op_single_dim_strategy_funcs:
                pairs, derived = self._single_dim(op, node), "registry"
            elif op in prop.op_strategy_funcs:
                pairs, derived = self._op_strategy(op, node, prop.op_strategy_funcs[op]), "registry"
            else:
                pairs, derived = self._decomposition(op, node), "decomposition"
        by_inputs: dict[Placements, list[NodeStrategy]] = {}
        for outs, ins in pairs:
            s = self._convert(node, outs, ins)
            if s is not None and s not in by_inputs.setdefault(s.inputs, []):
                by_inputs[s.inputs].append(s)
        strategies: list[NodeStrategy] = []
        for inputs, choices in by_inputs.items():
            if len(choices) == 1:
                strategies.append(choices[0])
            else:
                picked = self._resolve_ambiguous(op, node, inputs, choices)
                if picked is not None:
                    strategies.append(picked)
        replicated = NodeStrategy(outputs=tuple((R,) * len(self.mesh_shape) for _ in node.outputs),
                                  inputs=tuple((R,) * len(self.mesh_shape) for _ in node.inputs))
        if replicated not in strategies:
            strategies.insert(0, replicated)
        else:  # replicated first: the fallback and the tie-break of last resort
            strategies.remove(replicated)
            strategies.insert(0, replicated)
        if len(strategies) == 1 and not pairs:
            derived = "replicated"
        return _Candidates(strategies=tuple(strategies), derived=derived)


def enumerate_strategies(graph: Graph, mesh_shape: tuple[int, ...]) -> StrategySpace:
    """Feasible strategies of every node on a `mesh_shape` logical mesh (1-3 axes)."""
    if not mesh_shape or any(not isinstance(s, int) or s <= 0 for s in mesh_shape):
        raise ValueError(f"mesh shape must be positive axis sizes such as (8,) or (8, 8), got {mesh_shape}")
    mesh_shape = tuple(mesh_shape)
    enumerator = _Enumerator(graph, mesh_shape)
    strategies: list[tuple[NodeStrategy, ...]] = []
    fallback: dict[str, str] = {}
    for node in graph.nodes:
        if node.op in SOURCE_OPS:
            strategies.append(_source_strategies(node, mesh_shape))
        elif node.op == "getitem":
            strategies.append(_getitem_strategies(node, graph[node.inputs[0]], strategies[node.inputs[0]]))
        elif not node.inputs:
            strategies.append((NodeStrategy(outputs=tuple((R,) * len(mesh_shape) for _ in node.outputs), inputs=()),))
        else:
            found = enumerator.candidates(node)
            if found.derived == "replicated" and math.prod(mesh_shape) > 1:
                fallback.setdefault(node.op, node.module_path or "<top level>")
            strategies.append(found.strategies)
    follows = tuple(_pointwise_lead(graph, node, strategies) for node in graph.nodes)
    for op, module in sorted(fallback.items()):
        log.warning("no sharding strategy for %s (module %s) in DTensor's registry or from its decomposition: "
                    "replicated on every device", op, module)
    return StrategySpace(mesh_shape=mesh_shape, strategies=tuple(strategies),
                         fallback_ops=tuple(sorted(fallback)), follows=follows)


def divisibility_signature(graph: Graph, mesh_shape: tuple[int, ...]) -> tuple:
    """What `enumerate_strategies(graph, mesh_shape)` reads of the graph's numbers: the graph's
    structure (ops, wiring, dtypes, roles) and, for every integer in its shapes, strides and
    scalar arguments in order, whether it is 1 and which products of mesh axes divide it.
    The strategies depend on sizes only through these (even sharding, size-1 dims, DTensor's
    rules), so two graphs with equal signatures get equal strategy spaces: the pipeline
    search enumerates once per signature, not per microbatch, for the traces of one model
    at several microbatches (solver/pipeline_search.py). tests/unit/test_intra_op.py checks
    the spaces are equal wherever the signatures are."""
    products = sorted({math.prod(c) for r in range(1, len(mesh_shape) + 1)
                       for c in itertools.combinations(mesh_shape, r)} - {1})
    ints: list[int] = []

    def walk(x: Any) -> None:
        if isinstance(x, bool):
            return
        if isinstance(x, int):
            ints.append(x)
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)

    structure = []
    for n in graph.nodes:
        walk(n.args)
        walk(n.kwargs)
        for t in n.outputs:
            walk(t.shape)
            walk(t.stride)
        structure.append((n.op, n.inputs, n.role.value, n.output_slots, tuple(t.dtype for t in n.outputs),
                          tuple(len(t.shape) for t in n.outputs), _scalar_types(n.args)))
    return (tuple(mesh_shape), tuple(structure), graph.layer_groups and tuple(g.nodes for g in graph.layer_groups),
            tuple((v == 1,) + tuple(v % p == 0 for p in products) for v in ints))


def _scalar_types(args: tuple) -> tuple:
    return tuple(type(a).__name__ if not isinstance(a, tuple) else _scalar_types(a) for a in args)


def _pointwise_lead(graph: Graph, node: Node, strategies: list[tuple[NodeStrategy, ...]]) -> int | None:
    """For a pointwise op with several tensor operands: the operand whose layout it follows
    (solver/intra_op/sharing.py): of the operands shaped like the output, the one whose producer
    offers the most layouts (not a broadcast scalar's single replicated one); None for
    other ops."""
    if len(set(node.inputs)) < 2 or len(node.outputs) != 1:
        return None
    op = bridge.resolve_op(node.op)
    if op is None or torch.Tag.pointwise not in op.tags:
        return None
    shape = node.outputs[0].shape
    options = [(len({s.outputs[0] for s in strategies[i]}), -p) for p, i in enumerate(node.inputs)
               if graph[i].outputs and len(graph[i].outputs) == 1 and graph[i].outputs[0].shape == shape]
    if not options:
        return None
    count, neg_pos = max(options)
    return -neg_pos if count > 1 else None


def _scalar_args(node: Node) -> tuple:
    """Non-tensor arguments, with tensor references replaced by a marker."""
    def strip(a: object) -> object:
        if isinstance(a, Ref):
            return "T"
        if isinstance(a, tuple):
            return tuple(strip(x) for x in a)
        return a
    return strip(node.args), strip(node.kwargs)


def coverage(graph: Graph, space: StrategySpace) -> float:
    """Share of the step's FLOPs done by ops with more than the replicated choice: how much
    of the graph the ILP can shard (bytes moved stand in for a graph with no FLOPs)."""
    use_flops = graph.flops_per_step > 0
    total = covered = 0.0
    for node in graph.nodes:
        if node.op in SOURCE_OPS or node.op == "getitem" or node.is_view:
            continue
        work = graph.weight(node.id) * (node.flops if use_flops else node.bytes_moved)
        total += work
        if len(space[node.id]) > 1:
            covered += work
    return covered / total if total else 1.0
