"""Sharded training equals single-process training: real gloo ranks vs the reference.

Each spawned job runs many configurations in one process group (ranks start once);
every configuration trains 3 AdamW steps and is compared with `reference_run` (same
seed, same data, same optimizer): losses to rtol 1e-4, parameters to atol 1e-3 (Adam
amplifies reduction-order noise, notes 3.2); on every rank the collectives the program
runs per step equal those its ILP priced (kind, axis, count, bytes). ZeRO stages are also
checked for really sharded memory (local optimizer state / parameters / gradients per rank).

Weight-update sharding (ZeRO-1/2: every parameter has a compute placement and a weight-update
placement; solver/forced.py keeps the weights whole over dp and shards their update) runs
on the Llama: the gradients reduce-scattered once per step, a stock optimizer over the
update shards, and the updated weights all-gathered once per step (the `param_gather`
graph), pipeline stages included, under full recomputation there (a Hugging Face GPT-2's
ZeRO-2 and ZeRO-3 stages are tests/dist/test_pipeline_any_model.py's).

The models are as small as each configuration allows, since every configuration's build
(trace and per-op program, on each of the 4 ranks sharing 2 cores) is most of the time:
two layers, six for the 3D run's uneven interleaved stages.
"""

from __future__ import annotations

import pytest
import torch

from autopar.config import ParallelConfig as C
from autopar.build import train_worker
from autopar.runtime.jobs import TrainJob, reference_run
from autopar.runtime.launch import spawn
from tests.parallel import place_jobs

pytestmark = pytest.mark.dist

GPT = "gpt:layers=2,hidden=64,heads=4,vocab=256,seq=32"
LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=32"

WORLD4 = {
    "dp4": C(dp=4),
    "zero1": C(dp=4, zero=1),
    "zero2": C(dp=4, zero=2),
    "zero3": C(dp=4, zero=3),
    "zero3_full": C(dp=4, zero=3, recompute="full"),
    "tp2xdp2_sp": C(tp=2, dp=2, sequence_parallel=True),
    "dp2xtp2_zero1": C(dp=2, tp=2, zero=1),
    "pp2xdp2_zero1_1f1b": C(pp=2, dp=2, zero=1, schedule="1f1b", recompute="full"),
    "pp2xdp2_zero2_1f1b": C(pp=2, dp=2, zero=2, schedule="1f1b", recompute="full"),
}
LLAMA6 = "llama:layers=6,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=32"
WORLD8 = {
    # dp x tp x pp on 8 ranks: stages of 2 and 4 layers, each split evenly over its 2 chunks
    # (1, 2, 1, 2 layers), the uneven interleaved cuts the search writes (GPT 1F1B with tp in
    # its stages is tests/dist/test_pipeline_per_op.py's, on Hugging Face GPT-2)
    LLAMA6: (C(dp=2, tp=2, pp=2, zero=1, schedule="interleaved", interleave=2), (2, 4)),
}


def _jobs_worker(rank: int, jobs: tuple[TrainJob, ...]) -> list:
    return [train_worker(rank, job) for job in jobs]


def _merge(per_rank: list) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = {}
    for result in per_rank:
        params.update(result.parameters)
    return params


def _check(result_by_rank: list, ref_losses: list[float], ref_params: dict[str, torch.Tensor]) -> None:
    losses = result_by_rank[0].losses
    for r in result_by_rank:
        assert r.losses == losses, "every rank must report the same global loss"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    for rank, r in enumerate(result_by_rank):
        assert r.priced is not None and r.collectives == r.priced, f"rank {rank}: ran {r.collectives}, " \
                                                                   f"priced {r.priced}"
    params = _merge(result_by_rank)
    # every parameter of the model is owned by some rank (tied head weight: under one name)
    assert params and set(ref_params) - set(params) <= {"lm_head.weight"}
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], atol=1e-3, rtol=0, msg=name)


