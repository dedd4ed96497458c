"""`--compile` on real gloo ranks: the per-rank graphs run through Inductor and train as the
eager program does.

World 2, the zoo Llama in float32, 3 AdamW steps of a global batch of 4:
- one stage, dp2 with ZeRO-1 (two microbatches: the step graph, the gradient sync's
  reduce-scatters and the weight gather's all-gathers each compiled);
- a pipeline, pp2 1F1B (each rank's chunk: its forward and backward graphs, and its
  gradient sync, compiled).
Checked: the compiled program's losses equal the eager one's (rtol 1e-4), Inductor
compiled every graph the program calls (its compile times, by graph), the one-stage
program still runs exactly the collectives its plan priced, and the eager program
compiled nothing. Inductor's caches go to a fresh directory (a cold compile, as in CI).
"""

from __future__ import annotations

import os

import pytest
import torch

from autopar.config import ParallelConfig as C
from autopar.build import train_worker
from autopar.runtime.jobs import TrainJob
from autopar.runtime.launch import spawn
from tests.parallel import place_jobs

pytestmark = pytest.mark.dist

MODEL = "llama:layers=2,hidden=32,heads=2,vocab=64,seq=16"
CONFIGS = {
    "dp2-zero1": C(dp=2, zero=1),
    "pp2": C(pp=2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    configs = tuple(c for config in CONFIGS.values() for c in (config, C(**{**config.to_json(), "compiled": True})))
    job = TrainJob(model=MODEL, configs=configs, steps=3, global_batch=4)
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))
    try:
        per_rank = spawn(train_worker, 2, place_jobs(job))
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
    return {name: ([r[2 * k] for r in per_rank], [r[2 * k + 1] for r in per_rank])
            for k, name in enumerate(CONFIGS)}


@pytest.mark.parametrize("config", CONFIGS)
def test_compiled_losses_equal_the_eager_program(runs, config):
    eager, compiled = runs[config]
    for e, c in zip(eager, compiled):
        assert c.config.compiled and not e.config.compiled
        torch.testing.assert_close(torch.tensor(c.losses), torch.tensor(e.losses), rtol=1e-4, atol=0)
        assert c.losses[-1] < c.losses[0]  # it trains


def test_every_graph_the_program_calls_is_compiled(runs):
    (eager, compiled), (pipe_eager, pipe_compiled) = runs["dp2-zero1"], runs["pp2"]
    for r in compiled:
        assert set(r.compile_s) == {"step", "grad_sync", "param_gather"}
        assert all(s > 0 for s in r.compile_s.values())
    for rank, r in enumerate(pipe_compiled):  # rank r holds chunk r of the two
        assert set(r.compile_s) == {f"chunk{rank}.forward", f"chunk{rank}.backward", f"chunk{rank}.grad_sync"}
    assert all(not r.compile_s for r in eager + pipe_eager)


def test_compiled_one_stage_program_runs_what_was_priced(runs):
    """Price = run on collectives holds for the compiled program: it runs the graphs the ILP
    priced (the gradient buckets reduced by the functional all-reduce, which Inductor
    reinplaces, are the same collectives), and the ILP priced the same collectives as for
    the eager program (compilation changes compute prices only)."""
    eager, compiled = runs["dp2-zero1"]
    for e, c in zip(eager, compiled):
        assert c.priced and c.collectives == c.priced
        assert c.priced == e.priced
