"""Per-op pipeline stages: the intra-op ILP's placements inside every stage of a pipeline.

Where it sits: runtime, behind `autopar.runtime.program.build_program` for pp > 1 plans. It joins
the pipeline cut of autopar/runtime/pipe.py (torch's tracer, split at the repeated layers)
and the per-op compiler of pp = 1 plans (autopar/trace.py, solver/intra_op.py,
codegen/apply.py, autopar/runtime/spmd.py). On every rank, for each of its chunks:

1. the chunk's boundary values are found by running the cut model once on one global
   microbatch (dp * micro_batch rows): its inputs, its outputs, and which outputs carry
   a gradient;
2. the chunk's joint forward+backward graph is traced as a function of (parameters,
   inputs, output tangents): its "loss" is sum(output_i * tangent_i) over the outputs
   that carry a gradient (the last chunk: its own loss), with the inputs that carry a
   gradient differentiated too; values that carry none are returned beside the loss;
3. its per-op placements are the plan's for that chunk (`Plan.stage_placements`, recorded
   by the search from this same trace, `trace_chunks`; matched by node key and op, a
   mismatch refused), or, where the plan has none (a version-3 file, a configuration given
   by flags), the intra-op ILP solves it on the chunk's (dp, tp) submesh under the
   configuration's rules (solver/forced.py), with the boundary values in one layout both
   neighbours agree on: split by batch over dp where dim 0 is the microbatch's rows, whole
   over tp (the first rank of the submesh solves, every rank of it receives the solution);
4. codegen/apply.py applies it: one per-rank joint graph that also returns the outputs
   and the input gradients redistributed to the boundary layout;
5. that graph is split into a forward graph (every node that does not depend on a
   tangent) and a backward graph (the rest; it reads the forward values it needs, which
   the forward returns: AOTAutograd's default partition), wrapped in an autograd
   Function so torch.distributed.pipelining's PipelineStage and schedules run it:
   forward, send the outputs, later backward with the received gradients.

Parameters are DTensors in the ILP's placements (autopar/runtime/spmd.py SpmdProgram per
chunk); backward accumulates their raw gradients, and after the schedule each chunk's
gradient-sync graph brings them to their placements (SpmdProgram.set_gradients: the ILP's
data parallelism / ZeRO; under zero 2 the backward graph reduce-scatters each
microbatch's gradients itself and the shards accumulate) and one stock optimizer steps
every chunk's parameters. A tensor
held by several chunks (a tied embedding and head) gets the sum of their gradients
(whole gradients summed over the pp ranks holding it, then resharded to each copy's
placement), so every copy takes the same step.

Scaling: the last chunk's loss tangent is 1 / num_microbatches (as the pp = 1 program
feeds it), so every gradient of the step is already the mean; the schedules' own scaling
is off.

What the ILP does not price: the boundary reshards (a chunk output leaving in the ILP's
placement for the boundary layout, an input gradient likewise; tagged in the graphs and
counted apart by `collectives_per_step(boundary=True)`) and the pipeline's
point-to-point sends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.fx.graph import _BoxedCodeGen
from torch.distributed.device_mesh import DeviceMesh

from autopar.config import ParallelConfig
from autopar.ir import Graph, Role
from autopar.placement import Placements, Replicate, Shard, boundary_placements
from autopar.runtime.launch import gather_build_results

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


# ---------------------------------------------------------------------------------------
# boundary values


def capture_boundaries(pipe: Any, microbatch: Sequence[torch.Tensor]) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """(inputs, outputs) of every chunk of `pipe` on `microbatch`, one real forward with
    autograd on (an output that requires grad carries a gradient back). Raises ValueError
    where a chunk's inputs are not exactly its predecessor's outputs (what a point-to-point
    pipeline sends).

    Nothing of the forward's autograd graph outlives it: the values are kept detached, with
    their `requires_grad` flag, and the Pipe's interpreter forgets its values. Kept as the
    forward made them, they held every activation of the whole model on the traced
    microbatch for the rest of the build: on the benchmark Llama, 19 MiB per rank, the
    build's peak."""
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


# ---------------------------------------------------------------------------------------
# the per-rank stage graphs


def _forward_mul_source(gm: fx.GraphModule, tangent: fx.Node) -> fx.Node:
    """The output value `o` of the traced `(o * tangent).sum()`: the forward multiply's other operand."""
    for user in tangent.users:
        if user.target is torch.ops.aten.mul.Tensor and user.meta.get("partitioner_tag") != "is_backward":
            other = [a for a in user.args if a is not tangent]
            if len(other) == 1 and isinstance(other[0], fx.Node):
                return other[0]
    raise RuntimeError(f"no forward multiply by {tangent.name} in the stage's joint graph")


