"""Apply a solved plan to the traced joint graph: the per-rank SPMD program.

Where it sits: codegen, between the intra-op solution (per-node strategies, solver/) and
the runtime (autopar/runtime/program.py). `apply(traced, graph, choices, mesh)` interprets the
traced joint forward+backward graph on DTensors whose placements are the ILP's: before
each op, every tensor argument is redistributed from its producer's placement to the one
the op's chosen strategy takes (the collectives of `_c10d_functional`, plus local
chunking), and the op runs through DTensor's dispatcher, which executes that strategy on
the local shards (shape arguments of views and factories rewritten to local shapes, an
embedding's indices masked for a vocabulary-sharded table). `make_fx` records the
interpretation as one per-rank graph of ATen ops and collectives: that graph is the
program (what `autopar train`, `compile(...).step` and `--emit` use, and what
`compiled.code` prints).

Two graphs come out:
- `step`: (parameters, buffers, inputs, loss tangent), all local shards -> (loss, raw
  gradients), each gradient in the placement its producing op left it in (typically a
  pending sum over the data-parallel axis);
- `grad_sync`: raw gradients -> gradients in their parameter's weight-update placement
  (all-reduce where the update is replicated, reduce-scatter where it is sharded: data
  parallelism and ZeRO are this one edge). The runtime runs it once per step, after the
  last microbatch, so gradient accumulation does not communicate (the cost model weighs
  these edges 1/m);
- `param_gather` (weight-update sharding only): the updated weights, held in their update
  placement, -> their compute placement (all-gathers), once per step after the optimizer
  step, so the step graph reads whole weights every microbatch without gathering them.

With one microbatch per step (`sync_in_step=True`) there is nothing to accumulate: each
gradient bucket's all-reduce / reduce-scatter is issued inside `step`, where the bucket's
last gradient is produced during the backward, so it runs beside the rest of the backward
(codegen/collectives.py `GradSync.issue` / `wait`, priced by cost_model/table.py
`exposed_sync_s`), and `step` returns the gradients in their parameters' placements (no
`grad_sync` graph). An all-reduce bucket is waited at the end of the step (it reduces in
place: waiting holds nothing more). Reduce-scatter buckets are per layer
(autopar/buckets.py `gradient_bucket_key`, as FSDP reduce-scatters per unit) and one is
in flight at a time: each is waited as the next one starts (FSDP's bound), so a layer's
full-size gradients are freed during the backward, one layer after they were produced,
not held to the end. Same buckets, same collectives, same bytes: the price (these edges
weighed 1/m = 1) is unchanged.

Every collective in the two graphs is one the ILP priced (price = run; the test counts
them); an activation read by several ops of one phase is resharded once per placement
where that communicates (solver/intra_op/shared_rows.py). The dispatcher's output
placement is checked against the chosen one at every node (a mismatch raises).

The collectives that are not one op's input edge (gradient buckets, the gather of updated
weights) and the count of a graph's collectives are in codegen/collectives.py.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch._decomp
import torch.distributed._functional_collectives as funcol
from torch import fx
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor.placement_types import _MaskPartial
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.graph import _BoxedCodeGen
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial as DPartial
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.fx.experimental.proxy_tensor import make_fx

from autopar import dtensor_bridge as bridge
from autopar.ir import Graph, NodeId, Role
from autopar.buckets import gather_group
from autopar.placement import Placements, Replicate, communicates, local_shape, single_gather_axis
from autopar.sharding import NodeStrategy
from codegen.collectives import (  # noqa: F401  count_collectives: the apply stage's surface (autopar/build)
    GradSync, StepSync, WeightGather, count_collectives, dtensor_of, redistribute_to)
from codegen.emit import program_source, slot_name
from codegen.inductor import CompileTimes, compile_graphs


class ApplyError(RuntimeError):
    """The dispatcher did not run the strategy the plan chose (a strategy-space bug)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Slot:
    """One input of the per-rank step: which graph input, its name and layout."""

    node: NodeId
    role: Role
    name: str
    """Parameter/buffer state-dict name, or the input's position ("input_0", ...)."""
    shape: tuple[int, ...]
    """Global shape."""
    dtype: str
    placements: Placements


