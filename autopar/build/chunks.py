"""Pipeline chunks as every rank traces them: the model cut at its repeated layers, each
chunk's joint forward+backward graph traced and lowered.

Where it sits: the per-rank build (autopar/build/), before apply. One recipe, read by every
place that needs a pipeline's chunks: a rank building its stages (autopar/build/pipeline.py),
the wiring that solves a pipeline configuration's chunks before ranks start
(autopar/placing.py), the check of a saved plan's stage placements against the model
(`check_stage_placements`) and `--emit` (autopar/build/pipeline.py `stage_sources`):
1. the model is cast to the precision policy's compute dtype and cut into pp * interleave
   chunks at its repeated layers (`split_model`: torch.distributed.pipelining's tracer,
   autopar/runtime/pipe.py's routing and renaming);
2. one real forward on one global microbatch (dp * micro_batch rows) finds each chunk's
   boundary values: its inputs, its outputs, and which outputs carry a gradient
   (`capture_boundaries`);
3. each chunk's joint graph is traced as a function of (parameters, inputs, output
   tangents): its "loss" is sum(output_i * tangent_i) over the outputs that carry a
   gradient (the last chunk: its own loss), with the inputs that carry a gradient
   differentiated too; values that carry none are returned beside the loss
   (`trace_stage`).
No process group is needed: the same trace runs in the launcher and in every rank.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence
from unittest import mock

import torch
from torch import fx, nn

from autopar.batch import is_flat
from autopar.capabilities import layer_stack, split_layers
from autopar.config import ParallelConfig
from autopar.ir import Graph
from autopar.placement import Placements, boundary_placements
from autopar.runtime.pipe import canonical_names, canonicalize, relay_skips, routed
from autopar.runtime.spmd import master_weights, run_policy
from autopar.trace import hf_capture_patch, lower, sdpa_backends, to_compute_dtype, trace, with_precision

log = logging.getLogger(__name__)


def split_model(model: nn.Module, microbatch: Sequence[Any], *, num_chunks: int,
                stage_layers: tuple[int, ...] | None = None,
                loss_fn: Callable[..., torch.Tensor] | None = None) -> tuple[Any, str, tuple[range, ...]]:
    """Cut `model`'s training step into `num_chunks` pipeline stages at its repeated layers.

    Returns (torch Pipe, layer container path, layer range per chunk). Raises ValueError
    when the model has no repeated layer stack or too few layers."""
    import torch.distributed.pipelining._IR as pipelining_ir  # lazy: torch.distributed.pipelining, only for pp > 1
    from torch.distributed.pipelining import SplitPoint, pipeline  # lazy: torch.distributed.pipelining, only for pp > 1

    prefix, num_layers = layer_stack(model)
    if num_layers < 2:
        raise ValueError(
            f"--pp needs a model with a repeated layer stack (an nn.ModuleList of blocks) to cut into stages; "
            f"{type(model).__name__} has none. Use --pp 1")
    ranges = split_layers(num_layers, num_chunks, stage_layers)
    split_spec = {f"{prefix}.{r.start}": SplitPoint.BEGINNING for r in ranges[1:]}
    # Stage modules stay flat ATen graphs whose parameters keep their dotted names: torch
    # rebuilds each stage's module hierarchy from the export's module stacks
    # (`_outline_submodules`), which mis-scopes Hugging Face Llama's rotary embedding (its
    # call reads a value made in the parent's scope; the rebuilt stage fails to run).
    module_paths = [name for name, _ in model.named_modules() if name]

    def flat_stage(graph: Any) -> nn.Module:
        stage = graph.owning_module
        for path in module_paths:  # empty containers: torch then places every parameter a stage
            parent = stage         # reads (under any of its tied names) at its dotted name
            for atom in path.split("."):
                if not hasattr(parent, atom):
                    parent.add_module(atom, nn.Module())
                parent = getattr(parent, atom)
        return stage

    with hf_capture_patch(model), torch.nn.attention.sdpa_kernel(sdpa_backends()), \
            mock.patch.object(pipelining_ir, "_outline_submodules", flat_stage):
        pipe = pipeline(routed(model, loss_fn), mb_args=tuple(microbatch), split_spec=split_spec)
    if pipe.num_stages != num_chunks:
        raise ValueError(f"cutting {type(model).__name__} at layers {[r.start for r in ranges[1:]]} of {prefix} "
                         f"gave {pipe.num_stages} stages, not {num_chunks} (a layer is called out of order?)")
    canonical = canonical_names(model)
    for index in range(pipe.num_stages):
        canonicalize(pipe.get_stage_module(index), canonical)
    relays = relay_skips(pipe)
    log.info("cut %s at layers %s of %s: %d stages, %d values relayed past a stage", type(model).__name__,
             [r.start for r in ranges[1:]], prefix, pipe.num_stages, relays)
    return pipe, prefix, ranges


def capture_boundaries(pipe: Any, microbatch: Sequence[torch.Tensor]) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """(inputs, outputs) of every chunk of `pipe` on `microbatch`, one real forward with
    autograd on (an output that requires grad carries a gradient back). Raises ValueError
    where a chunk's inputs are not exactly its predecessor's outputs (what a point-to-point
    pipeline sends).

    Nothing of the forward's autograd graph outlives it: the values are kept detached, with
    their `requires_grad` flag, and the Pipe's interpreter forgets its values. Kept as the
    forward made them, they held every activation of the whole model on the traced
    microbatch for the rest of the build: on the benchmark Llama, 19 MiB per rank, the
    build's peak. Nor does the graph hold activations while it runs: no backward ever runs
    on it (it is built only for the `requires_grad` flags it propagates), so what autograd
    would save for one is dropped as it is saved (`saved_tensors_hooks`). Saved, every
    chunk's activations were live at once at the end of the forward, the whole model's on
    the global microbatch: on the benchmark Llama under pp2 x tp2, the build's peak
    (30 MiB per rank, 18 MiB without them)."""
    def keep(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return value.detach().requires_grad_(True)
        return value.detach() if isinstance(value, torch.Tensor) else value

    seen: list[Any] = [None] * pipe.num_stages
    handles = []
    for index in range(pipe.num_stages):
        def hook(_module: nn.Module, args: Any, out: Any, index: int = index) -> None:
            outs = out if isinstance(out, tuple) else (out,)
            seen[index] = (tuple(keep(a) for a in args), tuple(keep(o) for o in outs))
        handles.append(pipe.get_stage_module(index).register_forward_hook(hook))
    try:
        with torch.autograd.graph.saved_tensors_hooks(_drop_saved, _no_backward):
            pipe(*microbatch)
    finally:
        for h in handles:
            h.remove()
        # torch's Pipe runs its split graph in a DetachExecutor, which keeps every value it
        # made (garbage collection of values off) until its next run
        executor = getattr(pipe, "executor", None)
        if executor is not None:
            executor.env, executor.value_remap = {}, {}
    for k in range(1, pipe.num_stages):
        ins, outs = seen[k][0], seen[k - 1][1]
        if len(ins) != len(outs) or not all(a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
                                               for a, b in zip(ins, outs)):
            raise ValueError(f"pipeline chunk {k} does not read exactly chunk {k - 1}'s outputs in order; "
                             "per-op stages exchange whole output tuples")
    return seen


def _drop_saved(_tensor: torch.Tensor) -> None:
    """What `capture_boundaries`' forward keeps of a tensor autograd saves: nothing."""
    return None


