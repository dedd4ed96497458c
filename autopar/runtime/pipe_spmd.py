"""Per-op pipeline stages: running the intra-op ILP's placements inside every stage of a pipeline.

Where it sits: runtime. The per-rank build (autopar/build/pipeline.py) cuts the model into
its chunks, traces each chunk's joint forward+backward graph, applies the chunk's per-op
placements (decided before any rank started: a plan's, or the ILP's for a configuration,
autopar/placing.py) and splits the applied graph into a forward graph (every node that does
not depend on a tangent) and a backward graph (the rest; it reads the forward values it
needs, which the forward returns: AOTAutograd's default partition). This module runs them:
each chunk's pair, wrapped in an autograd Function (`PerOpStage`), is what
torch.distributed.pipelining's PipelineStage and schedules run: forward, send the outputs,
later backward with the received gradients.

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
import resource
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar import dtensor_bridge as bridge
from autopar.config import ParallelConfig
from autopar.ir import Role
from autopar.runtime.pipe import output_is_loss
from autopar.runtime.program import StepStats, local_tensor, chunks_state_dict, load_chunks_state_dict, optimizer_update
from autopar.runtime.spmd import accumulate, collectives_by_axis, local_shard

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


# ---------------------------------------------------------------------------------------
# boundary values


# ---------------------------------------------------------------------------------------
# the per-rank stage graphs


class StageRunner:
    """One chunk's per-rank program: forward and backward graphs, the parameters (an
    SpmdProgram holds them as DTensors), and the raw gradients accumulated over a step."""

    def __init__(self, *, index: int, program: Any, forward: fx.GraphModule, backward: fx.GraphModule,
                 num_saved: int, slots: Sequence[Any], num_inputs: int, grad_inputs: tuple[int, ...],
                 outputs: tuple[int, ...], grad_outputs: tuple[int, ...], last: bool,
                 collective_counts: dict[bool, Any] | None = None,
                 accumulators: Sequence[tuple[tuple[int, ...], torch.dtype, torch.device] | None] | None = None
                 ) -> None:
        self.index = index
        self.accumulators = None if accumulators is None else tuple(accumulators)
        """(shape, dtype, device) of each raw gradient's sum where the backward graph adds
        its gradients into them itself (autopar/build/pipeline.py `accumulate_in_graph`),
        else None (the runner sums what the graph returns)."""
        self.collective_counts: dict[bool, Any] = collective_counts or {False: (), True: ()}
        """{boundary: CollectiveCounts (autopar/runtime/spmd.py)} of this chunk's forward, backward,
        gradient-sync and weight-gather graphs, counted by the build: the collectives the
        chunk's ILP priced (False) and the boundary reshards it does not price (True)."""
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
                values.append(program.local_buffers[slot.name])
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
        if self.accumulators is not None:  # the step's sums, zero at its first microbatch
            if self.raw is None:
                self.raw = [None if spec is None else torch.zeros(spec[0], dtype=spec[1], device=spec[2])
                            for spec in self.accumulators]
            args.extend(a for a in self.raw if a is not None)
        outs = list(self.backward_gm(args))
        num_params = len(self.program.graphs.grads)
        raw, input_grads = outs[:num_params], outs[num_params:]

        if self.accumulators is None:
            self.raw = accumulate(self.raw, raw, self.program.input_storages, self.program.reduce_dtype)
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


# ---------------------------------------------------------------------------------------
# the program


class PipeSpmdProgram:
    """One rank's share of a pipeline whose stages are per-op programs. Build with
    `autopar.build.pipeline.build_pipe_spmd_program`."""

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
        """True when the chunks' placements came from a plan, False when they were solved for
        the configuration before the ranks started (autopar/placing.py); no rank solves."""
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
        from torch.distributed.pipelining.schedules import (  # lazy: torch.distributed.pipelining, only for pp > 1
            Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B)

        if num_mb not in self._schedules:
            kind = self.config.schedule
            if kind == "interleaved":
                self._schedules[num_mb] = ScheduleInterleaved1F1B(self.stages, n_microbatches=num_mb,
                                                                  loss_fn=output_is_loss, scale_grads=False)
            else:
                # as autopar/runtime/pipe.py: 1F1B needs as many microbatches as stages
                cls = Schedule1F1B if kind == "1f1b" and num_mb >= self.config.pp else ScheduleGPipe
                self._schedules[num_mb] = cls(self.stages[0], n_microbatches=num_mb, loss_fn=output_is_loss,
                                              scale_grads=False)
        return self._schedules[num_mb]

    def step(self, batch: Sequence[torch.Tensor]) -> float:
        """One optimizer step on the global `batch` (identical on every rank); returns the
        mean loss over the whole batch, on every rank."""
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
            whole = self.runners[-1].program.global_loss(local)
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
        params = [p for _, p in self.named_parameters()]
        state_bytes = sum(local_tensor(v).numel() * local_tensor(v).element_size()
                          for s in self.optimizer.state.values()
                          for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return StepStats(parameter_bytes=sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in params)
                         + sum(r.program.compute_copy_bytes() for r in self.runners),
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
        price (an output or input gradient brought to the layout the stages exchange,
        tagged so in the graphs). Counted by the build (`StageRunner.collective_counts`)."""
        counted = tuple(c for r in self.runners for c in r.collective_counts[boundary])
        return collectives_by_axis(counted, num_microbatches, self.submesh)

    def state_dict(self) -> dict[str, Any]:
        """Sharded model and optimizer state (the chunks hold the DTensor parameters under
        the model's names)."""
        return chunks_state_dict(self.chunks, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_chunks_state_dict(self.chunks, self.optimizer, state)
        self.gather_weights()


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


__all__ = ["PerOpStage", "PipeSpmdProgram", "StageRunner", "runner_source"]