@dataclass(slots=True, kw_only=True)
class RankGraphs:
    """The per-rank program of one plan on one mesh (torch objects: not plan data)."""

    step: fx.GraphModule
    grad_sync: fx.GraphModule | None
    """None when `step` syncs each gradient bucket itself (one microbatch per step)."""
    param_gather: fx.GraphModule | None
    """Update shards -> compute-placement weights of the `gathered` parameters, in order;
    None when every parameter is updated in its compute placement."""
    gathered: tuple[tuple[str, Placements, Placements], ...]
    """(parameter name, update placement, compute placement) of each parameter whose update
    runs in another placement than its compute (inputs/outputs of `param_gather`)."""
    slots: tuple[Slot, ...]
    """Inputs of `step`, in order (parameters, buffers, data inputs, loss tangent)."""
    loss_placements: Placements
    grads: tuple[tuple[str, Placements, Placements], ...]
    """(parameter name, raw gradient placement, parameter's update placement), outputs of
    `step` after the loss and inputs/outputs of `grad_sync`, in order."""
    mesh_shape: tuple[int, ...]
    source: str = field(default="")
    buffer_updates: tuple[str, ...] = ()
    """Buffers the forward updates in place (Graph.buffer_updates): `step` returns their new
    values last, each in its buffer's placement, for the runtime to write back."""
    compile_times: CompileTimes = field(default_factory=CompileTimes)
    """Seconds Inductor spent on each graph, filled at their first calls (`compiled` only)."""
    compiled: bool = False
    """The graphs run through Inductor (ParallelConfig.compiled; codegen/inductor.py)."""

    def local_shape(self, slot: Slot) -> tuple[int, ...]:
        return local_shape(slot.shape, slot.placements, self.mesh_shape)

    def compile_like_step(self, graphs: dict[str, fx.GraphModule]) -> None:
        """Graphs cut from `step` (a pipeline chunk's forward and backward, {label: graph})
        run as `step` does: through Inductor where this program is compiled."""
        if self.compiled:
            compile_graphs(graphs, self.compile_times)


def _runnable(op: Any) -> Any:
    """What runs `op` on DTensors. An op DTensor has no rule for, whose strategies the space
    derived from its decomposition (solver/intra_op/space.py), runs as that decomposition: its
    local kernel on shards may be wrong where the decomposition reads the global shape
    (mse_loss_backward's mean divides by numel: on a batch shard the kernel would divide by
    the shard's). The decomposed ops go through DTensor's registry one by one."""
    prop = bridge.PROPAGATOR
    if not isinstance(op, torch._ops.OpOverload) or op in prop.op_single_dim_strategy_funcs \
            or op in prop.op_strategy_funcs:
        return op
    table = torch._decomp.decomposition_table
    if op in table:
        return table[op]
    if op._can_decompose():
        return op.decompose
    return op


def _traced(op: Any, ir: Any, graph: Graph) -> tuple[tuple[tuple[tuple[int, ...], str], ...], Any] | None:
    """(input shapes and dtypes, output TensorMeta) of `ir` as traced, for an op with one tensor
    output (dtensor_bridge.dispatching); None for any other."""
    if not isinstance(op, torch._ops.OpOverload) or len(ir.outputs) != 1:
        return None
    returns = op._schema.returns
    if len(returns) != 1 or str(returns[0].type) != "Tensor":
        return None
    out = ir.output
    return (tuple((tuple(graph[u].output.shape), graph[u].output.dtype) for u in ir.inputs),
            bridge.tensor_meta(tuple(out.shape), tuple(out.stride), out.dtype))


def _has_direct_rule(op: Any) -> bool:
    """DTensor's registry runs `op` itself (not through a decomposition)."""
    prop = bridge.PROPAGATOR
    return not isinstance(op, torch._ops.OpOverload) or op in prop.op_single_dim_strategy_funcs \
        or op in prop.op_strategy_funcs


