"""What a compiled program holds once built: its shards, nothing of the build.

World 2, the zoo Llama, built by `autopar.compile` with a configuration (no search) as
a pipeline (pp 2, 1F1B over 4 microbatches) and as one stage (dp 2 ZeRO-3); rank 0 traces
and solves the placements before the build (autopar/placing.py) in a forked child, so no
rank's own process ever imports the solver. After the build and two steps:
- no unsharded weight outlives the caller's model (`Compiled` drops its build closure,
  which held the model; the one-stage program shards the model's own modules in place);
- no tensor carries an autograd graph between steps (the pipeline build's traced forward
  of the whole model on one microbatch kept every activation of it until the step);
- no frame of the build or of the solve before it is alive (PuLP's import-time exceptions
  held the whole stack of the first solve, so a solving rank kept the build's locals: the
  model, the split pipeline);
- torch's split `Pipe` is gone.
Each of these held about one copy of the weights, or every activation of the model,
per rank on the benchmark Llama (benchmarks/measure_torchtitan.py)."""

from __future__ import annotations

import gc
import sys
import types
import weakref

import pytest
import torch

from autopar.api import compile as ap_compile
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.runtime.launch import spawn

pytestmark = pytest.mark.dist

LLAMA = "llama:layers=2,hidden=32,heads=2,kv_heads=1,ffn=64,vocab=64,seq=8"
CONFIGS = {
    "pp2 1f1b": ParallelConfig(pp=2, micro_batch=1, schedule="1f1b"),
    "dp2 zero3": ParallelConfig(dp=2, zero=3, micro_batch=2),
}


def _held(config: ParallelConfig) -> dict:
    source = resolve(LLAMA)
    batch = source.example_inputs(4, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = source.build()
    weights = [weakref.ref(p) for p in model.parameters()]
    compiled = ap_compile(model, "cpu:2", example_inputs=batch, config=config)
    del model
    losses = [compiled.step(batch) for _ in range(2)]
    gc.collect()
    objects = gc.get_objects()
    graphs = [tuple(o.shape) for o in objects if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    frames = [o.f_code.co_name for o in objects if isinstance(o, types.FrameType)
              and o.f_code.co_name in ("build_program", "build_pipe_spmd_program", "build_spmd_program",
                                       "program_placements", "solve_stage_placements", "rank0_placements")]
    pipes = [o for o in objects if type(o).__name__ == "Pipe"]
    return {"whole_weights": sum(w() is not None for w in weights), "graph_tensors": graphs, "build_frames": frames,
            "pipes": len(pipes), "losses": losses, "solver_imported": "pulp" in sys.modules}


def _worker(rank: int) -> dict:
    return {label: _held(config) for label, config in CONFIGS.items()}


@pytest.fixture(scope="module")
def held() -> list[dict]:
    return spawn(_worker, 2, collective_timeout_s=120.0, timeout_s=600.0)


@pytest.mark.parametrize("label", list(CONFIGS))
def test_a_built_program_holds_nothing_of_its_build(held, label):
    for rank, out in enumerate(held):
        got = out[label]
        assert all(torch.isfinite(torch.tensor(got["losses"]))), (rank, got["losses"])
        assert got["whole_weights"] == 0, f"rank {rank}: {got['whole_weights']} unsharded weights outlive the model"
        assert got["graph_tensors"] == [], f"rank {rank}: tensors holding an autograd graph: {got['graph_tensors']}"
        assert got["build_frames"] == [], f"rank {rank}: build frames alive: {got['build_frames']}"
        assert got["pipes"] == 0, f"rank {rank}: {got['pipes']} split Pipe(s) alive"
        assert not got["solver_imported"], f"rank {rank} solved in its own process, not in a child"