def split_joint(gm: fx.GraphModule, seeds: set[str], forward_outputs: list[int],
                backward_outputs: list[int]) -> tuple[fx.GraphModule, fx.GraphModule, int]:
    """Cut a per-rank joint graph into forward and backward graphs.

    `seeds`: names of the placeholders only backward has (the tangents). Backward is every
    node that depends on one or is tagged backward (a forward op the recompute policy
    copied into backward, autopar/recompute.py); forward is the rest. Forward: (the other placeholders) ->
    (the joint's outputs at `forward_outputs`, then the saved values: forward nodes that
    backward reads). Backward: (saved values, seeds in placeholder order) -> (the joint's
    outputs at `backward_outputs`). Returns (forward, backward, number of saved values)."""
    nodes = list(gm.graph.nodes)
    output = nodes[-1]
    values = list(output.args[0])
    back: set[fx.Node] = set()
    for n in nodes:
        if n.op == "output":
            continue
        if (n.op == "placeholder" and n.name in seeds) or any(a in back for a in n.all_input_nodes) \
                or n.meta.get("partitioner_tag") == "is_backward":  # recomputed forward ops too
            back.add(n)
    for i in forward_outputs:
        if values[i] in back:
            raise RuntimeError(f"stage output {values[i].name} depends on a tangent")
    saved: list[fx.Node] = []
    for n in nodes:
        if n in back:
            for a in n.all_input_nodes:
                if a not in back and a not in saved:
                    saved.append(a)
    for i in backward_outputs:
        if isinstance(values[i], fx.Node) and values[i] not in back and values[i] not in saved:
            saved.append(values[i])

    fwd = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n.op == "output" or n in back:
            continue
        env[n] = fwd.node_copy(n, lambda a: env[a])
    fwd.output(tuple(env[values[i]] for i in forward_outputs) + tuple(env[s] for s in saved))

    bwd = fx.Graph()
    benv: dict[fx.Node, fx.Node] = {}
    for k, s in enumerate(saved):
        benv[s] = bwd.placeholder(f"saved_{k}")
        benv[s].meta = dict(s.meta)
    for n in nodes:
        if n.op == "placeholder" and n in back:
            benv[n] = bwd.node_copy(n, lambda a: benv[a])
    for n in nodes:
        if n in back and n.op != "placeholder":
            benv[n] = bwd.node_copy(n, lambda a: benv[a])
    bwd.output(tuple(benv[values[i]] if isinstance(values[i], fx.Node) else None for i in backward_outputs))
    fgm, bgm = fx.GraphModule(gm, fwd), fx.GraphModule(gm, bwd)
    # boxed: the runner hands over one list of saved values and seeds, which the graph
    # empties, so each saved activation is freed after its last use in the backward, as
    # in a one-stage step graph (called with *args, every one was held to the end)
    bgm.graph.set_codegen(_BoxedCodeGen())
    bgm.recompile()
    return fgm, bgm, len(saved)