def _flat(args: Any, kwargs: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for a in (*args, *kwargs.values()):
        out.extend(a if isinstance(a, (list, tuple)) else [a])
    return out


def _is_replicated(a: Any) -> bool:
    return not isinstance(a, DTensor) or all(p.is_replicate() for p in a.placements)


def _on_whole_tensors(op: Any, mesh: DeviceMesh, *args: Any, **kwargs: Any) -> Any:
    """An op with no sharding rule and no decomposition (the strategy space offers it
    replicated only, solver/intra_op/space.py): every input is whole on every device, so the
    op runs on the local tensors and its outputs are replicated."""
    def unwrap(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return type(a)(unwrap(x) for x in a)
        return a._local_tensor if isinstance(a, DTensor) else a

    def wrap(o: Any) -> Any:
        if isinstance(o, (list, tuple)):
            return type(o)(wrap(x) for x in o)
        if isinstance(o, torch.Tensor):
            return dtensor_of(o, mesh, (Replicate(),) * mesh.ndim, o.shape, o.stride())
        return o

    return wrap(op(*unwrap(args), **{k: unwrap(v) for k, v in kwargs.items()}))


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
"""Ops that need a viewable (not necessarily contiguous) input."""


def _same(got: Any, want: Placements) -> bool:
    try:
        return bridge.from_dtensor_placements(got) == tuple(want)
    except bridge.UnsupportedPlacement:
        return False


def _settle_masks(out: Any) -> Any:
    """A vocabulary-sharded embedding leaves a masked pending sum whose mask lives in the
    placement object until the first reduction; zero the masked rows now and make it a
    plain pending sum, so every consumer edge can reduce it (as priced) independently."""
    if not isinstance(out, DTensor) or not any(isinstance(p, _MaskPartial) for p in out.placements):
        return out
    local = out._local_tensor
    placements = []
    for p in out.placements:
        if isinstance(p, _MaskPartial):
            p.mask_buffer.apply_mask(local)
            p.mask_buffer.release_mask()
            p = DPartial(p.reduce_op)
        placements.append(p)
    spec = DTensorSpec(out.device_mesh, tuple(placements), tensor_meta=out._spec.tensor_meta)
    return DTensor(local, spec, requires_grad=False)


def _wrap_replicated_plain_outputs(out: Any, choice: NodeStrategy, mesh: DeviceMesh) -> Any:
    """A multi-output op whose DTensor rule gives some tensor output no placement returns that
    output as a plain tensor: CUDA's flash attention returns its philox offset so (its rule
    places rng_state, not the offset), and the plan, traced on fake tensors, chose a placement
    for it. Where the plan chose it replicated, it is the same on every rank: wrap it as such,
    so the backward that takes it receives a DTensor. Seen on an H100 (torch 2.11), the first
    per-op program run on CUDA; CPU attention has no such output."""
    if isinstance(out, DTensor) or not isinstance(out, (tuple, list)):
        return out
    tensors = [i for i, o in enumerate(out) if isinstance(o, torch.Tensor)]
    plain = [i for i in tensors if not isinstance(out[i], DTensor)]
    if not plain or len(tensors) != len(choice.outputs):
        return out
    wanted = dict(zip(tensors, choice.outputs))
    if not all(all(isinstance(p, Replicate) for p in wanted[i]) for i in plain):
        return out  # a sharded choice cannot be inferred from a whole tensor: _check says so
    wrapped = list(out)
    for i in plain:
        wrapped[i] = dtensor_of(out[i], mesh, wanted[i], out[i].shape, out[i].stride())
    return tuple(wrapped) if isinstance(out, tuple) else wrapped


class _Interpreter:
    """Runs the joint graph on DTensors laid out as `choices` say."""

    def __init__(self, gm: fx.GraphModule, graph: Graph, choices: Sequence[NodeStrategy], mesh: DeviceMesh) -> None:
        self.gm = gm
        self.graph = graph
        self.choices = choices
        self.mesh = mesh
        self.fx_nodes = [n for n in gm.graph.nodes if n.op != "output"]
        self.output = next(n for n in gm.graph.nodes if n.op == "output")
        assert len(self.fx_nodes) == len(graph.nodes), "graph and traced module disagree"
        self.ids = {n: i for i, n in enumerate(self.fx_nodes)}
        self.edge_group, self.groups = self._gather_groups()
        self.gathered: dict[tuple, DTensor] = {}  # (group, parameter-derived tensor, src, dst) -> gathered
        self.resharded: dict[tuple, DTensor] = {}  # (activation, phase, placements) -> its reshard
        self.derived = graph.parameter_derived()
        self.issuing: set[tuple] = set()
        self.keep_phases = False
        self.extra_outputs: tuple[tuple[NodeId, Placements], ...] = ()
        """(node, placements) returned after the gradients, each brought to its placements
        (a pipeline stage's boundary values: autopar/runtime/pipe_spmd.py)."""
        self.sync: GradSync | None = None
        """Set: `run` reduces each gradient bucket as soon as its last gradient is computed
        and returns synced gradients (one microbatch per step)."""

    def _gather_groups(self) -> tuple[dict[tuple[NodeId, int], tuple], dict[tuple, list[tuple]]]:
        """Parameter gathers that travel together (autopar/buckets.py gather_group, priced so
        by solver/intra_op/ilp.py): {(consumer, input position): group} and, per group, its
        members (parameter, source, target placements) in graph order, each once."""
        edge_group: dict[tuple[NodeId, int], tuple] = {}
        groups: dict[tuple, list[tuple]] = {}
        derived = self.graph.parameter_derived()
        for v in self.graph.nodes:
            if not v.inputs:
                continue
            for p, u in enumerate(v.inputs):
                param = self.graph[u]
                if u not in derived or len(param.outputs) != 1:
                    continue
                src, dst = self.choices[u].outputs[0], self.choices[v.id].inputs[p]
                axis = single_gather_axis(src, dst)
                if axis is None:
                    continue
                key = gather_group(v.layer, v.phase.value, axis, param.output.dtype)
                members = groups.setdefault(key, [])
                if (u, src, dst) not in members:
                    members.append((u, src, dst))
                edge_group[(v.id, p)] = key
        return edge_group, groups

    def _gather(self, key: tuple, env: dict[fx.Node, Any]) -> None:
        """One flat all-gather for every member of group `key`, where its first consumer runs."""
        if key in self.issuing:
            raise ApplyError(f"parameter gather group {key} needs itself to compute a member")
        self.issuing.add(key)
        axis = key[2]
        n = self.mesh.shape[axis]
        members = self.groups[key]
        for u, _, _ in members:  # a member computed later in graph order (a weight's transpose): now
            self._ensure(self.fx_nodes[u], env)
        locals_ = [env[self.fx_nodes[u]]._local_tensor for u, _, _ in members]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        rows = funcol.all_gather_single(flat, 0, (self.mesh, axis)).view(n, -1)
        offset = 0
        for (u, src, dst), local in zip(members, locals_):
            size = local.numel()
            full = torch.cat([rows[r, offset:offset + size].view(local.shape) for r in range(n)], dim=src[axis].dim)
            offset += size
            meta = self.graph[u].output
            self.gathered[(key, u, src, dst)] = dtensor_of(full, self.mesh, dst, meta.shape, meta.strides)
        self.issuing.discard(key)

    def _ensure(self, node: fx.Node, env: dict[fx.Node, Any]) -> None:
        """Compute `node` (parameter-derived: its inputs are parameters or nodes like it)
        and what it needs, if not yet computed."""
        if node in env:
            return
        for a in node.all_input_nodes:
            self._ensure(a, env)
        env[node] = self._run_node(node, self.ids[node], env)

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.fx_nodes if n.op == "placeholder"]

    def run(self, *locals_: torch.Tensor) -> tuple[torch.Tensor, ...]:
        env: dict[fx.Node, Any] = {}
        self.gathered, self.resharded = {}, {}
        self.issuing: set[tuple] = set()
        for node, local in zip(self.placeholders(), locals_):
            nid = self.ids[node]
            meta = self.graph[nid].output
            env[node] = dtensor_of(local, self.mesh, self.choices[nid].outputs[0], meta.shape, meta.strides)
        grad_nodes = self._grad_outputs()
        waiting: dict[fx.Node, list[int]] = {}  # gradient node -> the buckets it is in
        left: list[set[fx.Node]] = []  # per bucket, its gradients not computed yet
        for k, bucket in enumerate(self.sync.buckets if self.sync is not None else ()):
            left.append({grad_nodes[i] for i in bucket})
            for g in left[-1]:
                waiting.setdefault(g, []).append(k)
        in_step = StepSync(self.sync) if self.sync is not None else None

        def reduce(k: int) -> None:
            bucket = self.sync.buckets[k]
            in_step.reduce(bucket, {i: env[grad_nodes[i]]._local_tensor for i in bucket})

        for node in self.fx_nodes:
            if node.op == "placeholder" or node in env:  # computed early for a parameter gather
                continue
            nid = self.ids[node]
            # under `keep_phases`, the ops recorded for this node (collectives included) carry
            # its meta: its partitioner tag says forward or backward (autopar/runtime/pipe_spmd.py)
            with fx_traceback.set_current_meta(node) if self.keep_phases else contextlib.nullcontext():
                env[node] = self._run_node(node, nid, env)
            for k in waiting.get(node, ()):
                left[k].discard(node)
                if not left[k]:  # the bucket's last gradient: reduce it now, in the backward
                    reduce(k)
        for k, rest in enumerate(left):  # a gradient that is a placeholder or computed early
            if rest:
                reduce(k)
        loss = env[self.output.args[0][0]]
        extras, updates = self._extra_outputs(env), self._buffer_updates(env)
        if in_step is not None:  # the buckets still in flight waited where the gradients are needed
            synced = in_step.finish()
            grads = [synced[i] for i in range(len(grad_nodes))]
        else:
            grads = [env[g]._local_tensor for g in grad_nodes]
        return (loss._local_tensor, *grads, *extras, *updates)

    def _extra_outputs(self, env: dict[fx.Node, Any]) -> list[torch.Tensor]:
        """The step's extra outputs, each in its wanted placement (a pipeline stage's)."""
        extras = []
        for nid, want in self.extra_outputs:
            t = env[self.fx_nodes[nid]]
            if tuple(bridge.from_dtensor_placements(t.placements)) != tuple(want):
                # tagged: these collectives are the pipeline's boundary reshards, not priced
                # by the ILP (counted apart: autopar/runtime/pipe_spmd.py collectives_per_step)
                with fx_traceback.annotate({"boundary": True}) if self.keep_phases else contextlib.nullcontext():
                    t = redistribute_to(t, want, True)
            extras.append(t._local_tensor.contiguous())
        return extras

    def _buffer_updates(self, env: dict[fx.Node, Any]) -> list[torch.Tensor]:
        """The buffers' new values, each in its buffer's placement."""
        updates = []
        for buf, value in self.graph.buffer_updates:  # the edge value -> buffer the ILP priced
            t, want = env[self.fx_nodes[value]], self.choices[buf].outputs[0]
            if tuple(bridge.from_dtensor_placements(t.placements)) != tuple(want):
                t = redistribute_to(t, want, True)
            updates.append(t._local_tensor.contiguous())
        return updates

    def _grad_outputs(self) -> list[fx.Node]:
        grad_ids = {g for _, g in self.graph.param_grads}
        return [n for n in self.output.args[0][1:] if isinstance(n, fx.Node) and self.ids[n] in grad_ids]

    def _run_node(self, node: fx.Node, nid: NodeId, env: dict[fx.Node, Any]) -> Any:
        choice = self.choices[nid]
        if node.op == "get_attr":
            value = getattr(self.gm, node.target)
            return dtensor_of(value, self.mesh, choice.outputs[0], value.shape, value.stride())
        if node.target is operator.getitem:
            return env[node.args[0]][node.args[1]]
        ir = self.graph[nid]
        if not ir.inputs:  # a factory: made whole on every device (replicated)
            value = node.target(*node.args, **node.kwargs)
            return dtensor_of(value, self.mesh, choice.outputs[0], value.shape, value.stride())
        positions = iter(range(len(ir.inputs)))

        def arg(a: Any) -> Any:
            # parameter gathers travel in groups, an activation's reshard is shared per phase
            if isinstance(a, fx.Node):
                p = next(positions)
                want = choice.inputs[p]
                group = self.edge_group.get((nid, p))
                if group is not None:  # each group gathers its members (a weight read in the
                    # forward and again in the backward is gathered twice, as priced: not held between)
                    key = (group, self.ids[a], self.choices[self.ids[a]].outputs[0], want)
                    if key not in self.gathered:
                        self._gather(group, env)
                    return self.gathered[key]
                t, have = env[a], tuple(bridge.from_dtensor_placements(env[a].placements))
                contiguous = self.graph[self.ids[a]].output.stride == ()
                if have != tuple(want):
                    if self.ids[a] in self.derived or not communicates(have, tuple(want)):
                        return redistribute_to(t, want, contiguous)
                    key = (self.ids[a], ir.phase, tuple(want))
                    if key not in self.resharded:
                        self.resharded[key] = redistribute_to(t, want, contiguous)
                    return self.resharded[key]
                elif contiguous and not t._local_tensor.is_contiguous():
                    # a kernel laid its local output out differently from the trace (e.g.
                    # SDPA's): views that follow need the traced (contiguous) layout
                    t = DTensor(t._local_tensor.contiguous(), t._spec, requires_grad=False)
                return t
            if isinstance(a, (list, tuple)):
                return type(a)(arg(x) for x in a)
            return a

        args = tuple(arg(a) for a in node.args)
        kwargs = {k: arg(v) for k, v in node.kwargs.items()}
        if not _has_direct_rule(node.target) and all(_is_replicated(a) for a in _flat(args, kwargs)):
            # no DTensor rule and every input whole: the op on the whole tensors is exact (a
            # decomposition could reach ops DTensor has no rule for either: T5's fill.Tensor
            # decomposes to copy)
            target = functools.partial(_on_whole_tensors, node.target, self.mesh)
        else:
            target = _runnable(node.target)
        try:
            with bridge.dispatching(node.target, choice.outputs, _traced(node.target, ir, self.graph)):
                try:
                    out = target(*args, **kwargs)
                except RuntimeError:
                    if node.target not in _VIEWS or not isinstance(args[0], DTensor):
                        raise
                    # the traced tensor was viewable but this rank's layout of it is not (a
                    # kernel or a redistribution laid it out differently): view a contiguous copy
                    first = args[0]
                    shape = first.shape
                    args = (dtensor_of(first._local_tensor.contiguous(), first.device_mesh,
                                       bridge.from_dtensor_placements(first.placements), shape,
                                       make_contiguous_strides_for(shape)), *args[1:])
                    out = target(*args, **kwargs)
        except Exception as exc:
            raise ApplyError(f"node {node.name} ({node.target}) failed under placements "
                             f"{[str(p) for p in choice.inputs]}: {type(exc).__name__}: {exc}") from exc
        out = _wrap_replicated_plain_outputs(out, choice, self.mesh)
        self._check(node, ir, choice, out)
        return _settle_masks(out)

    def _check(self, node: fx.Node, ir: Any, choice: NodeStrategy, out: Any) -> None:
        made = [out] if isinstance(out, DTensor) else [o for o in out if isinstance(o, DTensor)]
        if len(made) != len(choice.outputs) or not all(_same(m.placements, want)
                                                       for m, want in zip(made, choice.outputs)):
            raise ApplyError(
                f"node {node.name} ({ir.op}): DTensor ran it with outputs "
                f"{[tuple(str(p) for p in m.placements) for m in made]} but the plan chose "
                f"{[tuple(str(p) for p in o) for o in choice.outputs]} (inputs {[str(p) for p in choice.inputs]})")


def _examples(metas: Sequence[tuple[tuple[int, ...], str]], device: str) -> list[torch.Tensor]:
    """The placeholders' examples for make_fx: fake tensors (no memory: real ones on a GPU
    would hold a second copy of the rank's parameters while it traces) on the mesh's device
    type. One on another device makes DTensor.from_local move it, and the trace would keep
    that copy, of every parameter and input, in every step (seen on an H100: a
    `_to_copy(..., device='cuda')` per placeholder). The mode is the one make_fx would make
    itself (it takes the inputs' mode), allowing real inputs: the traced step's real tensor
    constants (T5's `torch.tensor(0)`, read by get_attr) enter the per-rank graph as constants."""
    with FakeTensorMode(allow_fallback_kernels=True, shape_env=ShapeEnv(), static_shapes=True,
                        allow_non_fake_inputs=True):
        return [torch.empty(shape, dtype=getattr(torch, dtype), device=device) for shape, dtype in metas]


def _name_placeholders(gm: fx.GraphModule, names: Sequence[str]) -> None:
    for node, name in zip([n for n in gm.graph.nodes if n.op == "placeholder"], names):
        node._rename(re.sub(r"\W", "_", name))
        node.target = node.name
    gm.recompile()


def apply(gm: fx.GraphModule, graph: Graph, choices: Sequence[NodeStrategy], mesh: DeviceMesh, *,
          extra_outputs: Sequence[tuple[NodeId, Placements]] = (), keep_phases: bool = False,
          sync_in_step: bool = False, compiled: bool = False) -> RankGraphs:
    """The per-rank program of `choices` (one NodeStrategy per graph node) on `mesh`.

    `extra_outputs`: (node, placements) pairs the step also returns, after the gradients,
    each redistributed to its placements (a pipeline stage's outputs and input gradients
    in the layout the stages exchange; autopar/runtime/pipe_spmd.py). `keep_phases`: every node of
    the step graph keeps its source node's meta (its `partitioner_tag`: recomputed forward
    ops are tagged backward), for splitting it into forward and backward graphs.
    `sync_in_step` (for one microbatch per step): `step` reduces each gradient bucket as
    soon as its last gradient is computed and returns synced gradients; no `grad_sync`.
    `compiled`: the graphs are for Inductor (codegen/inductor.py): gradient buckets are
    all-reduced by the functional all-reduce, which Inductor's reinplacing pass turns back
    into the in-place one the eager graphs call."""
    bridge.register_project_rules()
    mesh_shape = tuple(mesh.shape)
    interp = _Interpreter(gm, graph, choices, mesh)
    interp.extra_outputs = tuple(extra_outputs)
    interp.keep_phases = keep_phases
    slots = []
    inputs = 0
    for node in interp.placeholders():
        nid = interp.ids[node]
        ir = graph[nid]
        name = ir.param_name or ("tangent" if ir.role is Role.TANGENT else f"input_{inputs}")
        inputs += ir.role is Role.INPUT
        slots.append(Slot(node=nid, role=ir.role, name=name, shape=ir.output.shape, dtype=ir.output.dtype,
                          placements=choices[nid].outputs[0]))
    by_grad = {g: p for p, g in graph.param_grads}
    grads, grad_ids = [], []
    for g in interp._grad_outputs():
        gid = interp.ids[g]
        pid = by_grad[gid]
        grad_ids.append(gid)
        grads.append((graph[pid].param_name or graph[pid].name, choices[gid].outputs[0],
                      choices[pid].update_placements, graph.grad_meta(gid)))  # sized as synced
    position = {gid: k for k, gid in enumerate(grad_ids)}
    order = [position[g] for _, g in graph.param_grads if g in position]
    grad_sync = GradSync(grads, [graph[g].layer for g in grad_ids], mesh, order,
                          dtype=getattr(torch, graph.model.precision.reduce), functional=compiled)

    examples = _examples([(local_shape(s.shape, s.placements, mesh_shape), s.dtype) for s in slots], mesh.device_type)
    interp.sync = grad_sync if sync_in_step else None
    with fx_traceback.preserve_node_meta() if keep_phases else contextlib.nullcontext():
        step = make_fx(interp.run, tracing_mode="fake")(*examples)
    _name_placeholders(step, [slot_name(s) for s in slots])

    sync = None
    if not sync_in_step:
        sync = make_fx(grad_sync, tracing_mode="fake")(
            *_examples([(local_shape(meta.shape, raw, mesh_shape), meta.dtype) for _, raw, _, meta in grads],
                       mesh.device_type))
        _name_placeholders(sync, [f"grad_{name}" for name, *_ in grads])
        # boxed: the caller hands over its list of raw gradients and the graph clears it, so each
        # raw gradient is freed once copied into its bucket (not held until the sync returns)
        sync.graph.set_codegen(_BoxedCodeGen())
        sync.recompile()
    gathered = [(s.name, choices[s.node].update, s.placements, s) for s in slots if s.role is Role.PARAMETER
                and choices[s.node].update is not None and choices[s.node].update != s.placements]
    param_gather = None
    if gathered:
        gather = WeightGather([(update, compute, slot, graph[slot.node].layer)
                                for _, update, compute, slot in gathered], mesh)
        param_gather = make_fx(gather, tracing_mode="fake")(
            *_examples([(local_shape(slot.shape, update, mesh_shape), slot.dtype) for _, update, _, slot in gathered],
                       mesh.device_type))
        _name_placeholders(param_gather, [f"update_{name}" for name, *_ in gathered])
    loss_id = interp.ids[interp.output.args[0][0]]
    program = RankGraphs(step=step, grad_sync=sync, param_gather=param_gather,
                         gathered=tuple((name, update, compute) for name, update, compute, _ in gathered),
                         slots=tuple(slots), loss_placements=choices[loss_id].outputs[0],
                          grads=tuple((name, raw, target) for name, raw, target, _ in grads), mesh_shape=mesh_shape,
                         buffer_updates=tuple(graph[b].param_name or graph[b].name for b, _ in graph.buffer_updates))
    program.source = program_source(program)
    if compiled:  # Inductor, at each graph's first call (codegen/inductor.py)
        program.compiled = True
        program.compile_like_step({"step": step, "grad_sync": sync, "param_gather": param_gather})
    return program
