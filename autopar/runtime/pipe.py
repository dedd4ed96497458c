"""Pipelines for any model with a repeated layer stack: stages cut at the layers' boundaries.

Where it sits: runtime, behind `autopar.runtime.program.build_program` for pp > 1 plans of models
the family rule tables do not know (Hugging Face models, factories). On every rank:
1. find the repeated layer stack (the model's largest ModuleList / Sequential / numbered
   ModuleDict: the container autopar/trace.py groups layers by) and cut it into
   pp * interleave chunks (the plan's `stage_layers` or an even split, codegen/stages.py);
2. capture one microbatch of the training step (model + loss, or a model whose forward
   returns the loss) with `torch.distributed.pipelining.pipeline`, whose split points are
   the first layer of every chunk but the first: chunk 0 holds everything before its last
   layer's successor (embeddings, masks, position ids), the last chunk everything after
   its first layer (final norm, head, loss). Parameter names inside each stage module are
   the unsplit model's, so checkpoints and comparisons need no renaming;
3. keep this rank's chunks (rank r on the pp axis owns chunks r, r + pp, ...) and run them
   with torch's schedules (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, and
   ScheduleInterleavedZeroBubble for `zb`: each backward split into its input- and
   weight-gradient halves, the latter filling the bubbles); the last
   stage's output is the loss (the schedule's loss function passes it through), and the
   schedule scales gradients by 1 / num_microbatches.

Model inputs reach later stages through the first: every tensor input is copied at the
top of the traced step, so the copy is made in chunk 0 and sent on like an activation
(torch's traced stages feed root inputs to the first stage only; labels are consumed by
the last).

Gradients: data parallelism (zero 0) is one flat all-reduce over the dp axis after the
last microbatch; ZeRO-2/3 put FSDP2 on each stage module (gradients reduce-scattered,
parameters gathered per stage; 3 also frees them after forward). A parameter that several chunks use (a tied embedding and head) is held
by each; within a rank its chunks share one tensor, across pp ranks their gradients are
summed over a group of the ranks holding it (Megatron's embedding group), so every copy
takes the same optimizer step.

`pipeline_support` (autopar/capabilities.py) says which configurations this runs.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.config import ParallelConfig
from autopar.runtime.program import RankProgram, _local

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


def _output_is_loss(output: torch.Tensor, target: Any) -> torch.Tensor:
    """The schedule's loss function: the last stage already returns the loss (as a
    one-element tensor, so the schedule can concatenate the microbatches' outputs)."""
    return output.sum()


def routed(model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None) -> nn.Module:
    """`model` (sharing its modules and parameters, so names are unchanged) with a forward
    that copies every tensor input first (so later stages receive them from stage 0) and
    returns the loss (shape (1,)): `loss_fn(model(*inputs[:-1]), inputs[-1])`, or the model's own
    output (its `.loss` for Hugging Face outputs)."""
    import copy

    base = type(model)

    def forward(self: nn.Module, *args: Any) -> torch.Tensor:
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        out = loss_fn(base.forward(self, *args[:-1]), args[-1]) if loss_fn is not None else base.forward(self, *args)
        if not isinstance(out, torch.Tensor) and hasattr(out, "loss"):
            out = out.loss
        return out.reshape(1)

    routed_cls = type(f"Routed{base.__name__}", (base,), {"forward": forward})
    out = copy.copy(model)  # shares _modules/_parameters: the same tensors under the same names
    out.__class__ = routed_cls
    return out