def _no_backward(_packed: None) -> torch.Tensor:
    raise RuntimeError("capture_boundaries' forward dropped its saved tensors: no backward runs on it")


class _StageJoint(nn.Module):
    """A chunk as a traceable "model": (inputs..., tangents...) -> (sum of output_i *
    tangent_i, outputs without a gradient...); the last chunk returns its own loss. Its
    parameters and submodules are the chunk's (shared dicts), under the same names."""

    def __init__(self, chunk: nn.Module, num_inputs: int, grad_outputs: tuple[int, ...], num_outputs: int,
                 last: bool) -> None:
        super().__init__()
        self._modules = chunk._modules
        self._parameters = chunk._parameters
        self._buffers = chunk._buffers
        self.__dict__["chunk"] = chunk  # not a submodule: its parameters are already ours by name
        self.num_inputs = num_inputs
        self.grad_outputs = grad_outputs
        self.num_outputs = num_outputs
        self.last = last

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # node by node, so the traced ops inherit each chunk node's meta (its module path)
        outs = fx.Interpreter(self.chunk).run(*args[:self.num_inputs])
        outs = outs if isinstance(outs, tuple) else (outs,)
        if self.last:
            return (outs[0].sum(),)
        tangents = args[self.num_inputs:]
        loss = sum((outs[i] * t).sum() for i, t in zip(self.grad_outputs, tangents))
        aux = tuple(outs[i].detach().clone() for i in range(self.num_outputs) if i not in self.grad_outputs)
        return (loss, *aux)


