"""Training with the fused kernels swapped in (as the runtime does on GPU) gives the same
losses as the single-process run of the unfused model, on 2 gloo ranks: the zoo's Llama
under ZeRO-3 over dp 2, and a Hugging Face Llama (its LlamaRMSNorm and LlamaMLP swapped by
structure and probe, codegen/kernels/modules.py) under tp 2, with the placements the ILP
solved on the fused step (for this small model it keeps the fused ops whole over tp, as it
keeps their unfused ops in the unfused step; the fused ops' sharding rules are
codegen/kernels/sharding.py's)."""

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

JOBS = (TrainJob(model="llama-tiny", configs=(ParallelConfig(dp=2, zero=3),), steps=3, global_batch=4),
        TrainJob(model="tests.hf_factories:llama", configs=(ParallelConfig(tp=2),), steps=3))


def _worker(rank: int, placed: tuple[str, ...]) -> list[dict]:
    from autopar.plan import ProgramPlacements

    os.environ.pop("TRITON_INTERPRET", None)  # the ops' reference path: the kernels have their own tests
    out = []
    for job, text in zip(JOBS, placed):
        model, batches, _ = build_model_and_batches(job)
        program = build_program(model, ProgramPlacements.loads(text),
                                optimizer=functools.partial(torch.optim.AdamW, lr=job.lr), example_inputs=batches[0])
        fused = sorted({type(m).__name__ for m in program.model.modules()
                        if type(m).__module__ == "codegen.kernels.modules"})
        # the fused ops are in the per-rank program the ILP sharded, not only in the module tree
        in_graph = f"{LIB}." in program.graphs.step.code
        out.append({"fused": fused, "in_graph": in_graph, "losses": [program.step(batch) for batch in batches]})
    return out


def test_fused_kernels_train_like_the_reference():
    from autopar.placing import program_placements

    placed = []
    for job in JOBS:
        model, batches, _ = build_model_and_batches(job)
        # solved before the ranks start, on the step traced with the fused modules (which the ranks then swap in)
        placed.append(program_placements(model, job.configs[0], batches[0], fused_kernels=True).dumps())
    results = spawn(_worker, 2, (tuple(placed),))
    for j, job in enumerate(JOBS):
        expected, _ = reference_run(job)
        for per_rank in results:
            result = per_rank[j]
            assert {"FusedRMSNorm", "FusedSwiGLU"} <= set(result["fused"]), result["fused"]
            assert result["in_graph"], "no fused op in the per-rank program"
            assert result["losses"] == pytest.approx(expected, rel=1e-4)
