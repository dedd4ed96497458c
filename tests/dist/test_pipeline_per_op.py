"""Per-op pipeline stages on real gloo ranks: the ILP's placements inside every stage.

World 4. Every pipeline here goes through `autopar.runtime.program.build_program` (pp > 1:
autopar/runtime/pipe_spmd.py): the model is cut at its repeated layers and each stage compiled
by the per-op path on its (dp, tp) submesh. Hugging Face GPT-2 with tp 2 inside the
stages (which the rule tables never ran), the zoo's Llama with pp2 x tp2 and pp2 x dp2
(ZeRO layout, full recompute: recomputed ops in the stages' backward graphs), and GPT-2 on
4 layers interleaved; 3 AdamW steps each, losses equal the single-process
reference (rtol 1e-4, fp32) and parameters stay close (atol 1e-3). Price = run per rank:
the collectives the stage graphs run per step equal what the stages' ILP solutions priced.
"""

from __future__ import annotations

import pytest
import torch

from autopar.config import ParallelConfig as C
from autopar.runtime.jobs import TrainJob, reference_run, train_worker
from autopar.runtime.launch import spawn

pytestmark = pytest.mark.dist

ZOO_LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=16"
CASES = {
    "hf-gpt2 pp2xtp2 1f1b": ("hf_factories:gpt2", C(pp=2, tp=2, schedule="1f1b")),
    "zoo-llama pp2xtp2 gpipe": (ZOO_LLAMA, C(pp=2, tp=2, schedule="gpipe")),
    "zoo-llama pp2xdp2 zero1 recompute 1f1b": (ZOO_LLAMA, C(pp=2, dp=2, zero=1, recompute="full", schedule="1f1b")),
    "hf-gpt2-4 pp2xtp2 interleaved": ("hf_factories:gpt2_4layers",
                                      C(pp=2, tp=2, schedule="interleaved", interleave=2)),
}
BATCH = 8


def _jobs_worker(rank: int, jobs: tuple[TrainJob, ...]) -> list:
    return [train_worker(rank, job) for job in jobs]


@pytest.fixture(scope="module")
def runs():
    jobs = tuple(TrainJob(model=model, configs=(config,), steps=3, global_batch=BATCH, return_parameters=True)
                 for model, config in CASES.values())
    results = spawn(_jobs_worker, 4, (jobs,))
    return {name: ([results[r][j][0] for r in range(4)], reference_run(job))
            for j, (name, job) in enumerate(zip(CASES, jobs))}


@pytest.mark.parametrize("case", CASES)
def test_losses_and_parameters_match_the_reference(runs, case):
    per_rank, (ref_losses, ref_params) = runs[case]
    losses = per_rank[0].losses
    assert all(r.losses == losses for r in per_rank), "every rank reports the same global loss"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    merged: dict[str, torch.Tensor] = {}
    for r in per_rank:
        merged.update(r.parameters)
    assert set(merged) <= set(ref_params)
    for missing in set(ref_params) - set(merged):  # only tied aliases, returned under their first name
        assert any(torch.equal(ref_params[missing], ref_params[name]) for name in merged), missing
    for name, value in merged.items():
        torch.testing.assert_close(value, ref_params[name], atol=1e-3, rtol=0, msg=name)


@pytest.mark.parametrize("case", CASES)
def test_price_equals_run(runs, case):
    per_rank, _ = runs[case]
    for rank, r in enumerate(per_rank):
        assert r.priced is not None and r.collectives, f"rank {rank}"
        assert r.collectives == r.priced, f"rank {rank}"


@pytest.mark.parametrize("case", [c for c in CASES if "tp2" in c])
def test_tp_splits_the_stages(runs, case):
    """tp 2 inside a stage: each rank holds well under its stage's whole parameters and
    the stage graphs communicate over tp."""
    per_rank, (_, ref_params) = runs[case]
    for r in per_rank:
        held = sum(v.numel() * v.element_size() for v in r.parameters.values())
        if held:
            assert r.parameter_bytes < 0.75 * held
        assert any(axis == "tp" for _, axis in r.collectives)
