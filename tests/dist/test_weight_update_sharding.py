"""Weight-update sharding (ZeRO-1/2) on real gloo ranks: weights whole, update sharded.

Each parameter has a compute placement and a weight-update placement (solver/forced.py:
`--zero 1/2` keeps the weights replicated over dp and shards their update). The program
reduce-scatters the accumulated gradients once per step, steps a stock optimizer over the
update shards, and all-gathers the updated weights once per step (the `param_gather`
graph), pipeline stages included. Every configuration trains 3 AdamW steps beside the
single-process reference: losses to rtol 1e-4, parameters to atol 1e-3; on every rank
the collectives the program runs per step equal those its ILP priced (kind, axis,
count, bytes); the optimizer state shrinks by the dp degree. pp2 x dp2 x tp2 with ZeRO-1,
interleaved, on 8 ranks is tests/dist/test_train_numerics.py's `test_3d_on_8_ranks`.
"""

from __future__ import annotations

import pytest
import torch

from autopar.config import ParallelConfig as C
from autopar.runtime.jobs import TrainJob, reference_run, train_worker
from autopar.runtime.launch import spawn

pytestmark = pytest.mark.dist

LLAMA = "llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=32"
HF = "hf_factories:llama"
WORLD4 = {
    LLAMA: {
        "dp4": C(dp=4),
        "zero1": C(dp=4, zero=1),
        "zero2": C(dp=4, zero=2),
        "dp2xtp2_zero1": C(dp=2, tp=2, zero=1),
        "pp2xdp2_zero1_gpipe": C(pp=2, dp=2, zero=1, schedule="gpipe"),
        "pp2xdp2_zero1_1f1b": C(pp=2, dp=2, zero=1, schedule="1f1b"),
    },
    HF: {
        "zero1": C(dp=4, zero=1),
        "pp2xdp2_zero1_1f1b": C(pp=2, dp=2, zero=1, schedule="1f1b"),
    },
}
CASES = [(m, n) for m in WORLD4 for n in WORLD4[m]]


def _jobs_worker(rank: int, jobs: tuple[TrainJob, ...]) -> list:
    return [train_worker(rank, job) for job in jobs]


def _check(results: list, ref_losses: list[float], ref_params: dict[str, torch.Tensor]) -> None:
    losses = results[0].losses
    assert all(r.losses == losses for r in results), "every rank reports the same global loss"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    params: dict[str, torch.Tensor] = {}
    for r in results:
        params.update(r.parameters)
    assert params and set(params) <= set(ref_params)
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], atol=1e-3, rtol=0, msg=name)
    for rank, r in enumerate(results):
        assert r.priced is not None and r.collectives == r.priced, f"rank {rank}: run {r.collectives} != " \
                                                                   f"priced {r.priced}"


@pytest.fixture(scope="module")
def world4():
    jobs = tuple(TrainJob(model=m, configs=tuple(WORLD4[m].values()), steps=3, global_batch=8,
                          return_parameters=True) for m in WORLD4)
    results = spawn(_jobs_worker, 4, (jobs,))
    return {job.model: ([results[r][j] for r in range(4)], reference_run(job)) for j, job in enumerate(jobs)}


@pytest.mark.parametrize("model, name", CASES, ids=[f"{n}-{'hf' if m == HF else 'zoo'}" for m, n in CASES])
def test_trains_like_one_process_and_runs_what_it_priced(world4, model, name):
    per_rank, (ref_losses, ref_params) = world4[model]
    index = list(WORLD4[model]).index(name)
    _check([r[index] for r in per_rank], ref_losses, ref_params)


def test_update_sharding_gathers_once_per_step_and_shrinks_the_optimizer_state(world4):
    """ZeRO-1 over dp4: the same global steps as dp4 (all-reduces become reduce-scatters,
    plus one all-gather of each updated weight per step, none per microbatch), and a
    quarter of dp4's optimizer state on every rank, its weights whole (4 + 4/4 bytes of
    parameters per element: the compute copy and the update shard)."""
    per_rank, _ = world4[LLAMA]
    names = list(WORLD4[LLAMA])
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


def test_pipeline_stage_gathers_its_weights_once_per_step(world4):
    """A ZeRO-1 pipeline stage (pp2 x dp2, 4 microbatches of the 8 rows per step) gathers
    each of its weights once per step, not once per microbatch as the ZeRO-3 layout does,
    and holds AdamW's two moments for half of its weights."""
    per_rank, _ = world4[LLAMA]
    names = list(WORLD4[LLAMA])
    for schedule in ("gpipe", "1f1b"):
        for rank in range(4):
            r = per_rank[rank][names.index(f"pp2xdp2_zero1_{schedule}")]
            calls, nbytes = r.collectives[("all_gather", "dp")]
            # the stage's weights whole, once (dp2 ZeRO-1 holds 4 + 4/2 bytes an element; per
            # microbatch would be four times the bytes)
            assert nbytes * 3 == r.parameter_bytes * 2, (calls, nbytes, r.parameter_bytes)
            assert r.optimizer_state_bytes * 3 == r.parameter_bytes * 2  # 8 bytes on E/2 against 6 E
