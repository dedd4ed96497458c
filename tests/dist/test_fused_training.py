"""Training with the fused kernels swapped in (as the runtime does on GPU) gives the same
losses as the single-process run of the unfused model: 2 gloo ranks, ZeRO-3 over dp 2."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from autopar.config import ParallelConfig
from autopar.build import build_program
from autopar.runtime.jobs import TrainJob, build_model_and_batches, reference_run
from autopar.runtime.launch import spawn
from codegen.kernels.ops import LIB

pytestmark = pytest.mark.dist

JOB = TrainJob(model="llama-tiny", configs=(ParallelConfig(dp=2, zero=3),), steps=3, global_batch=4)


def _worker(rank: int, placed: str) -> list[float]:
    from autopar.plan import ProgramPlacements

    os.environ.pop("TRITON_INTERPRET", None)  # the ops' reference path: the kernels have their own tests
    model, batches, _ = build_model_and_batches(JOB)
    program = build_program(model, ProgramPlacements.loads(placed),
                            optimizer=functools.partial(torch.optim.AdamW, lr=JOB.lr), example_inputs=batches[0])
    fused = sorted({type(m).__name__ for m in program.model.modules()
                    if type(m).__module__ == "codegen.kernels.modules"})
    # the fused ops are in the per-rank program the ILP sharded, not only in the module tree
    in_graph = f"{LIB}." in program.graphs.step.code
    return {"fused": fused, "in_graph": in_graph, "losses": [program.step(batch) for batch in batches]}


def test_fused_kernels_train_like_the_reference():
    expected, _ = reference_run(JOB)
    from autopar.placing import program_placements

    model, batches, _ = build_model_and_batches(JOB)
    # solved before the ranks start, on the step traced with the fused modules (which the ranks then swap in)
    placed = program_placements(model, JOB.configs[0], batches[0], fused_kernels=True).dumps()
    for result in spawn(_worker, 2, (placed,)):
        assert result["fused"] and result["in_graph"], "no fused module was swapped in"
        assert result["losses"] == pytest.approx(expected, rel=1e-4)