NAMES = {
    # Data parallel and the ZeRO stages run on the Llama; GPT's dp2 x tp2 runs here with
    # sequence parallelism. Interleaved pipelines: tests/dist/test_pipeline_any_model.py
    # (ZeRO-3), test_pipeline_per_op.py (tp in the stages), test_checkpoint.py and the
    # 3D run below.
    GPT: ("tp2xdp2_sp",),
    # Llama's pipelines: pp2 x dp2 ZeRO-1 and ZeRO-2 1F1B here, with full recomputation
    # (recomputed forward ops in the stages' backward graphs), test_pipeline_per_op.py's
    # (pp2 x tp2 GPipe) and test_3d_on_8_ranks' (interleaved, ZeRO-1 with tp); a ZeRO-1 GPipe
    # pipeline is test_checkpoint.py's; ZeRO-2 reduce-scatters every microbatch's gradients
    # and accumulates the shards, one-stage and in pipeline stages alike. Its tp runs under
    # ZeRO-1 (dp2 x tp2); GPT's tp2 x dp2 has sequence parallelism. ZeRO-3 under full
    # recompute gathers each weight once in the backward for the recomputed forward and the
    # gradient matmuls together (tests/unit/test_recompute_gathers.py).
    LLAMA: ("dp4", "zero1", "zero2", "zero3", "zero3_full", "dp2xtp2_zero1", "pp2xdp2_zero1_1f1b", "pp2xdp2_zero2_1f1b"),
}
CASES = [(m, n) for m in NAMES for n in NAMES[m]]
KIND = {GPT: "gpt", LLAMA: "llama"}


@pytest.fixture(scope="module")
def world4():
    jobs = tuple(TrainJob(model=m, configs=tuple(WORLD4[n] for n in NAMES[m]), steps=3, global_batch=8,
                          return_parameters=True) for m in NAMES)
    results = spawn(_jobs_worker, 4, (place_jobs(*jobs),))
    return {job.model: ([results[r][j] for r in range(4)], reference_run(job)) for j, job in enumerate(jobs)}


@pytest.mark.parametrize("model, name", CASES, ids=[f"{n}-{KIND[m]}" for m, n in CASES])
def test_world4_matches_reference(world4, model, name):
    per_rank, (ref_losses, ref_params) = world4[model]
    index = NAMES[model].index(name)
    _check([r[index] for r in per_rank], ref_losses, ref_params)


def test_zero_stages_shard_memory(world4):
    per_rank, _ = world4[LLAMA]
    stats = {name: per_rank[0][i] for i, name in enumerate(NAMES[LLAMA])}
    base = stats["dp4"]
    # dp = 4, one stage (the per-op program): ZeRO-3 shards parameters, gradients and state over
    # dp (about a quarter each); ZeRO-1/2 keep the weights whole (the tests below)
    zero3 = stats["zero3"]
    assert zero3.optimizer_state_bytes < 0.3 * base.optimizer_state_bytes
    assert zero3.gradient_bytes < 0.3 * base.gradient_bytes
    assert zero3.parameter_bytes < 0.3 * base.parameter_bytes


def test_3d_on_8_ranks_matches_reference():
    """A Llama on pp2 x dp2 x tp2, interleaved, with ZeRO-1 (weights whole, their update
    sharded over dp, gathered once per step) on uneven stages: like one process, and price =
    run on every rank."""
    jobs = tuple(TrainJob(model=m, configs=(c,), stage_layers=(layers,), steps=3, global_batch=4,
                          return_parameters=True) for m, (c, layers) in WORLD8.items())
    results = spawn(_jobs_worker, 8, (place_jobs(*jobs),))
    for j, job in enumerate(jobs):
        ref_losses, ref_params = reference_run(job)
        _check([results[r][j][0] for r in range(8)], ref_losses, ref_params)


