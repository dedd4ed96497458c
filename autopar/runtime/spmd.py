"""Run the per-op (SPMD) program of a one-stage plan: the per-rank graphs its placements applied.

Where it sits: runtime, for programs without pipeline stages (pp = 1). The per-rank build
(autopar/build/one_stage.py) traces the model's training step at the global microbatch,
applies the per-op placements every rank was given (codegen/apply.py) and hands the
per-rank graphs here, with the parameters already DTensors in their weight-update
placements (`distribute_parameters`: in the model's own modules, so `named_parameters()`,
checkpoints and `full_tensor()` see them). `SpmdProgram` steps them with a stock
`torch.optim` optimizer. Where a parameter's update placement differs from its compute
placement (weight-update sharding: ZeRO-1/2), the program also holds its compute copy,
gathered from the update shard once per step after the optimizer step (the `param_gather`
graph), which every microbatch reads.

A step: the global batch is cut into m microbatches of dp * micro_batch rows; for each,
this rank's input shards are taken per the plan's input placements, the per-rank graph
runs (no autograd: the graph is the joint forward+backward) with the loss tangent 1/m,
and the raw gradients accumulate locally; after the last one, the gradient-sync graph
brings each gradient to its parameter's placement once (all-reduce / reduce-scatter) and
the optimizer steps. With one microbatch per step the step graph syncs each gradient
bucket itself, during the backward (codegen/apply.py `sync_in_step`), and there is no
gradient-sync graph to run. The loss is reduced for reporting after the step graphs, a
scalar all-reduce per mesh axis where it is Partial (`global_loss`), priced once per step
(cost_model.loss_report_time_s, solver/spmd_search.py `estimate`).
"""

from __future__ import annotations

import functools
import gc
import inspect
import logging
import resource
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.profiler import record_function

from autopar.batch import batch_size, rows as batch_rows, tensors as tensor_leaves
from autopar import dtensor_bridge as bridge
from autopar.config import ParallelConfig
from autopar.ir import Graph, Role
from autopar.placement import Partial, Placements, Shard, shard_factor
from autopar.runtime.program import StepStats, gradient_for, init_mesh, optimizer_update
from autopar.sharding import NodeStrategy

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