class StageRunner:
    """One chunk's per-rank program: forward and backward graphs, the parameters (an
    SpmdProgram holds them as DTensors), and the raw gradients accumulated over a step."""

    def __init__(self, *, index: int, program: Any, forward: fx.GraphModule, backward: fx.GraphModule,
                 num_saved: int, slots: Sequence[Any], num_inputs: int, grad_inputs: tuple[int, ...],
                 outputs: tuple[int, ...], grad_outputs: tuple[int, ...], last: bool) -> None:
        self.index = index
        self.program = program
        self.forward_gm = forward
        self.backward_gm = backward
        self.num_saved = num_saved
        self.slots = tuple(slots)
        self.num_inputs = num_inputs
        self.grad_inputs = grad_inputs
        """Positions of the inputs that get a gradient."""
        self.num_outputs = len(outputs)
        self.grad_outputs = grad_outputs
        """Positions of the outputs that carry a gradient."""
        self.last = last
        self.tangent_dtype = next((getattr(torch, s.dtype) for s in self.slots if s.role is Role.TANGENT),
                                  torch.float32)
        """The loss's dtype (the precision policy's compute dtype): what the seeds are cast to."""
        self.loss_scale = 1.0
        self.raw: list[torch.Tensor] | None = None
        self.anchor = torch.zeros((), requires_grad=True)
        """An input of every call that requires grad, so the first chunk's outputs (made
        from integer tokens only) are differentiable and the schedule runs its backward."""

    def run_forward(self, inputs: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
        values: list[torch.Tensor] = []
        data = iter(inputs)
        program = self.program
        for slot in self.slots:
            if slot.role is Role.PARAMETER:
                values.append(program.compute_weight(slot.name))
            elif slot.role is Role.BUFFER:
                values.append(program._buffers[slot.name])
            elif slot.role is Role.INPUT and slot.name.startswith("input_") \
                    and int(slot.name.removeprefix("input_")) < self.num_inputs:
                x = next(data)
                if x.is_floating_point() and str(x.dtype).removeprefix("torch.") != slot.dtype:
                    x = x.to(getattr(torch, slot.dtype))  # the precision policy's compute dtype
                values.append(x)
        outs = self.forward_gm(*values)
        n = 1 if self.last else self.num_outputs
        return tuple(outs[:n]), list(outs[n:])

    def run_backward(self, saved: list[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        tangent = self.tangent_dtype
        if self.last:
            seeds = [(grads[0].reshape(()) * self.loss_scale).to(tangent)]
        else:
            seeds = [grads[i] if grads[i] is not None else torch.zeros((), dtype=tangent) for i in self.grad_outputs]
            seeds.append(torch.ones((), dtype=tangent))  # the joint's loss tangent
        args, saved = saved, None  # the boxed backward graph empties the list (split_joint)
        args.extend(seeds)
        outs = list(self.backward_gm(args))
        num_params = len(self.program.graphs.grads)
        raw, input_grads = outs[:num_params], outs[num_params:]
        from autopar.runtime.spmd import accumulate

        self.raw = accumulate(self.raw, raw, self.program._input_storages, self.program.reduce_dtype)
        out: list[torch.Tensor | None] = [None] * self.num_inputs
        for pos, g in zip(self.grad_inputs, input_grads):
            out[pos] = g
        return out


class _StageFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, runner: StageRunner, anchor: torch.Tensor, *inputs: torch.Tensor) -> Any:
        outs, saved = runner.run_forward(inputs)
        ctx.runner = runner
        ctx.saved = saved
        if not runner.last:
            ctx.mark_non_differentiable(*[o for i, o in enumerate(outs) if i not in runner.grad_outputs])
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        saved, ctx.saved = ctx.saved, None
        return (None, None, *ctx.runner.run_backward(saved, grads))


class PerOpStage(nn.Module):
    """What a PipelineStage runs for one chunk: the per-rank forward graph, through an
    autograd Function whose backward is the per-rank backward graph. Holds no parameters
    of its own (the schedule neither scales nor sees them)."""

    def __init__(self, runner: StageRunner) -> None:
        super().__init__()
        self.__dict__["runner"] = runner

    def forward(self, *inputs: torch.Tensor) -> Any:
        out = _StageFunction.apply(self.runner, self.runner.anchor, *inputs)
        if self.runner.last:
            return out.reshape(1)
        return out


def _annotate_modules(chunk: fx.GraphModule) -> None:
    """Give every node of a chunk's flat graph its module path the way autopar/trace.py
    records it (meta "custom" "module"), from the export's module stack, so the traced
    joint graph knows its layers (layer groups for the ILP, recompute regions)."""
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
    from autopar.runtime.spmd import run_policy
    from autopar.trace import lower, trace, with_precision

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
    from autopar.batch import is_flat

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
    from autopar.runtime.spmd import master_weights
    from autopar.trace import to_compute_dtype

    masters = master_weights(model, precision)
    return masters, to_compute_dtype(model, microbatch, precision.compute)


def trace_chunks(model: nn.Module, config: ParallelConfig, example_inputs: Sequence[Any], *,
                 loss_fn: Callable[..., torch.Tensor] | None = None, stage_layers: tuple[int, ...] | None = None,
                 chunk_ids: Sequence[int] | None = None) -> list[TracedStage]:
    """`model`'s pipeline chunks (`chunk_ids`, default all) traced as every rank traces
    its own at build, in this process with no process group: what the search records
    per-stage placements from, what a plan's are checked against before ranks start, and
    what `--emit` applies. `example_inputs` is one global batch (its first dp * micro_batch
    rows are traced); `model` is cut in place (its modules are shared with the chunks)."""
    from autopar.runtime.pipe import split_model
    from autopar.runtime.spmd import run_policy

    micro, _, _ = first_microbatch(config, example_inputs)
    num_chunks = config.pp * config.interleave
    masters, micro = cut_in_compute_dtype(model, micro, run_policy(config))
    pipe, prefix, _ = split_model(model, micro, num_chunks=num_chunks, stage_layers=chunk_layers(stage_layers, config),
                                  loss_fn=loss_fn)
    boundaries = capture_boundaries(pipe, micro)
    return [trace_stage(pipe.get_stage_module(cid), cid, inputs=boundaries[cid][0], outputs=boundaries[cid][1],
                        last=cid == num_chunks - 1, config=config, layer_prefix=prefix, masters=masters)
            for cid in (range(num_chunks) if chunk_ids is None else chunk_ids)]


def build_stage_runner(stage: TracedStage, *, choices: Sequence[Any], config: ParallelConfig, mesh: DeviceMesh,
                       optimizer: OptimizerFactory) -> StageRunner:
    """Apply `choices` (one NodeStrategy per node of `stage.graph`: the ILP's, or a plan's
    stage placements) to one traced chunk on `mesh` (its (dp, tp) submesh) and split the
    per-rank joint graph into the forward and backward graphs a PipelineStage runs. The
    chunk's parameters become DTensors in their placements."""
    from codegen.apply import apply
    from autopar.runtime.spmd import SpmdProgram, distribute_parameters, release_build_memory
    from solver.forced import zero_2_syncs

    extra = list(stage.extra)
    if stage.last:
        # the loss leaves in its own placement (a pending sum over dp, say): it seeds the
        # backward through the loss tangent, and is reduced for reporting once per step
        # (as the pp = 1 program reports it; priced: pipeline_search.pipeline_loss_report_s)
        extra[0] = (extra[0][0], choices[extra[0][0]].outputs[0])
    # before the build: its peak holds shards only
    params = distribute_parameters(stage.chunk, stage.graph, choices, mesh, stage.masters)
    # zero 2: each microbatch's backward reduce-scatters its gradients to their update
    # shards (the sync lands in the backward graph) and the runner accumulates the shards
    graphs = apply(stage.traced.gm, stage.graph, choices, mesh, extra_outputs=extra, keep_phases=True,
                   sync_in_step=zero_2_syncs(config), compiled=config.compiled)
    # the applied step: (loss, raw grads..., outputs..., input grads...)
    num_inputs, outputs, grad_inputs = stage.num_inputs, stage.outputs, stage.grad_inputs
    num_grads = len(graphs.grads)
    num_fwd = 1 if stage.last else len(outputs)
    first_extra = 1 + num_grads
    seeds = {s for s, slot in zip([n.name for n in graphs.step.graph.nodes if n.op == "placeholder"], graphs.slots)
             if slot.role is Role.TANGENT or (slot.role is Role.INPUT
                                              and int(slot.name.removeprefix("input_")) >= num_inputs)}
    forward, backward, num_saved = split_joint(
        graphs.step, seeds, list(range(first_extra, first_extra + num_fwd)),
        list(range(1, 1 + num_grads)) + list(range(first_extra + num_fwd, first_extra + num_fwd + len(grad_inputs))))
    graphs.compile_like_step({"forward": forward, "backward": backward})  # Inductor where config.compiled
    program = SpmdProgram(config=config, mesh=mesh, model=stage.chunk, graphs=graphs, graph=stage.graph,
                          optimizer_factory=optimizer, choices=tuple(choices), params=params,
                          grads_at_update=zero_2_syncs(config))
    # as a one-stage program does: the joint and its two halves each carried make_fx's metadata
    release_build_memory(graphs.step, forward, backward, graphs.grad_sync, graphs.param_gather)
    return StageRunner(index=stage.index, program=program, forward=forward, backward=backward, num_saved=num_saved,
                       slots=graphs.slots, num_inputs=num_inputs, grad_inputs=grad_inputs, outputs=outputs,
                       grad_outputs=stage.grad_outputs, last=stage.last)


def solve_stage(graph: Graph, config: ParallelConfig, cluster: Any, *, num_microbatches: int, rows: int) -> Any:
    """The intra-op ILP on one chunk's (dp, tp) submesh under `config`'s rules
    (solver/forced.py), its boundary inputs and tangents in the boundary layout. `cluster`:
    the whole job's (one stage's devices of it are priced, as the pipeline search prices
    a stage), default dp * tp cpu devices."""
    from solver import forced

    if cluster is None:
        from autopar.cluster import Cluster

        cluster = Cluster.parse(f"cpu:1x{config.dp * config.tp}")
    if cluster.num_devices != config.dp * config.tp:
        cluster = cluster.stage(config.dp * config.tp)

    def keep_input(node: Any, placements: Placements) -> bool:
        return tuple(placements) == boundary_placements(node.output.shape, rows, config.dp)

    return forced.solve_stage(graph, config, cluster, num_microbatches=num_microbatches, keep_input=keep_input)


# ---------------------------------------------------------------------------------------
# the program


class PipeSpmdProgram:
    """One rank's share of a pipeline whose stages are per-op programs. Build with
    `build_pipe_spmd_program`."""

    def __init__(self, *, config: ParallelConfig, mesh: DeviceMesh, runners: list[StageRunner],
                 stages: list[Any], chunk_ids: tuple[int, ...], num_chunks: int, optimizer: torch.optim.Optimizer,
                 tie_groups: dict[str, dist.ProcessGroup], priced: dict[tuple[str, str], tuple[int, int]],
                 replayed: bool = False) -> None:
        self.config = config
        self.mesh = mesh
        self.submesh = mesh["dp", "tp"]
        self.runners = runners
        self.stages = stages
        self.chunk_ids = chunk_ids
        self.num_chunks = num_chunks
        self.optimizer = optimizer
        self.tie_groups = tie_groups
        """Canonical parameter name -> the group of pp ranks (this dp/tp coordinate) holding it."""
        self.priced = priced
        """What the stages' ILP solutions priced per step (this rank's chunks)."""
        self.replayed = replayed
        """True when the chunks' placements came from the plan (no ILP solved at build)."""
        self.chunks = [r.program.model for r in runners]
        self.rules = None
        self.tied_fqns: tuple[str, ...] = ()
        self.pp_rank = mesh.get_local_rank("pp")
        self.dp_rank = mesh.get_local_rank("dp")
        self.tp_rank = mesh.get_local_rank("tp")
        self.steps_done = 0
        self.last_stats: Any = None
        self._schedules: dict[int, Any] = {}

    @property
    def has_last(self) -> bool:
        return self.num_chunks - 1 in self.chunk_ids

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        seen: dict[str, nn.Parameter] = {}
        for r in self.runners:
            for name, p in r.program.named_parameters():
                seen.setdefault(name, p)
        return list(seen.items())

    def _schedule(self, num_mb: int) -> Any:
        """The schedule for `num_mb` microbatches, built once. The schedules' gradient
        scaling is off: the last chunk's loss tangent is 1 / num_mb already."""
        from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        from autopar.runtime.pipe import _output_is_loss

        if num_mb not in self._schedules:
            kind = self.config.schedule
            if kind == "interleaved":
                self._schedules[num_mb] = ScheduleInterleaved1F1B(self.stages, n_microbatches=num_mb,
                                                                  loss_fn=_output_is_loss, scale_grads=False)
            else:
                # as autopar/runtime/pipe.py: 1F1B needs as many microbatches as stages
                cls = Schedule1F1B if kind == "1f1b" and num_mb >= self.config.pp else ScheduleGPipe
                self._schedules[num_mb] = cls(self.stages[0], n_microbatches=num_mb, loss_fn=_output_is_loss,
                                              scale_grads=False)
        return self._schedules[num_mb]

    def step(self, batch: Sequence[torch.Tensor]) -> float:
        """One optimizer step on the global `batch` (identical on every rank); returns the
        mean loss over the whole batch, on every rank."""
        from autopar.runtime.program import optimizer_update

        dp, rows = self.config.dp, self.config.micro_batch
        tensors = [t for t in batch if isinstance(t, torch.Tensor)]
        size = tensors[0].shape[0]
        if size % (dp * rows):
            raise ValueError(f"batch of {size} sequences does not split into dp * micro-batch = {dp} * {rows}; "
                             f"use a global batch that is a multiple of {dp * rows}")
        # this dp rank's rows; the schedule cuts them into microbatches, so microbatch i of
        # every dp rank together is one global microbatch, split by batch over dp (the
        # boundary layout the first chunk was compiled for)
        local = tuple(t.chunk(dp, dim=0)[self.dp_rank] for t in tensors)
        num_mb = local[0].shape[0] // rows
        for r in self.runners:
            r.raw = None
            r.loss_scale = 1.0 / num_mb
        losses: list[torch.Tensor] = []
        args = local if 0 in self.chunk_ids else ()
        self._schedule(num_mb).step(*args, target=local[-1] if self.has_last else None, losses=losses)
        for stage in self.stages:  # its microbatches' inputs and outputs (the last chunk's losses,
            stage.clear_runtime_states()  # with their autograd graphs): the schedule clears them
        # only when its next step starts
        grad_bytes = 0
        for r in self.runners:
            raw, r.raw = r.raw, None
            grad_bytes += r.program.set_gradients(raw)
        self._sum_tied_gradients()
        value = torch.zeros(())
        if self.has_last:  # this rank's pieces of the microbatches' losses -> the global mean
            local = torch.stack([l.detach().float().reshape(()) for l in losses]).mean()
            whole = self.runners[-1].program._global_loss(local)
            if self.dp_rank == 0 and self.tp_rank == 0:
                value = torch.tensor(whole)
        dist.all_reduce(value)  # the loss to every rank (priced: pipeline_search.pipeline_loss_report_s)
        loss = float(value)
        optimizer_update(self, loss)
        self.gather_weights()
        self.last_stats = self._stats(grad_bytes)
        return loss

    def compile_times(self) -> dict[str, float]:
        """{graph: seconds Inductor spent compiling it} (`--compile`; its first call), per chunk."""
        return {f"chunk{r.index}.{label}": s for r in self.runners
                for label, s in r.program.graphs.compile_times.seconds.items()}

    def gather_weights(self) -> None:
        """Every chunk's weights updated in another placement, gathered to their compute
        placement once per step (weight-update sharding: not once per microbatch)."""
        for r in self.runners:
            r.program.gather_weights()

    def _sum_tied_gradients(self) -> None:
        """Every copy of a tensor several chunks hold (a tied embedding and head) gets the
        sum of their gradients: whole gradients summed over this rank's copies and over the
        pp ranks holding it, then each copy takes its own shard of the sum."""
        from torch.distributed.tensor import DTensor

        from autopar.runtime.spmd import local_shard
        from autopar import dtensor_bridge as bridge

        holders: dict[str, list[Any]] = {}
        for r in self.runners:
            for name, p in r.program.named_parameters():
                holders.setdefault(name, []).append((r.program, p))
        for name in sorted(holders):
            copies = holders[name]
            if len(copies) < 2 and name not in self.tie_groups:
                continue
            total = sum(p.grad.full_tensor() for _, p in copies)
            if name in self.tie_groups:
                dist.all_reduce(total, group=self.tie_groups[name])
            for program, p in copies:
                placements = bridge.from_dtensor_placements(p.placements)
                g = local_shard(total, placements, program.coords, program.mesh_shape)
                p.grad = DTensor.from_local(g, program.mesh, p.placements, run_check=False, shape=p.shape,
                                            stride=p.stride())

    def priced_state_bytes(self) -> tuple[float, float, float]:
        """(weights, gradients, optimizer state) bytes this rank's chunks are priced at
        (SpmdProgram.priced_state_bytes, summed over the chunks)."""
        parts = [r.program.priced_state_bytes() for r in self.runners]
        return sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts)

    def _stats(self, grad_bytes: int) -> Any:
        import resource

        from autopar.runtime.program import StepStats, _local

        params = [p for _, p in self.named_parameters()]
        state_bytes = sum(_local(v).numel() * _local(v).element_size() for s in self.optimizer.state.values()
                          for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        copies = [t for r in self.runners for t in r.program._compute.values()]
        return StepStats(parameter_bytes=sum(_local(p).numel() * _local(p).element_size() for p in params)
                         + sum(t.numel() * t.element_size() for t in copies),
                         gradient_bytes=grad_bytes, optimizer_state_bytes=state_bytes,
                         peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Whole copies of this rank's parameters under their canonical names (collective
        over the (dp, tp) submesh: call on every rank)."""
        out: dict[str, torch.Tensor] = {}
        for r in self.runners:
            for name, p in r.program.full_parameters().items():
                out.setdefault(name, p)
        return out

    @property
    def sources(self) -> dict[str, str]:
        """Source of this rank's chunks as they run, by chunk (`stage<k>`): per chunk the
        forward and backward graphs (ATen ops and collectives on local shards) and the
        gradient sync."""
        return {f"stage{r.index}": runner_source(r, self.config, self.num_chunks, tuple(self.submesh.shape))
                for r in self.runners}

    @property
    def code(self) -> str:
        """`sources`, every chunk of this rank in one text."""
        return "\n\n".join(self.sources.values())

    def collectives_per_step(self, num_microbatches: int, *, boundary: bool = False
                             ) -> dict[tuple[str, str], tuple[int, int]]:
        """The collectives this rank's stage graphs run per step: {(kind, mesh axis name):
        (calls, bytes)}, forward and backward m times, the gradient sync once. Those the
        stages' ILP priced; with `boundary`, instead the boundary reshards the ILP does not
        price (an output or input gradient brought to the layout the stages exchange)."""
        from codegen.apply import count_collectives
        from torch.distributed.distributed_c10d import _resolve_process_group

        def where(node: fx.Node) -> bool:
            return bool((node.meta.get("custom") or {}).get("boundary")) == boundary

        axis_of = {tuple(dist.get_process_group_ranks(self.submesh.get_group(i))): name
                   for i, name in enumerate(self.submesh.mesh_dim_names)}
        out: dict[tuple[str, str], list[int]] = {}
        for r in self.runners:
            for gm, times in ((r.forward_gm, num_microbatches), (r.backward_gm, num_microbatches),
                              (r.program.graphs.grad_sync, 1), (r.program.graphs.param_gather, 1)):
                if gm is None:
                    continue
                for (kind, group), sizes in count_collectives(gm, where).items():
                    ranks = tuple(dist.get_process_group_ranks(_resolve_process_group(group)))
                    entry = out.setdefault((kind, axis_of[ranks]), [0, 0])
                    entry[0] += times * len(sizes)
                    entry[1] += times * sum(sizes)
        return {k: (v[0], v[1]) for k, v in out.items()}

    def state_dict(self) -> dict[str, Any]:
        """Sharded model and optimizer state (the chunks hold the DTensor parameters under
        the model's names)."""
        from autopar.runtime.program import chunks_state_dict

        return chunks_state_dict(self.chunks, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from autopar.runtime.program import load_chunks_state_dict

        load_chunks_state_dict(self.chunks, self.optimizer, state)
        self.gather_weights()


def check_stage_placements(model: nn.Module, config: ParallelConfig, example_inputs: Sequence[Any], plan: Any, *,
                           loss_fn: Callable[..., torch.Tensor] | None = None) -> None:
    """Raise PlanFileError where `plan`'s stage placements do not match `model`'s chunks as
    the ranks will trace them (node keys and ops, every chunk): found once, in this process
    with no process group, before any rank starts (the launcher calls this)."""
    import copy

    for stage in trace_chunks(copy.deepcopy(model), config, example_inputs, loss_fn=loss_fn,
                              stage_layers=tuple(plan.stage_layers) or None):
        plan.stage_placements_for(stage.index, stage.graph)


def runner_source(runner: StageRunner, config: ParallelConfig, num_chunks: int, submesh_shape: tuple[int, ...]
                  ) -> str:
    """One chunk's per-rank program as Python source: forward, backward and gradient sync."""
    return (f"# chunk {runner.index} of {num_chunks} (pipeline stage {runner.index % config.pp}) on a (dp, tp) = "
            f"{submesh_shape} submesh; config: {config.to_json()}\n"
            f"# forward: (parameters, buffers, inputs) -> (outputs, saved values)\n"
            f"{runner.forward_gm.code}\n# backward: (saved values, output gradients, loss tangent) -> "
            f"(raw gradients, input gradients)\n{runner.backward_gm.code}"
            + ("\n# grad_sync: none (zero 2: the backward syncs each microbatch's gradients)"
               if runner.program.graphs.grad_sync is None else
               "\n# grad_sync: raw gradients -> gradients in their parameters' update placements (once per step)\n"
               + runner.program.graphs.grad_sync.code)
            + ("" if runner.program.graphs.param_gather is None else
               "\n# param_gather: updated weights -> their compute placement (once per step)\n"
               + runner.program.graphs.param_gather.code))


def stage_sources(plan: Any, model: nn.Module, example_inputs: Sequence[Any], mesh: DeviceMesh, *,
                  loss_fn: Callable[..., torch.Tensor] | None = None) -> dict[str, str]:
    """Every chunk's per-rank program of a pp > 1 `plan` as Python source, by chunk
    (`stage<k>`), as the rank at (dp, tp) coordinate `mesh.get_coordinate()` of its stage
    builds it: the chunk traced as at build, the plan's stage placements applied (or, for
    a plan without them, the stage ILP's solution), split into forward and backward.
    `mesh` is a ("dp", "tp") mesh of dp * tp ranks (a `fake` process group will do:
    nothing runs); `model` is cut and its parameters replaced by shards."""
    from autopar.runtime.program import default_optimizer
    from autopar.runtime.spmd import solution_choices

    config = plan.config
    rows = config.dp * config.micro_batch
    num_mb = plan.global_batch // rows
    num_chunks = config.pp * config.interleave
    stages = trace_chunks(model, config, example_inputs, loss_fn=loss_fn,
                          stage_layers=tuple(plan.stage_layers) or None)
    out: dict[str, str] = {}
    for stage in stages:
        if plan.stage_placements:
            choices = plan.stage_placements_for(stage.index, stage.graph)
            how = "the plan's stage placements"
        else:
            from autopar.cluster import Cluster

            solution = solve_stage(stage.graph, config, Cluster.parse(plan.cluster), num_microbatches=num_mb,
                                   rows=rows)
            choices, how = solution_choices(stage.graph, solution), "solved here (the plan has no stage placements)"
        runner = build_stage_runner(stage, choices=choices, config=config, mesh=mesh, optimizer=default_optimizer())
        out[f"stage{stage.index}"] = (f"# autopar {plan.model}: per-rank program of pipeline chunk {stage.index}, "
                                      f"placements: {how}\n" + runner_source(runner, config, num_chunks,
                                                                              tuple(mesh.shape)))
    return out


def build_pipe_spmd_program(model: nn.Module, config: ParallelConfig, example_inputs: Sequence[Any], *,
                            loss_fn: Callable[..., torch.Tensor] | None = None, optimizer: OptimizerFactory,
                            stage_layers: tuple[int, ...] | None = None, mesh: DeviceMesh | None = None,
                            cluster: Any = None, plan: Any = None) -> PipeSpmdProgram:
    """This rank's chunks of `model`, cut at its repeated layers, each compiled by the
    per-op path on its (dp, tp) submesh, with their schedule; collective. `example_inputs`
    is one global batch (its first dp * micro_batch rows are traced).

    Each chunk's placements: `plan`'s stage placements where it has them (matched to the
    chunk's traced graph; a mismatch raises PlanFileError on every rank), else the ILP
    solves the chunk under `config`'s rules (the first rank of each submesh solves)."""
    from torch.distributed.pipelining import PipelineStage

    from autopar.runtime.program import make_mesh
    from autopar.runtime.pipe import _canonical_names, _tie_groups, split_model
    from autopar.runtime.spmd import local_shard, make_optimizer, priced_per_step, run_policy, solution_choices

    if config.schedule == "zb":
        raise ValueError("--schedule zb is not run by per-op pipeline stages (their backward computes input and "
                         "weight gradients together); use 1f1b, gpipe or interleaved")
    mesh = mesh if mesh is not None else make_mesh(config)
    submesh = mesh["dp", "tp"]
    micro, size, rows = first_microbatch(config, example_inputs)
    num_mb = size // rows
    num_chunks = config.pp * config.interleave
    canonical = _canonical_names(model)
    # the stages compute in, and exchange, the precision policy's compute dtype
    masters, micro = cut_in_compute_dtype(model, micro, run_policy(config, mesh.device_type))
    pipe, prefix, ranges = split_model(model, micro, num_chunks=num_chunks,
                                       stage_layers=chunk_layers(stage_layers, config), loss_fn=loss_fn)
    boundaries = capture_boundaries(pipe, micro)
    pp_rank = mesh.get_local_rank("pp")
    leader = {int(mesh.mesh[p, 0, 0]) for p in range(config.pp)}
    chunk_ids = tuple(pp_rank + v * config.pp for v in range(config.interleave))
    replay = plan is not None and bool(getattr(plan, "stage_placements", ()))

    def choose(stage: TracedStage) -> tuple[tuple[Any, ...], dict[tuple[str, str], tuple[int, int]]]:
        # replayed: every rank matches its chunk to the plan; solved: the first rank of each
        # submesh solves its chunk and every rank receives its own submesh's solution. Either
        # way a failure on any rank (PlanFileError, InfeasiblePlanError) is raised on every rank.
        mine: Any = None
        if replay:
            try:
                choices = plan.stage_placements_for(stage.index, stage.graph)
                recorded = next(s for s in plan.stage_placements if s.chunk == stage.index)
                mine = (choices, {(kind, axis): (calls, nbytes) for kind, axis, calls, nbytes in recorded.collectives})
            except ValueError as exc:  # PlanFileError
                mine = exc
        elif dist.get_rank() in leader:
            try:
                mine = solve_stage(stage.graph, config, cluster, num_microbatches=num_mb, rows=rows)
            except ValueError as exc:  # InfeasiblePlanError too: every rank raises it
                mine = exc
        # the other ranks wait out the solves, however long (a replayed rank sends only its error)
        box = gather_build_results(mine if not replay or isinstance(mine, Exception) else None)
        failed = next((b for b in box if isinstance(b, Exception)), None)
        if failed is not None:
            raise failed
        if replay:
            return mine
        solution = box[int(mesh.mesh[pp_rank, 0, 0])]
        return solution_choices(stage.graph, solution), priced_per_step(solution, num_mb, ("dp", "tp"))

    runners, stages = [], []
    priced: dict[tuple[str, str], tuple[int, int]] = {}
    coords, mesh_shape = tuple(submesh.get_coordinate()), tuple(submesh.shape)
    for cid in chunk_ids:
        ins, outs = boundaries[cid]
        last = cid == num_chunks - 1
        stage = trace_stage(pipe.get_stage_module(cid), cid, inputs=ins, outputs=outs, last=last, config=config,
                            layer_prefix=prefix, masters=masters)
        choices, chunk_priced = choose(stage)
        for key, (calls, nbytes) in chunk_priced.items():
            c, b = priced.get(key, (0, 0))
            priced[key] = (c + calls, b + nbytes)
        runner = build_stage_runner(stage, choices=choices, config=config, mesh=submesh, optimizer=optimizer)
        runners.append(runner)

        def local(x: torch.Tensor, grad: bool) -> torch.Tensor:
            piece = local_shard(x.detach(), boundary_placements(x.shape, rows, config.dp), coords, mesh_shape)
            return piece.clone().requires_grad_(grad)

        in_args = tuple(local(x, i in runner.grad_inputs) for i, x in enumerate(ins))
        out_args = (outs[0].detach().reshape(1),) if last else \
            tuple(local(o, i in runner.grad_outputs) for i, o in enumerate(outs))
        stages.append(PipelineStage(PerOpStage(runner), cid, num_chunks, torch.device(mesh.device_type),
                                    input_args=in_args, output_args=out_args, group=mesh.get_group("pp")))
    masters.clear()  # the other chunks' master weights: this rank holds its own, sharded
    mine = {name for r in runners for name, _ in r.program.named_parameters()}
    tie_groups = _tie_groups(pipe, canonical, config, mesh, mine)
    params: dict[int, nn.Parameter] = {}
    for r in runners:
        for _, p in r.program.named_parameters():
            params.setdefault(id(p), p)
    opt = make_optimizer(optimizer, list(params.values()))
    log.info("rank %d: per-op pipeline chunks %s of %d (layers %s of %s) on a %s submesh, placements %s",
             dist.get_rank(), chunk_ids, num_chunks, [(ranges[i].start, ranges[i].stop) for i in chunk_ids], prefix,
             mesh_shape, "replayed from the plan" if replay else "solved")
    return PipeSpmdProgram(config=config, mesh=mesh, runners=runners, stages=stages, chunk_ids=chunk_ids,
                           num_chunks=num_chunks, optimizer=opt, tie_groups=tie_groups, priced=priced,
                           replayed=replay)


__all__ = ["PerOpStage", "PipeSpmdProgram", "StageRunner", "TracedStage", "boundary_placements",
           "build_pipe_spmd_program", "build_stage_runner", "capture_boundaries", "check_stage_placements",
           "chunk_layers", "runner_source", "split_joint", "stage_sources", "trace_chunks", "trace_stage"]
