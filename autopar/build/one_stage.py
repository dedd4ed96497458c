"""A rank's one-stage (pp = 1) program: its training step traced, the per-op placements applied.

Where it sits: the per-rank build (autopar/build/), for pp = 1 programs. On every rank:
1. trace the model's training step (forward + backward + loss) on fake tensors at the
   global microbatch the program runs (dp * micro_batch sequences), and lower it
   (`trace_microbatch`: the one trace the launcher's checks and the wiring's solve,
   autopar/placing.py, make too);
2. take each op's placements from the ProgramPlacements every rank was given (a plan's,
   or the intra-op ILP's for a configuration, solved once before any rank started),
   matched by node key; no rank solves;
3. hold the parameters as DTensors in their weight-update placements and apply the
   placements (codegen/apply.py): the per-rank graphs of ATen ops and collectives that
   autopar/runtime/spmd.py `SpmdProgram` runs.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.batch import batch_size, rows as batch_rows
from autopar.config import ParallelConfig
from autopar.plan import ProgramPlacements
from autopar.runtime.program import OptimizerFactory
from autopar.runtime.spmd import (SpmdProgram, distribute_parameters, make_spmd_mesh, master_weights,
                                  release_build_memory, run_policy)
from autopar.trace import to_compute_dtype, trace_step
from codegen.apply import apply, count_collectives
from codegen.prefetch import prefetch_program

log = logging.getLogger(__name__)


def trace_microbatch(model: nn.Module, config: ParallelConfig, example: Sequence[Any], *,
                     loss_fn: Callable[..., torch.Tensor] | None = None, device_type: str = "cpu",
                     memo: TraceMemo | None = None) -> tuple[Any, Any]:
    """(traced joint graph, lowered Graph) of `model`'s training step on the first global
    microbatch (dp * micro_batch rows) of `example` (one global batch), in the precision
    policy `config` runs on `device_type`, priced as it runs (compiled or not). The model
    is cast to the policy's compute dtype in place (pass a copy to keep it). `memo`: the
    trace of the last call, taken again where this call would trace the same step."""
    rows = config.dp * config.micro_batch
    micro = batch_rows(example, 0, rows, batch_size(example))
    policy = run_policy(config, device_type)
    key = (rows, config.recompute, policy, tuple(type(m) for m in model.modules()))  # fused modules swapped in or not
    if memo is not None and memo.key == key:
        to_compute_dtype(model, micro, policy.compute)  # the cast trace_step makes, without the trace
        traced, graph = memo.traced, memo.graph
    else:
        traced, graph = trace_step(model, micro, loss_fn=loss_fn, recompute=config.recompute, precision=policy)
    if memo is not None:
        memo.keep(key, traced, graph)
    return traced, replace(graph, compiled=config.compiled)  # priced as it runs (cost_model/table.py compiled_scale)


@dataclass(slots=True)
class TraceMemo:
    """The last step one rank traced for one job (autopar/build `train_worker`): the
    configurations of a job train one model on one batch, so those that trace the same
    global microbatch rows under the same recomputation and precision policy, with the same
    module classes (codegen/kernels' fused modules swapped in or not), such as the ZeRO
    stages of one data-parallel degree or a configuration and its compiled twin, trace the
    same joint graph, node for node; the next one takes it instead of tracing again
    (about a third of a small model's build). One entry, and none after the job's last
    build: no trace outlives the build that follows it, and a job of one configuration
    holds none while it trains (its memory phases stay the program's own)."""

    builds_left: int
    """The job's builds after the one under way (autopar/build `build_program` counts them)."""
    key: tuple = ()
    traced: Any = None
    graph: Any = None

    def keep(self, key: tuple, traced: Any, graph: Any) -> None:
        """Hold this build's trace for the next build, or nothing after the last."""
        self.key, self.traced, self.graph = (key, traced, graph) if self.builds_left > 0 else ((), None, None)


def build_spmd_program(model: nn.Module, placed: ProgramPlacements, example: Sequence[Any], *,
                       loss_fn: Callable[..., torch.Tensor] | None = None, optimizer: OptimizerFactory,
                       mesh: DeviceMesh | None = None, memo: TraceMemo | None = None) -> SpmdProgram:
    """Compile `model` for this rank with `placed`'s per-op placements (pp = 1); collective.

    `example` is one global batch (its first dp * micro_batch rows are traced). The
    placements are matched to this rank's trace by node key (PlanFileError where they do
    not match). `memo`: see `trace_microbatch`."""
    config = placed.config
    if config.pp != 1:
        raise ValueError("build_spmd_program runs pp = 1 programs; pipelines use autopar.build.build_program")
    rows = config.dp * config.micro_batch
    mesh = mesh if mesh is not None else make_spmd_mesh(config)
    masters = master_weights(model, run_policy(config, mesh.device_type))  # before the model is cast
    traced, graph = trace_microbatch(model, config, example, loss_fn=loss_fn, device_type=mesh.device_type,
                                     memo=memo)
    # the joint graph's metadata (a fake value per node, lowering's input) is read by nothing
    # after lowering (apply runs the nodes' ops on DTensors): dropped before apply builds the
    # per-rank graph beside it, it is not part of the build's peak
    for node in traced.gm.graph.nodes:
        node.meta = {}
    num_microbatches = max(1, batch_size(example) // rows)
    choices = placed.choices_for(graph)
    priced = None if placed.collectives is None else \
        {(kind, axis): (calls, nbytes) for kind, axis, calls, nbytes in placed.collectives}
    zero2 = placed.grads_each_microbatch
    # one microbatch: nothing to accumulate, so the step reduces each gradient bucket as soon
    # as its last gradient is computed (raw gradients freed during the backward).
    # ZeRO-2 (a solution that syncs the gradients every microbatch: forced.solve_one_stage
    # for zero 2) syncs in the step whatever the microbatches: each microbatch's gradients
    # are reduce-scattered as the backward leaves them and the shards accumulate
    sync_in_step = num_microbatches == 1 or zero2
    params = distribute_parameters(model, graph, choices, mesh, masters)
    del masters
    graphs = apply(traced.gm, graph, choices, mesh, sync_in_step=sync_in_step, compiled=config.compiled)
    prefetch_program(graphs)  # the weights' collectives issued ahead, as priced (overlap_rows.py)
    del traced
    log.info("rank %d: per-op program on mesh %s, %d graph nodes, %d collectives in the step",
             dist.get_rank(), tuple(mesh.shape), len(graphs.step.graph.nodes),
             sum(1 for n in graphs.step.graph.nodes if str(n.target).startswith("_c10d_functional.")
                 and "wait" not in str(n.target)))
    # counted before their metadata goes (price = run: collectives_per_step)
    counted = tuple((per_microbatch, count_collectives(gm)) for gm, per_microbatch in (
        (graphs.step, True), (graphs.grad_sync, False), (graphs.param_gather, False)) if gm is not None)
    program = SpmdProgram(config=config, mesh=mesh, model=model, graphs=graphs, graph=graph,
                          optimizer_factory=optimizer, choices=choices, params=params, priced=priced,
                          grads_at_update=sync_in_step, collective_counts=counted)
    # after the whole parameters were replaced by their shards
    release_build_memory(graphs.step, graphs.grad_sync, graphs.param_gather)
    return program


def check_plan_placements(model: nn.Module, placed: ProgramPlacements, example: Sequence[Any], *,
                          loss_fn: Callable[..., torch.Tensor] | None = None) -> None:
    """Raise PlanFileError where `placed`'s per-op placements do not match `model`'s traced
    step at the program's microbatch (node keys and ops): what every rank would find when
    it builds, found once, with no process group, before any rank starts (the launcher
    calls this)."""
    placed.choices_for(trace_microbatch(copy.deepcopy(model), placed.config, example, loss_fn=loss_fn)[1])