def accumulate(raw: list[torch.Tensor] | None, grads: Sequence[torch.Tensor],
               keep: frozenset[int] = frozenset(), dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """The raw gradients of a step's microbatches summed so far: the first microbatch's
    outputs, then every later one added into them in place (read both, write one: the
    traffic `cost_model.grad_accumulation_time_s` prices; `a + b` also allocated and
    page-faulted a fresh tensor per gradient per microbatch, measured 42 ms of a 254 ms
    step of the sweep's L model at 4 microbatches on one rank, 1.9 ms in place at one).
    A gradient is added out of place where writing into it is not safe: it shares storage
    with another gradient or with `keep` (storages of the program's own inputs: parameters,
    buffers), or it is not dense (an expanded zero, a strided view).

    `dtype`: the precision policy's reduction dtype, which the sums are kept in (the first
    microbatch's floating-point gradients cast to it; later ones added into them), so a
    bf16-mixed step accumulates its microbatches in float32, as Megatron-LM's main grads do."""
    if raw is None:
        return [g.to(dtype) if dtype is not None and g.is_floating_point() else g for g in grads]
    storages = [a.untyped_storage().data_ptr() for a in raw]
    shared = {p for p in storages if storages.count(p) > 1} | keep
    return [a.add_(b) if p not in shared and a.is_contiguous() and a.shape == b.shape
            and torch.promote_types(a.dtype, b.dtype) == a.dtype
            else a + b for a, b, p in zip(raw, grads, storages)]


def _priced_state_bytes(graph: Graph, choices: Sequence[NodeStrategy], mesh_shape: tuple[int, ...],
                        grads_at_update: bool) -> tuple[float, float, float]:
    """SpmdProgram.priced_state_bytes of `graph`'s parameters under `choices`: each raw
    gradient in its gradient node's placement, as the step accumulates it (cost_model
    `raw_gradient_state_bytes`), but where the step syncs them in its backward
    (`grads_at_update`), which holds the synced ones in the update placement."""
    aliases = {alias for alias, _ in graph.tied_params}
    precision = graph.model.precision
    parts = [0.0, 0.0, 0.0]
    for node in graph.by_role(Role.PARAMETER):
        if node.id in aliases:
            continue
        c = choices[node.id]
        got = precision.state_bytes(node.output.numel, shard_factor(c.outputs[0], mesh_shape),
                                    shard_factor(c.update_placements, mesh_shape), grads_at_update=grads_at_update)
        for k in range(3) if grads_at_update else (0, 2):
            parts[k] += got[k]
    if not grads_at_update:
        parts[1] = sum(precision.raw_gradient_bytes(graph[g].output.numel, shard_factor(choices[g].outputs[0], mesh_shape))
                       for _, g in graph.param_grads)
    return parts[0], parts[1], parts[2]


def local_shard(t: torch.Tensor, placements: Placements, coords: Sequence[int], mesh_shape: Sequence[int]) -> torch.Tensor:
    """This rank's piece of a whole tensor `t` laid out as `placements` (no communication)."""
    out = t
    for p, c, n in zip(placements, coords, mesh_shape):
        if isinstance(p, Shard) and n > 1:
            out = out.chunk(n, dim=p.dim)[c]
    return out if out.is_contiguous() else out.contiguous()


def owned(t: torch.Tensor) -> torch.Tensor:
    """`t`, in storage of its own where it views a larger one: a dim-0 shard of a whole
    tensor is such a view, and state held for the program's life (parameters, buffers)
    would otherwise keep the whole tensor resident on every rank (ZeRO and TP would save
    no memory)."""
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


class SpmdProgram:
    """One rank's share of a per-op plan. Built by autopar/build/one_stage.py `build_spmd_program`."""

    def __init__(self, *, config: ParallelConfig, mesh: DeviceMesh, model: nn.Module, graphs: Any,
                 graph: Graph, optimizer_factory: OptimizerFactory, choices: Sequence[NodeStrategy],
                 params: dict[str, nn.Parameter], priced: dict[tuple[str, str], tuple[int, int]] | None = None,
                 grads_at_update: bool = False, collective_counts: "CollectiveCounts" = ()) -> None:
        self.config = config
        self.collective_counts = collective_counts
        """The collectives of the graphs this program runs, counted by the build."""
        self.grads_at_update = grads_at_update
        """The step syncs the gradients in its backward (one microbatch, or ZeRO-2: every
        microbatch, the shards accumulating): it holds the synced ones, not the raw (as priced)."""
        self.priced = priced
        """What the plan priced per step: {(kind, mesh axis name): (calls, bytes)}."""
        self.mesh = mesh
        self.model = model
        self.graphs = graphs
        self.coords = tuple(mesh.get_coordinate())
        self.mesh_shape = tuple(mesh.shape)
        self._priced_state = _priced_state_bytes(graph, choices, self.mesh_shape, grads_at_update)
        """`priced_state_bytes`, taken from the lowered graph and its placements here: the
        program holds neither (their nodes, strategies and placements were about a third of
        the Python objects a built fsdp4 program kept resident on the benchmark Llama)."""
        self.rules = None
        self.tied_fqns: tuple[str, ...] = ()
        self.chunks = [model]
        self.steps_done = 0
        self.last_stats: Any = None
        self.pp_rank = 0
        self.dp_rank = self.coords[0]
        self.tp_rank = self.coords[1] if len(self.coords) > 1 else 0
        self._params = params
        """From `distribute_parameters` (before the graphs were applied): the master weights."""
        policy = graph.model.precision
        self.compute_dtype = getattr(torch, policy.compute) if policy.mixed else None
        """Where the precision policy computes in another dtype than it keeps the master
        weights in, that dtype: every parameter's compute copy is cast to it."""
        self.reduce_dtype = getattr(torch, policy.reduce)
        """The dtype raw gradients are accumulated in over a step's microbatches."""
        self.local_buffers = self._buffer_shards()
        """This rank's shard of each buffer the step graph reads, by name (written back
        after every microbatch where the forward updates it)."""
        self.optimizer = make_optimizer(optimizer_factory, list(self._params.values()))
        self._compute: dict[str, torch.Tensor] = {}
        """Compute-placement copies of the parameters updated in another placement."""
        self.gather_weights()

    # -- state ------------------------------------------------------------------------

    @property
    def input_storages(self) -> frozenset[int]:
        """Storages the step graph reads and gradients must never be added into."""
        return frozenset(t.untyped_storage().data_ptr() for t in
                         [p._local_tensor for p in self._params.values()] + list(self.local_buffers.values())
                         + list(self._compute.values()))

    def _buffer_shards(self) -> dict[str, torch.Tensor]:
        buffers = dict(self.model.named_buffers())
        return {s.name: owned(local_shard(buffers[s.name], s.placements, self.coords, self.mesh_shape))
                for s in self.graphs.slots if s.role is Role.BUFFER}

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self._params.items())

    def compute_weight(self, name: str) -> torch.Tensor:
        """This rank's local weight of parameter `name` in its compute placement (what the
        step graph reads): the gathered copy where its update runs in another placement."""
        local = self._compute.get(name)
        return self._params[name]._local_tensor if local is None else local

    def compute_copy_bytes(self) -> int:
        """Bytes of this rank's compute copies (the parameters updated in another placement
        or dtype, gathered for the step graph), beside the master shards."""
        return sum(t.numel() * t.element_size() for t in self._compute.values())

    def compile_times(self) -> dict[str, float]:
        """{graph: seconds Inductor spent compiling it} (`--compile`; its first call)."""
        return dict(self.graphs.compile_times.seconds)

    def gather_weights(self) -> None:
        """The compute copies of the parameters updated in another placement or dtype, from
        their master weights (the `param_gather` graph: all-gathers, in the compute dtype;
        collective, every rank)."""
        self._compute = gathered_weights(self.graphs, self._params, self.compute_dtype)

    # -- the step ---------------------------------------------------------------------

    def _inputs(self, microbatch: Sequence[torch.Tensor], tangent: float) -> list[torch.Tensor]:
        values: list[torch.Tensor] = []
        data = iter(microbatch)
        for slot in self.graphs.slots:
            if slot.role is Role.PARAMETER:
                values.append(self.compute_weight(slot.name))
            elif slot.role is Role.BUFFER:
                values.append(self.local_buffers[slot.name])
            elif slot.role is Role.TANGENT:
                values.append(torch.full((), tangent, dtype=getattr(torch, slot.dtype)))
            else:
                x = next(data)
                if tuple(x.shape) != slot.shape:
                    raise ValueError(f"input {slot.name} has shape {tuple(x.shape)} but the program was compiled "
                                     f"for {slot.shape}; feed batches of the compiled shape")
                if x.is_floating_point() and str(x.dtype).removeprefix("torch.") != slot.dtype:
                    x = x.to(getattr(torch, slot.dtype))  # the precision policy's compute dtype
                values.append(local_shard(x, slot.placements, self.coords, self.mesh_shape))
        return values

    def step(self, batch: Sequence[torch.Tensor]) -> float:
        """One optimizer step on the global `batch` (identical on every rank); returns the
        mean loss over the whole batch, on every rank."""
        rows = self.config.dp * self.config.micro_batch
        size = batch_size(batch)
        if size % rows:
            raise ValueError(f"batch of {size} sequences does not split into microbatches of dp * micro-batch = "
                             f"{self.config.dp} * {self.config.micro_batch}; use a multiple of {rows}")
        m = size // rows
        raw: list[torch.Tensor] | None = None
        loss_sum = torch.zeros(())
        # the step's phases, named in profiler traces (torch.profiler; benchmarks/explain_gap.py)
        with torch.no_grad():
            for i in range(m):
                with record_function("autopar::microbatch"):
                    micro = tensor_leaves(batch_rows(batch, i * rows, (i + 1) * rows, size))
                    outs = self.graphs.step(*self._inputs(micro, 1.0 / m))
                    loss_sum += outs[0].detach().float()
                    updated = len(self.graphs.buffer_updates)
                    grads = list(outs[1:len(outs) - updated])
                    self._write_buffers(outs[len(outs) - updated:])
                with record_function("autopar::accumulate"):
                    raw = accumulate(raw, grads, self.input_storages, self.reduce_dtype)
            grads, outs = None, None
            with record_function("autopar::grad_sync"):
                grad_bytes = self.set_gradients(raw)  # empties `raw`
            raw = None
        with record_function("autopar::loss_report"):
            loss = self.global_loss(loss_sum / m)

        with record_function("autopar::optimizer"):
            optimizer_update(self, loss)
        with record_function("autopar::gather_weights"):
            self.gather_weights()
        self.last_stats = self._stats(grad_bytes)
        return loss

    def _write_buffers(self, values: Sequence[torch.Tensor]) -> None:
        """The forward's in-place buffer updates (BatchNorm's running statistics), each
        already in its buffer's placement: written into this rank's shard after every
        microbatch, as a single process running the same microbatches updates them."""
        for name, value in zip(self.graphs.buffer_updates, values):
            self.local_buffers[name].copy_(value)

    def named_buffers(self) -> list[tuple[str, DTensor]]:
        """The buffers the forward updates, as DTensors over this rank's shards (the same
        storage: a checkpoint load writes into them)."""
        placements = {s.name: s.placements for s in self.graphs.slots if s.role is Role.BUFFER}
        return [(name, DTensor.from_local(self.local_buffers[name], self.mesh,
                                          bridge.to_dtensor_placements(placements[name]), run_check=False))
                for name in self.graphs.buffer_updates]

    def full_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers the forward updates, whole (collective where one is sharded)."""
        return {name: b.full_tensor() for name, b in self.named_buffers()}

    def set_gradients(self, raw: list[torch.Tensor]) -> int:
        """Bring the raw gradients accumulated over a step's microbatches (outputs of the
        step graph, in order; the list is emptied) to their parameters' placements with the
        gradient-sync graph, and set them as the parameters' `.grad`; returns their bytes.
        Shared with the per-op pipeline stages (autopar/runtime/pipe_spmd.py)."""
        with torch.no_grad():
            names = [name for name, _, _ in self.graphs.grads]
            if self.graphs.grad_sync is None:  # the step synced each bucket during its backward
                # (compiled for one microbatch per step; a larger batch fed later is still
                # right, reductions being linear, but syncs every microbatch)
                synced = raw
            else:
                synced = self.graphs.grad_sync(raw)  # boxed call: the graph empties the list as it goes
        by_name = dict(zip(names, synced))
        grad_bytes = 0
        for name, param in self._params.items():
            g = by_name[name]
            grad_bytes += g.numel() * g.element_size()
            if g.dtype != param.dtype:  # reduced in another dtype than the master weights'
                g = g.to(param.dtype)
            param.grad = gradient_for(param, g)
        return grad_bytes

    def global_loss(self, local: torch.Tensor) -> float:
        """The step's loss on every rank: one scalar all-reduce over each mesh axis where the
        ILP left the loss Partial (priced: cost_model.loss_report_time_s), issued on the
        axis's process group directly, not through DTensor (`from_local(...).full_tensor()`):
        there the same reduction measured 3.5 / 1.3 ms over 8 / 4 gloo ranks on 2 cores
        against 2.2 / 0.9 ms for the all-reduce alone, since its redistribution planning is
        host work every rank pays while the ranks share the cores."""
        value = local.detach().float().reshape(()).clone()
        for axis, p in enumerate(self.graphs.loss_placements):
            if isinstance(p, Partial) and self.mesh.size(axis) > 1:
                dist.all_reduce(value, group=self.mesh.get_group(axis))  # gloo has no AVG: sum, then divide
                if p.reduce_op == "avg":
                    value /= self.mesh.size(axis)
        return float(value)

    def _stats(self, grad_bytes: int) -> Any:
        state_bytes = sum(v._local_tensor.numel() * v._local_tensor.element_size() if isinstance(v, DTensor)
                          else v.numel() * v.element_size()
                          for s in self.optimizer.state.values() for v in s.values()
                          if isinstance(v, torch.Tensor) and v.dim() > 0)
        return StepStats(parameter_bytes=sum(p._local_tensor.numel() * p._local_tensor.element_size()
                                             for p in self._params.values())
                         + self.compute_copy_bytes(),
                         gradient_bytes=grad_bytes, optimizer_state_bytes=state_bytes,
                         peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    # -- inspection and state -----------------------------------------------------------

    def priced_state_bytes(self) -> tuple[float, float, float]:
        """(weights, gradients, optimizer state) bytes this rank's parameters are priced at:
        the graph's precision policy's `state_bytes` (what cost_model.parameter_state_bytes
        charges in the ILP's memory rows) at each parameter's compute and update placements,
        a tied alias counted once. The weights and optimizer state are what `last_stats` measures from the
        master weights, the compute copies and the optimizer's tensors; the gradients are the
        raw ones accumulated over the microbatches (`last_stats` counts them once synced)."""
        return self._priced_state

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Unsharded copies of the parameters (collective: call on every rank)."""
        return {name: p.full_tensor().detach().clone() for name, p in self._params.items()}

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (  # lazy: torch.distributed.checkpoint, only to save or load
            get_model_state_dict, get_optimizer_state_dict)

        return {"model": get_model_state_dict(self.model),
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (  # lazy: torch.distributed.checkpoint, only to save or load
            set_model_state_dict, set_optimizer_state_dict)

        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.gather_weights()

    @property
    def code(self) -> str:
        return self.graphs.source

    def collectives_per_step(self, num_microbatches: int) -> dict[tuple[str, str], tuple[int, int]]:
        """The collectives this rank's program runs per step, from its graphs: {(kind, mesh
        axis name): (calls, bytes)}, the step graph m times, the gradient sync and the
        gather of updated weights once (`collective_counts`, counted by the build)."""
        return collectives_by_axis(self.collective_counts, num_microbatches, self.mesh)


CollectiveCounts = tuple[tuple[bool, dict[tuple[str, str], list[int]]], ...]
"""The collectives of a program's graphs as the build counted them (codegen/apply.py
`count_collectives`, before `release_build_memory`): per graph, (whether it runs once per
microbatch, {(kind, process group name): [bytes per call, ...]})."""


def collectives_by_axis(counted: CollectiveCounts, num_microbatches: int, mesh: DeviceMesh
                        ) -> dict[tuple[str, str], tuple[int, int]]:
    """{(kind, mesh axis name): (calls, bytes)} per step of `counted` on `mesh`: a graph run
    per microbatch `num_microbatches` times, the others once. Groups are told apart by
    their member ranks: DTensor may reuse an equal earlier mesh's groups (its caches key
    meshes by value), so group names alone need not be this mesh's."""
    axis_of = {tuple(dist.get_process_group_ranks(mesh.get_group(i))): name
               for i, name in enumerate(mesh.mesh_dim_names)}
    out: dict[tuple[str, str], list[int]] = {}
    for per_microbatch, counts in counted:
        times = num_microbatches if per_microbatch else 1
        for (kind, group), sizes in counts.items():
            ranks = tuple(dist.get_process_group_ranks(_resolve_process_group(group)))
            entry = out.setdefault((kind, axis_of[ranks]), [0, 0])
            entry[0] += times * len(sizes)
            entry[1] += times * sum(sizes)
    return {k: (v[0], v[1]) for k, v in out.items()}


def gathered_weights(graphs: Any, params: dict[str, nn.Parameter],
                     dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """{name: compute-placement local weight} of the parameters `graphs` updates in another
    placement, gathered from their update shards by the `param_gather` graph. With `dtype`
    (a mixed precision policy's compute dtype), every parameter's: each master shard is
    cast first, so the gathers move compute-dtype bytes (FSDP2's `param_dtype` all-gather),
    and one updated in its compute placement is its cast alone."""
    with torch.no_grad():
        local = {name: p._local_tensor if dtype is None else p._local_tensor.to(dtype) for name, p in params.items()}
        out: dict[str, torch.Tensor] = {}
        if graphs.param_gather is not None:
            gathered = graphs.param_gather(*[local[name] for name, _, _ in graphs.gathered])
            out = dict(zip((name for name, _, _ in graphs.gathered), gathered))
    if dtype is not None:
        out.update((name, t) for name, t in local.items() if name not in out)
    return out


def master_weights(model: nn.Module, precision: Any) -> dict[int, torch.Tensor]:
    """{id(parameter): its master weight} where the precision policy keeps the master
    weights in another dtype than it computes in (bf16-mixed: float32), taken before the
    model is cast to the compute dtype (autopar.trace.to_compute_dtype swaps the
    parameters' data but keeps the parameter objects, which a pipeline's chunks share, so
    these keep the original values by parameter); {} otherwise (the cast parameters are the
    master weights)."""
    if not precision.mixed:
        return {}
    dtype = getattr(torch, precision.master)
    return {id(p): p.detach().to(dtype) for p in model.parameters() if p.is_floating_point()}


def distribute_parameters(model: nn.Module, graph: Graph, choices: Sequence[NodeStrategy],
                          mesh: DeviceMesh, masters: dict[int, torch.Tensor] | None = None) -> dict[str, nn.Parameter]:
    """Replace each parameter the graph uses by a DTensor parameter in its chosen
    weight-update placement (tied names share one), inside the model's own modules;
    {name: parameter}. `masters` (`master_weights`): the values to hold instead of the
    (compute-dtype) parameters, by parameter.

    Called as soon as the placements are known, before the per-rank graphs are built:
    the whole parameters are freed here, so building (make_fx of the whole step, the
    build's peak) does not hold them beside its own objects (ZeRO-3 dp4 on the benchmark
    Llama: 11.6 MiB of whole parameters, 2.9 MiB of shards per rank)."""
    placements = {graph[n].param_name: choices[n].update_placements for n in range(len(graph))
                  if graph[n].role is Role.PARAMETER}
    made: dict[int, nn.Parameter] = {}
    out: dict[str, nn.Parameter] = {}
    for fqn, param in list(model.named_parameters(remove_duplicate=False)):
        if id(param) not in made:
            if fqn not in placements:
                raise ValueError(f"parameter {fqn} is not in the traced graph (unused in the loss?); "
                                 "every trained parameter must reach the loss")
            value = masters[id(param)] if masters and id(param) in masters else param.detach()
            d = distribute_tensor(value, mesh, bridge.to_dtensor_placements(placements[fqn]), src_data_rank=None)
            local = owned(d._local_tensor)
            if local is not d._local_tensor:
                d = DTensor.from_local(local, mesh, d.placements, run_check=False, shape=d.shape, stride=d.stride())
            made[id(param)] = nn.Parameter(d, requires_grad=param.requires_grad)
            out[fqn] = made[id(param)]
        module_name, _, leaf = fqn.rpartition(".")
        setattr(model.get_submodule(module_name), leaf, made[id(param)])
    return out


def release_build_memory(*modules: fx.GraphModule | None) -> None:
    """Give back what building held and running does not need, before the first step:
    `modules` are the per-rank graphs a program keeps (None: a graph it has not).

    The per-rank graphs carry, on every node, the fake value and shape metadata make_fx
    recorded (about 2,700 fake tensors for the benchmark Llama); running needs none of
    it. Read afterwards, and kept: the values of collective nodes and their inputs
    (codegen/collectives.py `count_collectives`: price = run) and the collectives' "custom" tags
    (a pipeline chunk's boundary reshards, which its ILP does not price, are told apart by
    them: pipe_spmd `collectives_per_step`). FakeTensorMode's class-wide dispatch cache keeps an
    entry per traced op signature. Then collect: on the benchmark Llama (zero3 dp4) the
    graphs' metadata alone was about 9 MiB of Python objects per rank.

    The freed heap stays with the process (no `malloc_trim`): the first step allocates
    about as much again (optimizer state, small shards, the step's Python objects) and
    reuses it. Handing it back to the OS lowered the resident set between build and
    first step but not the peak, which the step then reached by faulting the same pages
    in again. zero3 dp4's peak per rank over the template's, with the trim / without:
    1.16 / 1.11-1.12 in full benchmark runs, 1.09-1.12 / 1.04-1.05 in its memory phase
    alone."""
    for gm in modules:
        if gm is None:
            continue
        collectives = [node for node in gm.graph.nodes
                       if node.op == "call_function" and str(node.target).startswith("_c10d_functional.")]
        keep = {"val": {*collectives, *(node.args[0] for node in collectives)}, "custom": set(collectives)}
        for node in gm.graph.nodes:
            node.meta = {key: node.meta[key] for key, nodes in keep.items() if node in nodes and key in node.meta}
    FakeTensorMode.cache_clear()
    gc.collect()


def run_policy(config: ParallelConfig, device_type: str = "cpu") -> Any:
    """The precision policy (autopar.precision.Precision) a program of `config` runs on
    devices of `device_type`: the configuration's, else that hardware's default (fp32 on
    CPU, bf16-mixed on accelerators). A searched plan names its policy."""
    return config.policy("cpu" if device_type == "cpu" else device_type)


def make_spmd_mesh(config: ParallelConfig, device_type: str | None = None) -> DeviceMesh:
    """The (dp, tp) mesh of a pp = 1 plan over the whole world, with the job's timeout."""
    world = dist.get_world_size()
    if config.dp * config.tp != world:
        raise ValueError(f"dp * tp = {config.dp} * {config.tp} = {config.dp * config.tp} but the process group "
                         f"has {world} ranks; choose degrees whose product is {world}")
    return init_mesh((config.dp, config.tp), ("dp", "tp"), device_type)


def make_optimizer(factory: OptimizerFactory, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """`factory(params)`, with the fused implementation (else the multi-tensor one) where the
    factory is a torch.optim class, or a partial of one, that takes `fused` / `foreach` and
    the user set neither. torch picks those by default on GPUs only; on DTensor parameters
    the per-tensor loop pays DTensor's dispatch for every op of every parameter (AdamW's step
    4x slower on CPU than fused) and the multi-tensor one allocates a parameter-sized
    temporary. The update is the same; a user's explicit choice is kept."""
    cls, given = (factory.func, factory.keywords) if isinstance(factory, functools.partial) else (factory, {})
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and not {"foreach", "fused"} & set(given):
        accepted = inspect.signature(cls.__init__).parameters
        for option in ("fused", "foreach"):
            if option == "fused" and not _dtensor_fused(cls):
                continue
            if option in accepted:
                try:
                    return factory(params, **{option: True})
                except (RuntimeError, ValueError):  # not supported for this device or dtype
                    continue
    return factory(params)


def _dtensor_fused(cls: type) -> bool:
    """Whether DTensor has a sharding rule for `cls`'s fused kernel (torch 2.13: Adam and
    AdamW; not SGD or Adagrad), so `fused=True` runs on DTensor parameters."""
    op = getattr(torch.ops.aten, f"_fused_{cls.__name__.lower()}_", None)
    if op is None:
        return False
    prop = bridge.PROPAGATOR
    return any(o in prop.op_strategy_funcs or o in prop.op_single_dim_strategy_funcs
               for o in (getattr(op, name) for name in op.overloads()))


