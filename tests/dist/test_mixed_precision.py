"""bf16-mixed precision on real gloo ranks: priced and run as the policy says.

World 4. The zoo's Llama and a Hugging Face Llama (built from a config) train 20 AdamW
steps under `precision="bf16-mixed"` (autopar/precision.py: bf16 compute, fp32 master
weights, AdamW state and gradient reduction) as dp4 (ZeRO-1), dp2 x tp2 and pp2 x dp2
(1F1B), each configuration's placements solved by the ILP on the ranks. Checked:
- the losses equal the single-process run under the same policy
  (`autopar.runtime.jobs.reference_run`: an fp32 master model and a bf16 copy refreshed from
  it every step) within rtol 2e-3 (bf16 reductions run in another order), and follow the
  fp32 run within 2% at step 20;
- price = run on bytes: the collectives every rank's program runs per step (kind, mesh
  axis, count and bytes) equal what the ILP priced, gradients reduced in float32 and
  weights gathered in bfloat16;
- memory: each rank's master weights plus compute copies, and AdamW's state, measured
  from the tensors, equal the priced state bytes (cost_model.parameter_state_bytes);
- the master weights are float32 and the compute copies bfloat16 (`test_master_weights_
  are_fp32_and_compute_copies_bf16`, one program built in this process's group of one).
"""

from __future__ import annotations

import pytest
import torch

from autopar.config import ParallelConfig as C
from autopar.build import train_worker
from autopar.placing import place_job
from autopar.runtime.jobs import TrainJob, reference_run
from autopar.runtime.launch import spawn
from tests.parallel import place_jobs

pytestmark = pytest.mark.dist

STEPS = 20
MODELS = {
    "zoo-llama": "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=16",
    "hf-llama": "hf_factories:llama",
}
CONFIGS = {
    "dp4-zero1": C(dp=4, zero=1, precision="bf16-mixed"),
    "dp2xtp2": C(dp=2, tp=2, precision="bf16-mixed"),
    "pp2xdp2": C(pp=2, dp=2, precision="bf16-mixed"),
}


def _jobs_worker(rank: int, jobs: tuple[TrainJob, ...]) -> list:
    return [train_worker(rank, job) for job in jobs]


@pytest.fixture(scope="module")
def runs():
    # global batch 4: dp4 runs one microbatch a step (its gradients reduced inside the step),
    # dp2 and the pipeline two
    jobs = tuple(TrainJob(model=model, configs=tuple(CONFIGS.values()), steps=STEPS, global_batch=4)
                 for model in MODELS.values())
    results = spawn(_jobs_worker, 4, (place_jobs(*jobs),))
    return {name: ([results[r][j] for r in range(4)], reference_run(job)[0], reference_run(job, "fp32")[0])
            for j, (name, job) in enumerate(zip(MODELS, jobs))}


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("model", MODELS)
def test_losses_match_the_bf16_mixed_reference_and_follow_fp32(runs, model, config):
    per_rank, mixed, fp32 = runs[model]
    results = [r[list(CONFIGS).index(config)] for r in per_rank]
    losses = results[0].losses
    assert len(losses) == STEPS and all(r.losses == losses for r in results)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(mixed), rtol=2e-3, atol=0)
    assert abs(losses[-1] - fp32[-1]) <= 0.02 * fp32[-1]
    assert losses[-1] < losses[0]  # it trains
    # the policy changes the numbers: a program that ran fp32 would match fp32 to ~1e-6
    assert max(abs(a - b) for a, b in zip(losses, fp32)) > 1e-5


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("model", MODELS)
def test_price_equals_run_on_collectives_and_memory(runs, model, config):
    """On every rank: the collectives run per step (kind, axis, count, bytes) are those the
    ILP priced, and the weights (master plus compute copies) and AdamW's state, measured
    from the tensors, are their priced bytes."""
    per_rank, _, _ = runs[model]
    for r in per_rank:
        result = r[list(CONFIGS).index(config)]
        assert result.priced and result.collectives == result.priced
        weights, _, optimizer = result.priced_state
        assert result.parameter_bytes == pytest.approx(weights, rel=1e-3)
        assert result.optimizer_state_bytes == pytest.approx(optimizer, rel=1e-3)


def test_zero_1_reduces_fp32_gradients_and_gathers_bf16_weights(runs):
    """dp4 ZeRO-1 over the zoo Llama: per step, the gradients' reduce-scatters move 4 bytes
    per parameter element and the updated weights' all-gathers 2 (the master shard cast to
    bfloat16, then gathered): twice as many bytes reduced as gathered."""
    per_rank, _, _ = runs["zoo-llama"]
    got = per_rank[0][list(CONFIGS).index("dp4-zero1")].collectives
    (_, scattered), (_, gathered) = got[("reduce_scatter", "dp")], got[("all_gather", "dp")]
    assert scattered == 2 * gathered


def test_master_weights_are_fp32_and_compute_copies_bf16():
    """One rank (a process group of one, dp1 x tp1): the parameters the optimizer steps are
    float32, every compute copy the step graph reads is bfloat16, and the step graph was
    compiled for bfloat16 weights (its parameter inputs)."""
    job = TrainJob(model=MODELS["zoo-llama"], configs=(C(precision="bf16-mixed"),), steps=1, global_batch=2)
    results = spawn(_one_rank_dtypes, 1, (place_job(job),))
    params, copies, step_dtypes = results[0]
    assert params and set(params) == {"torch.float32"}
    assert copies and set(copies) == {"torch.bfloat16"}
    assert step_dtypes == {"torch.bfloat16"}


def _one_rank_dtypes(rank: int, job: TrainJob) -> tuple[list[str], list[str], set[str]]:
    from autopar.build import build_program
    from autopar.plan import ProgramPlacements
    from autopar.runtime.jobs import build_model_and_batches
    from autopar.runtime.program import default_optimizer

    model, batches, _ = build_model_and_batches(job)
    program = build_program(model, ProgramPlacements.loads(job.placements[0]), optimizer=default_optimizer(),
                            example_inputs=batches[0])
    program.step(batches[0])
    params = [str(p.dtype) for _, p in program.named_parameters()]
    copies = [str(program.compute_weight(name).dtype) for name, _ in program.named_parameters()]
    from autopar.ir import Role

    step = {f"torch.{s.dtype}" for s in program.graphs.slots if s.role is Role.PARAMETER}
    return params, copies, step