def test_update_sharding_gathers_once_per_step_and_shrinks_the_optimizer_state(world4):
    """ZeRO-1 over dp4: the same global steps as dp4 (all-reduces become reduce-scatters,
    plus one all-gather of the updated weights per step, none per microbatch), and a
    quarter of dp4's optimizer state on every rank, its weights whole (4 + 4/4 bytes of
    parameters per element: the compute copy and the update shard), each as priced."""
    per_rank, _ = world4[LLAMA]
    names = list(NAMES[LLAMA])
    for rank in range(4):
        dp4, zero1 = per_rank[rank][names.index("dp4")], per_rank[rank][names.index("zero1")]
        assert zero1.optimizer_state_bytes * 4 == dp4.optimizer_state_bytes
        assert zero1.parameter_bytes * 4 == dp4.parameter_bytes * 5
        assert zero1.gradient_bytes * 4 == dp4.gradient_bytes
        gathers = zero1.collectives[("all_gather", "dp")]
        reductions = zero1.collectives[("reduce_scatter", "dp")]
        # every weight of this model divides by 4: each is gathered whole once per step (two
        # microbatches per step here: per microbatch would be twice the bytes)
        assert gathers[1] == dp4.parameter_bytes, gathers
        assert reductions[1] == dp4.gradient_bytes
        assert ("all_reduce", "dp") not in zero1.collectives or zero1.collectives[("all_reduce", "dp")][1] < 64
        # and both match their price (fp32: the update shard and the compute copy, AdamW's
        # moments on the shard; autopar.precision.Precision.state_bytes)
        for result in (dp4, zero1):
            weights, _, optimizer = result.priced_state
            assert result.parameter_bytes == pytest.approx(weights, rel=1e-9)
            assert result.optimizer_state_bytes == pytest.approx(optimizer, rel=1e-9)


def test_zero_2_reduce_scatters_every_microbatch(world4):
    """ZeRO-2 over dp4 (two microbatches per step): ZeRO-1's placements, its gradients
    reduce-scattered during each microbatch's backward (twice ZeRO-1's reduce-scatters per
    step) and accumulated as shards; the updated weights gathered once per step, and the
    same quarter of the optimizer state."""
    per_rank, _ = world4[LLAMA]
    names = list(NAMES[LLAMA])
    for rank in range(4):
        zero1, zero2 = per_rank[rank][names.index("zero1")], per_rank[rank][names.index("zero2")]
        calls, nbytes = zero1.collectives[("reduce_scatter", "dp")]
        assert zero2.collectives[("reduce_scatter", "dp")] == (2 * calls, 2 * nbytes)
        assert zero2.collectives[("all_gather", "dp")] == zero1.collectives[("all_gather", "dp")]
        assert zero2.optimizer_state_bytes == zero1.optimizer_state_bytes
        assert zero2.gradient_bytes == zero1.gradient_bytes


def test_pipeline_stage_gathers_its_weights_once_per_step(world4):
    """A ZeRO-1 pipeline stage (pp2 x dp2, 4 microbatches of the 8 rows per step) gathers
    each of its weights once per step, not once per microbatch as the ZeRO-3 layout does,
    and holds AdamW's two moments for half of its weights."""
    per_rank, _ = world4[LLAMA]
    names = list(NAMES[LLAMA])
    for schedule in ("1f1b",):  # (GPipe: test_checkpoint.py)
        for rank in range(4):
            r = per_rank[rank][names.index(f"pp2xdp2_zero1_{schedule}")]
            calls, nbytes = r.collectives[("all_gather", "dp")]
            # the stage's weights whole, once (dp2 ZeRO-1 holds 4 + 4/2 bytes an element; per
            # microbatch would be four times the bytes)
            assert nbytes * 3 == r.parameter_bytes * 2, (calls, nbytes, r.parameter_bytes)
            assert r.optimizer_state_bytes * 3 == r.parameter_bytes * 2  # 8 bytes on E/2 against 6 E


def test_zero_2_pipeline_stage_reduce_scatters_every_microbatch(world4):
    """ZeRO-2 in pipeline stages (pp2 x dp2 1F1B, 4 microbatches per step): each stage's
    backward reduce-scatters every microbatch's gradients (4x ZeRO-1's reduce-scatters per
    step, by count and bytes), the shards accumulate, and the weights are still gathered
    once per step, with ZeRO-1's optimizer state."""
    per_rank, _ = world4[LLAMA]
    names = list(NAMES[LLAMA])
    for rank in range(4):
        zero1, zero2 = (per_rank[rank][names.index(f"pp2xdp2_zero{z}_1f1b")] for z in (1, 2))
        calls, nbytes = zero1.collectives[("reduce_scatter", "dp")]
        assert zero2.collectives[("reduce_scatter", "dp")] == (4 * calls, 4 * nbytes)
        assert zero2.collectives[("all_gather", "dp")] == zero1.collectives[("all_gather", "dp")]
        assert zero2.optimizer_state_bytes == zero1.optimizer_state_bytes
        assert zero2.gradient_bytes == zero1.gradient_bytes
