"""Pipelines of models the family tables do not know: Hugging Face GPT-2 cut at its blocks.

autopar/runtime/pipe_spmd.py cuts a model at its repeated layer stack with torch's pipeline tracer,
compiles every chunk by the per-op path on its (dp, tp) submesh and runs the chunks with
torch's schedules. Checked against the single-process reference (same seed, data,
AdamW): losses to rtol 1e-4 on every rank, parameters to atol 1e-3, the tied
embedding/head held on the first and last pp ranks equal on both. The configurations
cover GPipe over 4 stages (values the embedding makes relayed through two stages), 1F1B
with dp 2 under ZeRO-2 (the stages' gradients reduce-scattered every microbatch; the plain
data-parallel layout of pipeline stages is tests/dist/test_mixed_precision.py's), and interleaved 1F1B with ZeRO 3; the CLI cases are the forced `--pp 2` plan of `autopar train --check`
for GPT-2 and Llama (whose rotary embedding, made before the first layer, crosses the
cut). tests/dist/test_pipeline_per_op.py has tp inside the stages.
"""

from __future__ import annotations

import json

import pytest
import torch

from autopar import cli
from autopar.config import ParallelConfig as C
from autopar.build import train_worker
from autopar.runtime.jobs import TrainJob, reference_run
from autopar.runtime.launch import spawn
from tests.parallel import place_jobs

pytestmark = pytest.mark.dist

GPT2_4 = "tests.hf_factories:gpt2_4layers"
CONFIGS = {
    "pp4_gpipe": C(pp=4, schedule="gpipe"),
    "pp2xdp2_zero2_1f1b": C(pp=2, dp=2, zero=2, schedule="1f1b"),
    "pp2xdp2_zero3_interleaved": C(pp=2, dp=2, zero=3, schedule="interleaved", interleave=2),
}
TIED = "hf.transformer.wte.weight"  # canonical name of the tied embedding / head


def _jobs_worker(rank: int, jobs: tuple[TrainJob, ...]) -> list:
    return [train_worker(rank, job) for job in jobs]


@pytest.fixture(scope="module")
def world4():
    jobs = (TrainJob(model=GPT2_4, configs=tuple(CONFIGS.values()), steps=2, return_parameters=True),)
    results = spawn(_jobs_worker, 4, (place_jobs(*jobs),))
    return [[results[r][j] for r in range(4)] for j in range(len(jobs))], [reference_run(job) for job in jobs]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_gpt2_pipeline_matches_reference(world4, name):
    per_rank, (ref_losses, ref_params) = world4[0][0], world4[1][0]
    index = list(CONFIGS).index(name)
    results = [r[index] for r in per_rank]
    for r in results:
        torch.testing.assert_close(torch.tensor(r.losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    merged: dict[str, torch.Tensor] = {}
    tied_copies = []
    for r in results:
        if TIED in r.parameters:
            tied_copies.append(r.parameters[TIED])
        merged.update(r.parameters)
    assert set(ref_params) - set(merged) == {"hf.lm_head.weight"}  # the tied alias, under its canonical name
    for param, value in merged.items():
        torch.testing.assert_close(value, ref_params[param], atol=1e-3, rtol=0, msg=param)
    assert len(tied_copies) == 2, "the first and last pp ranks each hold the tied embedding/head"
    torch.testing.assert_close(tied_copies[0], tied_copies[1], atol=0, rtol=0)


@pytest.mark.parametrize("factory", ["gpt2", "llama"])
def test_cli_forced_pp2_trains_like_the_reference(factory, capsys):
    argv = ["train", f"tests.hf_factories:{factory}", "--devices", "2", "--pp", "2", "--steps", "2", "--check",
            "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["match"] is True and out["config"]["pp"] == 2
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(out["reference_losses"]), rtol=1e-4, atol=0)
