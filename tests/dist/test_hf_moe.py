"""Hugging Face mixtures of experts with their experts split: Mixtral and Qwen2-MoE under ep2 x dp2
on 4 gloo ranks.

Both trace to autopar/grouped_mm.py's op: the tracer runs Hugging Face's experts with each
row's expert beside it and the experts each weight shard holds named, so the batch splits
over dp through the routing and the experts split over an axis. Mesh (dp 2, tp 2), 4
microbatches of one sequence per rank and step. The plans are the ILP's optimum with the
grouped matmuls held to their expert-parallel strategy on tp (ep2: weights and the experts
operand split on E over tp, each rank computing its own experts' rows of its tp group's
tokens, the partial outputs summed by all-reduces over tp) while the batch is split over
dp (dp2: the experts' gradients reduced over the dp replicas of each expert). The ranks
run exactly those placements.

The same spawn trains Mixtral under the ILP's own plan for the mesh: its weight gradients
may leave the step transposed (the gradient of a transposed view), laid out as their
shards before the optimizer reads them (autopar/runtime/program.py `gradient_for`).

3 AdamW steps: losses equal the single-process reference (rtol 1e-4), parameters stay
close (atol 1e-3), and each rank's collectives per step equal those the ILP priced.
"""

from __future__ import annotations

import pytest
import torch

from autopar.build import train_worker
from autopar.config import ParallelConfig
from autopar.ir import GROUPED_MM_BWD, GROUPED_MM_FWD
from autopar.placing import place_experts_split, place_job
from autopar.plan import ProgramPlacements
from autopar.runtime.jobs import TrainJob, reference_run
from autopar.runtime.launch import spawn

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")

MODELS = {"mixtral": "tests.hf_factories:mixtral", "qwen2-moe": "tests.hf_factories:qwen2_moe"}
CONFIG = ParallelConfig(dp=2, tp=2, micro_batch=1)
BATCH = 8
GROUPED = (GROUPED_MM_FWD, GROUPED_MM_BWD)


def _jobs_worker(rank: int, jobs: tuple[TrainJob, ...]) -> list:
    return [train_worker(rank, job)[0] for job in jobs]


def _grouped_inputs(job: TrainJob) -> dict:
    """{grouped op key: its input layouts} as `job`'s placements record them."""
    (stage,) = ProgramPlacements.loads(job.placements[0]).placements
    return {r.key: r.inputs for r in stage.placements if r.op in GROUPED}


ILP_PLAN = "mixtral, the ILP's plan"


@pytest.fixture(scope="module")
def runs():
    jobs, grouped = [], {}
    for name, model in MODELS.items():
        job = place_experts_split(TrainJob(model=model, configs=(CONFIG,), steps=3, global_batch=BATCH,
                                           return_parameters=True))
        grouped[name] = _grouped_inputs(job)
        jobs.append(job)
    jobs.append(place_job(TrainJob(model=MODELS["mixtral"], configs=(CONFIG,), steps=3, global_batch=BATCH,
                                   return_parameters=True)))
    grouped[ILP_PLAN] = {}
    results = spawn(_jobs_worker, 4, (tuple(jobs),))
    return {name: ([r[j] for r in results], reference_run(job), grouped[name])
            for j, (name, job) in enumerate(zip((*MODELS, ILP_PLAN), jobs))}


@pytest.mark.parametrize("name", [*MODELS, ILP_PLAN])
def test_experts_split_train_like_one_process(runs, name):
    per_rank, (ref_losses, ref_params), grouped = runs[name]
    assert name == ILP_PLAN or grouped and all(
        inputs[0].startswith("(S(0),") and inputs[1] == "(R, S(0))" and inputs[3] == "(R, S(0))"
        for inputs in grouped.values()), grouped
    losses = per_rank[0].losses
    assert len(losses) == 3 and all(r.losses == losses for r in per_rank)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    params = {}
    for r in per_rank:
        params.update(r.parameters)
    assert params and set(params) <= set(ref_params) and any("experts" in p for p in params)
    for param, value in params.items():
        torch.testing.assert_close(value, ref_params[param], atol=1e-3, rtol=0, msg=param)


@pytest.mark.parametrize("name", MODELS)
def test_price_equals_run(runs, name):
    per_rank, _, _ = runs[name]
    for rank, r in enumerate(per_rank):
        assert r.priced is not None and {("all_reduce", "tp"), ("all_reduce", "dp")} <= set(r.collectives), \
            f"rank {rank}: {r.collectives}"
        assert r.collectives == r.priced, f"rank {rank}"