def split_model(model: nn.Module, microbatch: Sequence[Any], *, num_chunks: int,
                stage_layers: tuple[int, ...] | None = None,
                loss_fn: Callable[..., torch.Tensor] | None = None) -> tuple[Any, str, tuple[range, ...]]:
    """Cut `model`'s training step into `num_chunks` pipeline stages at its repeated layers.

    Returns (torch Pipe, layer container path, layer range per chunk). Raises ValueError
    when the model has no repeated layer stack or too few layers."""
    from unittest import mock

    import torch.distributed.pipelining._IR as pipelining_ir
    from torch.distributed.pipelining import SplitPoint, pipeline

    from autopar.capabilities import layer_stack, split_layers
    from autopar.trace import _hf_compiling_patch, _sdpa_backends

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

    with _hf_compiling_patch(model), torch.nn.attention.sdpa_kernel(_sdpa_backends()), \
            mock.patch.object(pipelining_ir, "_outline_submodules", flat_stage):
        pipe = pipeline(routed(model, loss_fn), mb_args=tuple(microbatch), split_spec=split_spec)
    if pipe.num_stages != num_chunks:
        raise ValueError(f"cutting {type(model).__name__} at layers {[r.start for r in ranges[1:]]} of {prefix} "
                         f"gave {pipe.num_stages} stages, not {num_chunks} (a layer is called out of order?)")
    canonical = _canonical_names(model)
    for index in range(pipe.num_stages):
        _canonicalize(pipe.get_stage_module(index), canonical)
    relays = relay_skips(pipe)
    log.info("cut %s at layers %s of %s: %d stages, %d values relayed past a stage", type(model).__name__,
             [r.start for r in ranges[1:]], prefix, pipe.num_stages, relays)
    return pipe, prefix, ranges


def relay_skips(pipe: Any) -> int:
    """Route every value a stage sends past its neighbour through the stages in between
    (each passes it on unchanged), so stages talk to adjacent stages only, which torch's
    multi-stage schedules (interleaved 1F1B, zero bubble) require. Returns the relays added.

    A Hugging Face model computes its attention mask and position ids before the first
    layer and every layer reads them: cut in k chunks, chunk 0 would send them to all k - 1
    others."""
    import operator

    from torch import fx

    outer = pipe.split_gm.graph
    calls = [n for n in outer.nodes if n.op == "call_module"]
    stage_of = {n: k for k, n in enumerate(calls)}

    def source(value: fx.Node) -> int:
        while value.op == "call_function" and value.target is operator.getitem:
            value = value.args[0]
        return stage_of.get(value, -1)

    relayed: dict[tuple[fx.Node, int], fx.Node] = {}

    def pass_through(call: fx.Node, value: fx.Node, example: Any) -> fx.Node:
        sub = pipe.split_gm.get_submodule(call.target)
        graph = sub.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        if value in call.args:  # the stage reads it too: pass its own input on
            ph = placeholders[list(call.args).index(value)]
        else:
            with graph.inserting_after(placeholders[-1]):
                ph = graph.placeholder(f"relay_{value.name}")
            ph.meta["val"] = example
            call.args = tuple(call.args) + (value,)
        output = graph.output_node()
        old = output.args[0]
        if not isinstance(old, (tuple, list)):  # one output: the outer graph reads it as item 0 now
            with outer.inserting_after(call):
                first = outer.call_function(operator.getitem, (call, 0))
            call.replace_all_uses_with(first, delete_user_cb=lambda user: user is not first)
            old = (old,)
        output.args = (tuple(old) + (ph,),)
        graph.lint()
        sub.recompile()
        getters = [u for u in call.users if u.target is operator.getitem]
        with outer.inserting_after(getters[-1] if getters else call):
            return outer.call_function(operator.getitem, (call, len(old)))

    for k, call in enumerate(calls):
        sub = pipe.split_gm.get_submodule(call.target)
        examples = [n.meta["val"] for n in sub.graph.nodes if n.op == "placeholder"]
        for pos in range(len(call.args)):
            value = call.args[pos]  # read afresh: a relay may have rewritten this stage's inputs
            if not isinstance(value, fx.Node):
                continue
            s = source(value)
            if s < 0 and k > 0:
                raise ValueError(f"stage {k} reads model input {value.name} directly; inputs must reach later "
                                 "stages through the first (autopar.runtime.pipe.routed)")
            for j in range(s + 1, k):
                key = (value, j)
                if key not in relayed:
                    relayed[key] = pass_through(calls[j], value, examples[pos])
                value = relayed[key]
            call.update_arg(pos, value)
    for k, call in enumerate(calls[1:], start=1):
        _order_inputs(pipe, call, calls[k - 1])
    outer.lint()
    pipe.split_gm.recompile()
    return len(relayed)