def _forward_mul_source(gm: fx.GraphModule, tangent: fx.Node) -> fx.Node:
    """The output value `o` of the traced `(o * tangent).sum()`: the forward multiply's other operand."""
    for user in tangent.users:
        if user.target is torch.ops.aten.mul.Tensor and user.meta.get("partitioner_tag") != "is_backward":
            other = [a for a in user.args if a is not tangent]
            if len(other) == 1 and isinstance(other[0], fx.Node):
                return other[0]
    raise RuntimeError(f"no forward multiply by {tangent.name} in the stage's joint graph")


def _annotate_modules(chunk: fx.GraphModule) -> None:
    """Give every node of a chunk's flat graph its module path the way the tracer's capture
    (autopar/trace/capture.py) records it (meta "custom" "module"), from the export's module
    stack, so the traced joint graph knows its layers (layer groups for the ILP, recompute
    regions)."""
    for node in chunk.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            path = list(stack.values())[-1][0]
            node.meta["custom"] = {**(node.meta.get("custom") or {}), "module": path}


@dataclass(slots=True, kw_only=True)
class TracedStage:
    """One chunk's joint graph as every rank traces it (`trace_stage`): what the ILP solves
    (or a plan's stage placements are matched to) and codegen/apply.py applies."""

    index: int
    chunk: nn.Module
    traced: Any
    """autopar.trace.Traced: the joint graph (FX) with its descriptors."""
    graph: Graph
    extra: list[tuple[int, Placements]]
    """(graph node, layout) of the boundary values the applied graph also returns: the
    outputs (the last chunk: its loss, placed as the ILP placed it), then the input gradients."""
    num_inputs: int
    outputs: tuple[torch.Tensor, ...]
    grad_inputs: tuple[int, ...]
    grad_outputs: tuple[int, ...]
    last: bool
    masters: dict[int, torch.Tensor] = field(default_factory=dict)
    """The model's master weights by parameter where the precision policy keeps them in
    another dtype than it computes in (autopar/runtime/spmd.py `master_weights`), taken
    before the model was cast to the compute dtype and cut."""


