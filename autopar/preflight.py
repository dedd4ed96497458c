"""Checks of a training job that need no process group, run once before any rank starts.

Where it sits: between the CLI (autopar/commands/train.py) and the launcher
(autopar/runtime/launch.py). The runtime (autopar/runtime/program.py, codegen/) refuses the same
inputs when it builds a rank's program, but there each of N ranks would raise after
N processes were started and the user would read `rank 0 failed: ...`; here the
launcher raises once, before spawning, and the CLI exits 2 with the message alone.

What is checked (config vs model, plan vs model, devices): the degrees multiply to the
devices and divide the batch (ParallelConfig.check); one-stage jobs run the per-op program,
which takes any model; pipelines (per-op stages, autopar/runtime/pipe_spmd.py) need what
`autopar.capabilities.pipeline_support` says (a repeated layer stack, a schedule they run,
no recompute) and stage cuts that fit the layers.
"""

from __future__ import annotations

from torch import nn

from autopar.capabilities import layer_stack, pipeline_support, split_layers
from autopar.config import ParallelConfig
from autopar.runtime.program import model_dims


def check_job(model: nn.Module, config: ParallelConfig, *, num_devices: int, global_batch: int,
              stage_layers: tuple[int, ...] | None = None) -> int:
    """Raise ValueError (what is wrong, what to try) for a job the ranks would refuse;
    returns the number of microbatches per step."""
    num_microbatches = config.check(global_batch=global_batch, num_devices=num_devices, **model_dims(model, config))
    if config.pp == 1:
        return num_microbatches  # one stage: the per-op program shards any model the ILP can
    reason = pipeline_support(model, config)
    if reason is not None:
        raise ValueError(reason)
    num_layers = layer_stack(model)[1]
    num_chunks = config.pp * config.interleave
    if stage_layers is not None and not (config.interleave > 1 and len(stage_layers) == config.pp):
        split_layers(num_layers, num_chunks, stage_layers)  # raises on a misfit
    return num_microbatches