def _order_inputs(pipe: Any, call: Any, previous: Any) -> None:
    """Order stage `call`'s inputs as its predecessor sends them (by output index): the
    sends and receives between two stages are matched in the order they are posted."""
    import operator

    sub = pipe.split_gm.get_submodule(call.target)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]

    def index(value: Any) -> int:
        if value is previous:
            return 0
        assert value.target is operator.getitem and value.args[0] is previous, "not adjacent after relaying"
        return value.args[1]

    order = sorted(range(len(call.args)), key=lambda i: index(call.args[i]))
    if order == list(range(len(order))):
        return
    anchor = placeholders[-1].next
    for i in order:
        anchor.prepend(placeholders[i])
    call.args = tuple(call.args[i] for i in order)
    sub.graph.lint()
    sub.recompile()


def _canonical_names(model: nn.Module) -> dict[str, str]:
    """Every parameter name -> the first name of its tensor (tied names share one)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def _canonicalize(stage: nn.Module, canonical: dict[str, str]) -> None:
    """Read every tied tensor under its canonical name. torch's splitter keeps one of a tied
    tensor's names per stage, picked in set order, which varies between processes: dp peers
    would then hold their parameters in different orders (FSDP's all-gathers and the flat
    gradient all-reduce need one order)."""
    changed = False
    for node in stage.graph.nodes:
        if node.op != "get_attr" or canonical.get(node.target, node.target) == node.target:
            continue
        alias, name = node.target, canonical[node.target]
        owner, _, leaf = alias.rpartition(".")
        value = getattr(stage.get_submodule(owner), leaf, None)
        if value is not None:
            new_owner, _, new_leaf = name.rpartition(".")
            target = stage.get_submodule(new_owner)
            if getattr(target, new_leaf, None) is None:
                target.register_parameter(new_leaf, value)
            delattr(stage.get_submodule(owner), leaf)
        node.target = name
        changed = True
    for alias, _ in list(stage.named_parameters(remove_duplicate=False)):
        if canonical.get(alias, alias) != alias:  # a leftover copy under an alias, read by no node
            owner, _, leaf = alias.rpartition(".")
            delattr(stage.get_submodule(owner), leaf)
    if changed:
        stage.recompile()


def _retie(chunks: list[nn.Module], canonical: dict[str, str]) -> dict[str, nn.Parameter]:
    """Make every name of one tied tensor, in all of this rank's chunks, one parameter (the
    splitter may copy a tensor used by several stages); returns canonical name -> it."""
    shared: dict[str, nn.Parameter] = {}
    for chunk in chunks:
        for name, p in list(chunk.named_parameters(remove_duplicate=False)):
            keep = shared.setdefault(canonical.get(name, name), p)
            if keep is not p:
                module_name, _, leaf = name.rpartition(".")
                setattr(chunk.get_submodule(module_name), leaf, keep)
    return shared


class PipeProgram:
    """One rank's share of a pipeline cut at the repeated layers. Build with `build_pipe_program`."""

    def __init__(self, *, config: ParallelConfig, mesh: DeviceMesh, chunks: list[nn.Module], stages: list[Any],
                 chunk_ids: tuple[int, ...], num_chunks: int, optimizer: torch.optim.Optimizer,
                 params: dict[str, nn.Parameter], tie_groups: dict[str, dist.ProcessGroup]) -> None:
        self.config = config
        self.mesh = mesh
        self.chunks = chunks
        self.stages = stages
        self.chunk_ids = chunk_ids
        self.num_chunks = num_chunks
        self.optimizer = optimizer
        self._params = params
        self.tie_groups = tie_groups
        """Canonical parameter name -> the group of pp ranks (this dp/tp coordinate) holding it."""
        self.rules = None
        self.tied_fqns: tuple[str, ...] = ()
        self.pp_rank = mesh.get_local_rank("pp")
        self.dp_rank = mesh.get_local_rank("dp")
        self.tp_rank = mesh.get_local_rank("tp")
        self.steps_done = 0
        self.last_stats: Any = None
        self._schedules: dict[int, Any] = {}

    # issue 18 (i18c): one home for which chunks a rank holds, RankProgram's properties
    has_first = RankProgram.has_first
    has_last = RankProgram.has_last

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self._params.items())

    def _schedule(self, num_mb: int) -> Any:
        """The schedule for `num_mb` microbatches, built once (a new one re-runs shape inference)."""
        from torch.distributed.pipelining.schedules import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                                            ScheduleInterleavedZeroBubble)

        if num_mb not in self._schedules:
            kind = self.config.schedule
            if kind in ("interleaved", "zb"):
                cls = ScheduleInterleaved1F1B if kind == "interleaved" else ScheduleInterleavedZeroBubble
                self._schedules[num_mb] = cls(self.stages, n_microbatches=num_mb, loss_fn=_output_is_loss)
            else:
                # torch's 1F1B refuses fewer microbatches than stages; with so few its warm-up
                # runs every forward first anyway: GPipe's order and memory
                cls = Schedule1F1B if kind == "1f1b" and num_mb >= self.config.pp else ScheduleGPipe
                self._schedules[num_mb] = cls(self.stages[0], n_microbatches=num_mb, loss_fn=_output_is_loss)
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
        local = tuple(t.chunk(dp, dim=0)[self.dp_rank] for t in tensors)
        num_mb = local[0].shape[0] // rows
        losses: list[torch.Tensor] = []
        args = local if self.has_first else ()
        self._schedule(num_mb).step(*args, target=local[-1] if self.has_last else None, losses=losses)
        loss_sum = torch.stack([l.detach().float() for l in losses]).mean() if self.has_last else torch.zeros(())
        grad_bytes = self._sync_grads()
        value = loss_sum.clone() if self.has_last and self.tp_rank == 0 else torch.zeros(())
        dist.all_reduce(value)
        loss = float(value) / dp
        optimizer_update(self, loss)
        self.last_stats = self._stats(grad_bytes)
        return loss

    def _sync_grads(self) -> int:
        named = [(n, p) for n, p in self._params.items() if p.grad is not None]
        grads = [p.grad for _, p in named]
        fsdp = self.config.zero >= 2 and self.config.dp > 1  # FSDP reduce-scattered them already
        if self.config.dp > 1 and grads and not fsdp:
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.mesh.get_group("dp"))
            flat /= self.config.dp
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
        for name, group in self.tie_groups.items():
            p = self._params[name]
            if p.grad is None:  # held but unused on this stage: it still joins the sum
                p.grad = torch.zeros_like(p)
            dist.all_reduce(_local(p.grad), group=group)  # same dp shard on every holder
        return sum(_local(p.grad).numel() * _local(p.grad).element_size() for p in self._params.values()
                   if p.grad is not None)

    def _stats(self, grad_bytes: int) -> Any:
        import resource

        from autopar.runtime.program import StepStats

        state_bytes = sum(_local(v).numel() * _local(v).element_size() for s in self.optimizer.state.values()
                          for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return StepStats(parameter_bytes=sum(_local(p).numel() * _local(p).element_size()
                                             for p in self._params.values()),
                         gradient_bytes=grad_bytes, optimizer_state_bytes=state_bytes,
                         peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Whole copies of this rank's parameters, under their canonical names (collective
        over dp under ZeRO-2/3: call on every rank)."""
        return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for name, p in self._params.items()}

    def state_dict(self) -> dict[str, Any]:
        raise ValueError("checkpoints of pipelines cut at a model's layers (models without a family table) are not "
                         "supported yet; train without --save-every / --resume, or use --pp 1")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state_dict()  # raises the same reason


def _tie_groups(pipe: Any, canonical: dict[str, str], config: ParallelConfig, mesh: DeviceMesh,
                mine: set[str]) -> dict[str, dist.ProcessGroup]:
    """Groups of the pp ranks (per dp/tp coordinate) that hold one tied tensor, for every
    tensor held on more than one pp rank. Every rank creates every group, in one order."""
    from autopar.runtime.program import _default_group_timeout

    holders: dict[str, set[int]] = {}
    for index in range(pipe.num_stages):
        for name, _ in pipe.get_stage_module(index).named_parameters(remove_duplicate=False):
            holders.setdefault(canonical.get(name, name), set()).add(index % config.pp)
    grid = mesh.mesh  # (pp, dp, tp) global ranks
    groups: dict[str, dist.ProcessGroup] = {}
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for name in sorted(holders):
        pp_ranks = sorted(holders[name])
        if len(pp_ranks) < 2:
            continue
        for d in range(config.dp):
            for t in range(config.tp):
                ranks = tuple(int(grid[r, d, t]) for r in pp_ranks)
                if ranks not in made:
                    made[ranks] = dist.new_group(list(ranks), timeout=_default_group_timeout())
                if dist.get_rank() in ranks and name in mine:
                    groups[name] = made[ranks]
    return groups


def build_pipe_program(model: nn.Module, config: ParallelConfig, example_inputs: Sequence[Any], *,
                       loss_fn: Callable[..., torch.Tensor] | None = None, optimizer: OptimizerFactory,
                       stage_layers: tuple[int, ...] | None = None, mesh: DeviceMesh | None = None) -> PipeProgram:
    """This rank's chunks of `model` cut at its repeated layers, with their schedule; collective.
    `example_inputs` is one global batch (its first micro_batch rows are traced)."""
    from torch.distributed.pipelining.stage import build_stage

    from autopar.capabilities import pipeline_support
    from autopar.runtime.program import make_mesh

    reason = pipeline_support(model, config)
    if reason is not None:
        raise ValueError(reason)
    mesh = mesh if mesh is not None else make_mesh(config)
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    size = tensors[0].shape[0]
    micro = tuple(t[:config.micro_batch] if t.dim() and t.shape[0] == size else t for t in tensors)
    num_chunks = config.pp * config.interleave
    canonical = _canonical_names(model)
    pipe, prefix, ranges = split_model(model, micro, num_chunks=num_chunks, stage_layers=stage_layers,
                                       loss_fn=loss_fn)
    pp_rank = mesh.get_local_rank("pp")
    chunk_ids = tuple(pp_rank + v * config.pp for v in range(config.interleave))
    chunks = [pipe.get_stage_module(i) for i in chunk_ids]
    shared = _retie(chunks, canonical)
    tie_groups = _tie_groups(pipe, canonical, config, mesh, set(shared))
    device = torch.device(mesh.device_type)
    info = pipe.info()
    stages = [build_stage(chunk, cid, info, device, group=mesh.get_group("pp")) for chunk, cid in zip(chunks, chunk_ids)]
    # sorted by name: the flat dp all-reduce needs one order on every dp rank, and torch's
    # splitter places a tied tensor's names in set order (it varies between processes)
    if config.zero >= 2 and config.dp > 1:
        # ZeRO-2/3: FSDP2 over dp on each stage module; the schedule drives its gradient
        # reduce-scatter and resharding (its REDUCE_GRAD / RESHARD actions)
        from torch.distributed.fsdp import fully_shard

        for chunk in chunks:
            fully_shard(chunk, mesh=mesh["dp"], reshard_after_forward=config.zero == 3)
        shared = _retie(chunks, canonical)  # the DTensor parameters FSDP put in place
    params = {name: shared[name] for name in sorted(shared) if shared[name].requires_grad}
    opt = optimizer(list(params.values()))
    log.info("rank %d: pipeline chunks %s of %d (layers %s of %s), %d parameters", dist.get_rank(), chunk_ids,
             num_chunks, [(ranges[i].start, ranges[i].stop) for i in chunk_ids], prefix, len(params))
    return PipeProgram(config=config, mesh=mesh, chunks=chunks, stages=stages, chunk_ids=chunk_ids,
                       num_chunks=num_chunks, optimizer=opt, params=params, tie_groups=tie_groups)


__all__ = ["PipeProgram", "build_pipe_program", "routed", "split_model"]