def trace_stage(chunk: nn.Module, index: int, *, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                last: bool, config: ParallelConfig, layer_prefix: str = "",
                masters: dict[int, torch.Tensor] | None = None) -> TracedStage:
    """Trace and lower one chunk's joint graph; `inputs`/`outputs` are its boundary values
    at the global microbatch (`capture_boundaries`). The model was cut in the precision
    policy's compute dtype (`cut_in_compute_dtype`), so the chunk computes in it; `masters`
    are its master weights. No process group needed."""
    precision = run_policy(config)
    rows = config.dp * config.micro_batch
    grad_inputs = tuple(i for i, x in enumerate(inputs) if x.requires_grad and x.is_floating_point())
    grad_outputs = () if last else tuple(i for i, o in enumerate(outputs) if o.requires_grad and o.is_floating_point())
    examples = [x.detach().clone().requires_grad_(i in grad_inputs) for i, x in enumerate(inputs)]
    tangents = [torch.zeros_like(outputs[i].detach()) for i in grad_outputs]
    joint = _StageJoint(chunk, len(inputs), grad_outputs, len(outputs), last)
    if isinstance(chunk, fx.GraphModule):
        _annotate_modules(chunk)
    traced = trace(joint, (*examples, *tangents), aux_outputs=True, layer_prefix=layer_prefix,
                   recompute=config.recompute)
    # torch.export left metadata asserts in the chunk (no outputs, nothing to place or run)
    for node in list(traced.gm.graph.nodes):
        if node.op == "call_function" and str(node.target).startswith("aten._assert") and not node.users:
            traced.gm.graph.erase_node(node)
    traced.gm.recompile()
    first = next((x for x in inputs if x.dim() > 0), None)
    graph = with_precision(lower(traced, name=f"{type(chunk).__name__}[{index}]", batch=rows,
                                 seq=int(first.shape[1]) if first is not None and first.dim() > 1 else 1), precision)
    graph = replace(graph, compiled=config.compiled)  # priced as it runs (cost_model/table.py compiled_scale)
    if graph.buffer_updates:
        names = ", ".join(graph[b].param_name or graph[b].name for b, _ in graph.buffer_updates)
        raise ValueError(f"pipeline chunk {index} updates buffers in its forward ({names}: running statistics or "
                         "counters); pipeline stages do not write buffers back yet. Use --pp 1 (one-stage plans "
                         "update buffers as one process does)")

    fx_nodes = [n for n in traced.gm.graph.nodes if n.op != "output"]
    ids = {n: i for i, n in enumerate(fx_nodes)}
    output_node = traced.gm.graph.output_node()
    values, descs = list(output_node.args[0]), list(output_node.meta.get("desc", ()))
    placeholders = [n for n in fx_nodes if n.op == "placeholder"]
    plain = [n for n in placeholders if type(n.meta.get("desc")).__name__ == "PlainAOTInput"]
    if len(plain) != len(inputs) + len(tangents):
        raise RuntimeError(f"chunk {index}: {len(plain)} plain inputs traced, {len(inputs) + len(tangents)} given")
    # the boundary values, as (graph node, layout) pairs the applied graph also returns
    extra: list[tuple[int, Placements]] = []
    if last:
        extra.append((ids[values[0]], ()))  # the loss, left as the ILP placed it (set at build)
    else:
        aux = iter(values[1:1 + len(outputs) - len(grad_outputs)])
        tangent_of = dict(zip(grad_outputs, plain[len(inputs):]))
        for i, o in enumerate(outputs):
            node = _forward_mul_source(traced.gm, tangent_of[i]) if i in grad_outputs else next(aux)
            extra.append((ids[node], boundary_placements(o.shape, rows, config.dp)))
    grad_of_input: dict[int, fx.Node] = {}
    for value, desc in zip(values, descs):
        if type(desc).__name__ == "GradAOTOutput" and not hasattr(desc.grad_of, "target"):
            grad_of_input[desc.grad_of.idx] = value
    for i in grad_inputs:
        g = grad_of_input.get(i)
        if not isinstance(g, fx.Node):
            raise RuntimeError(f"chunk {index}: input {i} requires grad but the joint graph has no gradient for it")
        extra.append((ids[g], boundary_placements(inputs[i].shape, rows, config.dp)))
    return TracedStage(index=index, chunk=chunk, traced=traced, graph=graph, extra=extra, num_inputs=len(inputs),
                       outputs=tuple(outputs), grad_inputs=grad_inputs, grad_outputs=grad_outputs, last=last,
                       masters=masters if masters is not None else {})


def chunk_layers(stage_layers: Sequence[int] | None, config: ParallelConfig) -> tuple[int, ...] | None:
    """Layers per chunk from a plan's `stage_layers`: one count per chunk as given, or, for
    an interleaved plan that gives one per stage (what the search writes), each stage's
    layers split evenly over its `interleave` chunks (chunk c is stage c % pp). Counts that
    fit neither are passed on for the cut to refuse with its message."""
    if not stage_layers:
        return None
    counts = tuple(int(n) for n in stage_layers)
    v = config.interleave
    if v > 1 and len(counts) == config.pp and all(n % v == 0 for n in counts):
        return tuple(counts[c % config.pp] // v for c in range(config.pp * v))
    return counts


def first_microbatch(config: ParallelConfig, example_inputs: Sequence[Any]) -> tuple[tuple[Any, ...], int, int]:
    """One global batch's first global microbatch (its first dp * micro_batch rows, what a
    chunk is traced on), the batch's size and the rows per global microbatch; a batch that
    does not split so is refused with what to use instead."""
    if not is_flat(example_inputs):
        raise ValueError("pipeline stages take a batch of positional tensors (inputs..., labels); this batch has "
                         "dicts, nested containers or keyword inputs. Train it with --pp 1 (one-stage plans take "
                         "any batch), or give the model positional tensor inputs")
    rows = config.dp * config.micro_batch
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    size = tensors[0].shape[0]
    if size % rows:
        raise ValueError(f"batch of {size} sequences does not split into dp * micro-batch = {config.dp} * "
                         f"{config.micro_batch}; use a global batch that is a multiple of {rows}")
    return tuple(t[:rows] if t.dim() and t.shape[0] == size else t for t in tensors), size, rows


def cut_in_compute_dtype(model: nn.Module, microbatch: Sequence[Any], precision: Any
                         ) -> tuple[dict[int, torch.Tensor], tuple[Any, ...]]:
    """(master weights, microbatch) with `model` cast in place to the precision policy's
    compute dtype, before it is cut: torch.export records each tensor's dtype in the chunks
    it makes (`_assert_tensor_metadata`, the casts a model's code writes), so a chunk computes
    in the dtype the model was exported in. The chunks hold the model's own parameter
    objects, so the master weights are keyed by parameter (`master_weights`)."""
    masters = master_weights(model, precision)
    return masters, to_compute_dtype(model, microbatch, precision.compute)


@dataclass(slots=True, kw_only=True)
class Cut:
    """A model cut into its pipeline chunks on one global microbatch (`cut_model`)."""

    pipe: Any
    """torch.distributed.pipelining's Pipe: `get_stage_module(k)` is chunk k."""
    prefix: str
    """The path of the model's repeated layer container."""
    ranges: tuple[range, ...]
    """The layers of each chunk."""
    boundaries: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]
    """(inputs, outputs) of every chunk (`capture_boundaries`)."""
    masters: dict[int, torch.Tensor]
    """The master weights by parameter where the precision policy keeps them in another
    dtype than it computes in (`cut_in_compute_dtype`)."""
    rows: int
    """Rows of one global microbatch (dp * micro_batch)."""
    size: int
    """Rows of the global batch."""

    def trace(self, chunk_id: int, config: ParallelConfig) -> TracedStage:
        """Chunk `chunk_id`'s joint graph (`trace_stage`)."""
        ins, outs = self.boundaries[chunk_id]
        return trace_stage(self.pipe.get_stage_module(chunk_id), chunk_id, inputs=ins, outputs=outs,
                           last=chunk_id == config.pp * config.interleave - 1, config=config,
                           layer_prefix=self.prefix, masters=self.masters)


