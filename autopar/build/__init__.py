"""The per-rank build: one rank's program from its per-op placements, a model and a batch.

Where it sits: between the plan and the runtime (DESIGN.md: Plan -> apply -> run). Every
rank of a job calls `build_program` once: it traces the model's training step (pp = 1) or
its own pipeline chunks (pp > 1) once, applies the per-op placements it was given
(codegen/apply.py) and hands the per-rank graphs to the runtime's programs
(autopar/runtime/spmd.py, autopar/runtime/pipe_spmd.py), which step, sync and checkpoint
them. The placements come in a `ProgramPlacements` (autopar/plan.py) decided once, before
any rank builds: a plan's own, or the intra-op ILP's for a configuration given by flags or
`config=` (autopar/placing.py, called by the wiring: autopar/api.py, autopar/commands/).
Nothing here imports the solver, and the runtime imports nothing here: `train_worker` is
the spawn target that joins the two.

Modules: `one_stage` (pp = 1), `chunks` (the pipeline cut and the chunks' traces, shared
with the launcher's checks and the wiring's solve), `pipeline` (pp > 1).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.build.one_stage import TraceMemo, build_spmd_program
from autopar.build.pipeline import build_pipe_spmd_program
from autopar.capabilities import pipeline_support
from autopar.plan import ProgramPlacements
from autopar.runtime.jobs import run_job
from autopar.runtime.program import OptimizerFactory, default_optimizer


def build_program(model: nn.Module, placed: ProgramPlacements, *, example_inputs: Sequence[Any],
                  loss_fn: Callable[..., torch.Tensor] | None = None, optimizer: OptimizerFactory | None = None,
                  mesh: DeviceMesh | None = None, memo: TraceMemo | None = None) -> Any:
    """Shard `model` (built identically on every rank) with `placed`'s per-op placements;
    collective. `example_inputs` is one global batch (its first dp * micro_batch rows are
    traced). `mesh`: pp > 1 only, a ("pp", "dp", "tp") DeviceMesh to build on (default: one
    over the whole world); a one-stage program makes its own (dp, tp) mesh.

    pp = 1: the per-op program (autopar/build/one_stage.py): the placements applied to the
    traced graph of one global microbatch. pp > 1: the model cut at its repeated layers,
    every stage a per-op program on its (dp, tp) submesh (autopar/build/pipeline.py). The
    module-level builder (family rule tables) is not on this path: it lives in
    benchmarks/baselines/template_program.py as a baseline.

    `placed.fused_kernels` (pp = 1): the placements were solved on the step traced with the
    fused Triton ops of codegen/kernels swapped in for the model's norms and MLPs wherever
    they provably compute the same (codegen/kernels/modules.py), so they are swapped in here too before tracing; parameter names and values are
    unchanged, so checkpoints do not notice. With tp > 1 the fused ops take the placements
    the ILP chose among their own DTensor rules (codegen/kernels/sharding.py).

    `config.compiled`: every per-rank graph runs through Inductor (codegen/inductor.py),
    compiled at its first call (`program.compile_times()` says how long each took).

    `memo` (pp = 1): the trace of this rank's previous build of the same job, taken again
    where this one traces the same step (autopar/build/one_stage.py `TraceMemo`)."""
    config = placed.config
    optimizer = optimizer or default_optimizer()
    if memo is not None:
        memo.builds_left -= 1
        if config.pp > 1:
            memo.keep((), None, None)  # a pipeline traces its chunks: nothing to hand on
    if config.pp == 1:
        if placed.fused_kernels:
            # traced with the fused modules in: their ops (and backward ops) are in the
            # joint graph, sharded by their own DTensor rules (codegen/kernels/sharding.py)
            from codegen.kernels.modules import swap_fused_modules  # lazy: fused kernels (CUDA only), off the forkserver preload

            model = swap_fused_modules(model)
        return build_spmd_program(model, placed, example_inputs, loss_fn=loss_fn, optimizer=optimizer, memo=memo)
    # pp > 1, any model with a repeated layer stack (the zoo's included)
    reason = pipeline_support(model, config)
    if reason is not None:
        raise ValueError(reason)
    return build_pipe_spmd_program(model, placed, example_inputs, loss_fn=loss_fn, optimizer=optimizer, mesh=mesh)


def train_worker(rank: int, job: Any) -> list[Any]:
    """The spawn target of a training job (autopar/runtime/jobs.py `TrainJob`, its
    placements decided before spawn: autopar/placing.py `place_job`): the runtime's train
    loop with this module's build; one RunResult per configuration, the configurations
    that trace the same step tracing it once (`TraceMemo`)."""
    return run_job(rank, job, build=functools.partial(build_program, memo=TraceMemo(builds_left=len(job.configs))))


__all__ = ["build_program", "train_worker"]