def cut_model(model: nn.Module, config: ParallelConfig, example_inputs: Sequence[Any], *,
              loss_fn: Callable[..., torch.Tensor] | None = None, stage_layers: Sequence[int] | None = None,
              device_type: str = "cpu") -> Cut:
    """Steps 1 and 2 of the module docstring: `model` cast in place to the compute dtype of
    `config`'s precision policy on `device_type`, cut into its pp * interleave chunks
    (`stage_layers`: a plan's layers per stage or chunk, `chunk_layers`; None: an even split)
    and run once on the first global microbatch of `example_inputs` (one global batch).
    The chunks share `model`'s modules and parameters."""
    micro, size, rows = first_microbatch(config, example_inputs)
    masters, micro = cut_in_compute_dtype(model, micro, run_policy(config, device_type))
    pipe, prefix, ranges = split_model(model, micro, num_chunks=config.pp * config.interleave,
                                       stage_layers=chunk_layers(stage_layers, config), loss_fn=loss_fn)
    boundaries = capture_boundaries(pipe, micro)
    return Cut(pipe=pipe, prefix=prefix, ranges=ranges, boundaries=boundaries, masters=masters, rows=rows, size=size)


def trace_chunks(model: nn.Module, config: ParallelConfig, example_inputs: Sequence[Any], *,
                 loss_fn: Callable[..., torch.Tensor] | None = None, stage_layers: tuple[int, ...] | None = None,
                 chunk_ids: Sequence[int] | None = None) -> list[TracedStage]:
    """`model`'s pipeline chunks (`chunk_ids`, default all) traced as every rank traces
    its own at build (`cut_model`, then `Cut.trace`), in this process with no process group:
    what the wiring solves per-stage placements on (autopar/placing.py), what a plan's are
    checked against before ranks start, and what `--emit` applies. `example_inputs` is one
    global batch (its first dp * micro_batch rows are traced); `model` is cut in place (its
    modules are shared with the chunks)."""
    cut = cut_model(model, config, example_inputs, loss_fn=loss_fn, stage_layers=stage_layers)
    return [cut.trace(cid, config) for cid in (range(config.pp * config.interleave) if chunk_ids is None
                                               else chunk_ids)]


def check_stage_placements(model: nn.Module, placed: Any, example_inputs: Sequence[Any], *,
                           loss_fn: Callable[..., torch.Tensor] | None = None) -> None:
    """Raise PlanFileError where `placed`'s stage placements (autopar/plan.py
    ProgramPlacements) do not match `model`'s chunks as the ranks will trace them (node keys
    and ops, every chunk): found once, in this process with no process group, before any
    rank starts (the launcher calls this)."""
    for stage in trace_chunks(copy.deepcopy(model), placed.config, example_inputs, loss_fn=loss_fn,
                              stage_layers=placed.stage_layers or None):
        placed.choices_for(stage.graph, stage.index)
