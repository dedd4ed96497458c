"""Models people write, end to end on 4 gloo ranks: each searched (`autopar.api.search_plans`,
what `autopar search` runs), its plan trained for 3 steps (`train_worker`, what `autopar
train --plan` runs; every model's ranks in one set of processes), losses equal to the
single-process reference (rtol 1e-4) and price = run on every rank. The dict batch goes
through the CLI instead (`search --out`, then `train --plan --check`), and keyword-only
inputs through the Python API on 2 ranks.

Aliased parameters: one Parameter registered under two names (a masked-LM head whose bias
is its decoder's bias, tests/factories.py `shared_bias`, and Hugging Face's BERT, whose
`cls.predictions.bias` is `cls.predictions.decoder.bias`), and one module applied twice.
The tracer makes each aliased tensor one graph input with one gradient (autopar/trace/capture.py
`_merge_tied`): where only the alias is read, its gradient is the parameter's.

An encoder-decoder: Hugging Face T5 from a small config, searched and forced (dp4: the
decoder's shifted labels filled shard by shard, the cross-attention's broadcast bias whole;
autopar/dtensor_bridge.py project rules; the program runs ops without a DTensor rule on
whole inputs as themselves, codegen/apply.py).

Batches people pass: one dict (`model({"input_ids": ..., "labels": ...})`) and keyword-only
inputs (a factory returning (model, inputs, keyword inputs); `autopar.compile(...,
example_kwargs=...)` and `Compiled.step(**keywords)` in Python), split on the batch dim
(autopar/batch.py).

Buffers the forward updates in place (BatchNorm's running statistics and batch count, a
call counter): the program writes each new value back after every microbatch, and the
semantics are a single process's running the plan's microbatches (BatchNorm's batch
statistics over all rows of a microbatch, whatever the plan splits: SyncBatchNorm's over
data parallelism); the buffers after 3 steps equal the reference's, under the searched
plans and under forced plans of several microbatches per step.
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
from autopar.api import search_plans
from autopar.plan import Plan
from tests.parallel import place_jobs, pmap

pytestmark = pytest.mark.dist

STEPS = 3
BATCH = 8
SEARCHED = {
    "batchnorm-cnn": "tests.factories:batchnorm_cnn",
    "counting-mlp": "tests.factories:counting_mlp",
    "shared-bias": "tests.factories:shared_bias",
    "module-twice": "tests.factories:module_twice",
    "hf-bert": "tests.hf_factories:bert",
    "hf-t5": "tests.hf_factories:t5",
}
# Forced plans: several microbatches per step (BatchNorm's statistics then cover 2 rows per
# forward, the counter counts 4 forwards per step) and T5 under data parallelism
FORCED = {
    "batchnorm-cnn-tp4-mb2": ("tests.factories:batchnorm_cnn", C(tp=4, micro_batch=2)),
    "counting-mlp-dp4-mb1": ("tests.factories:counting_mlp", C(dp=4, micro_batch=1)),
    "hf-t5-dp4": ("tests.hf_factories:t5", C(dp=4, micro_batch=2)),
}
UPDATES_BUFFERS = {"tests.factories:batchnorm_cnn", "tests.factories:counting_mlp"}


def _worker(rank: int, jobs: tuple[TrainJob, ...]) -> list:
    return [train_worker(rank, job)[0] for job in jobs]


def _job(model: str, config: C, plan: str | None = None) -> TrainJob:
    m = BATCH // (config.dp * config.micro_batch)
    return TrainJob(model=model, configs=(config,), plans=(plan,), steps=STEPS, global_batch=BATCH,
                    return_parameters=True, reference_microbatches=m if model in UPDATES_BUFFERS else 1)


def _searched(model: str) -> str:
    return search_plans(model, "cpu:4", global_batch=BATCH, top=1).plan.dumps()


@pytest.fixture(scope="module")
def trained():
    jobs = {}
    for (name, model), text in zip(SEARCHED.items(), pmap(_searched, SEARCHED.values())):
        plan = Plan.loads(text)
        assert plan.config.pp == 1, (name, plan.config)
        jobs[name] = _job(model, plan.config, text)
    for name, (model, config) in FORCED.items():
        jobs[name] = _job(model, config)
    names = list(jobs)
    results = spawn(_worker, 4, (place_jobs(*(jobs[n] for n in names)),))
    return {n: (jobs[n], [results[r][k] for r in range(4)]) for k, n in enumerate(names)}


@pytest.mark.parametrize("name", list(SEARCHED) + list(FORCED))
def test_trains_like_one_process(trained, name):
    job, per_rank = trained[name]
    ref_losses, ref_state = reference_run(job)
    for rank, run in enumerate(per_rank):
        torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
        assert run.priced is not None and run.collectives == run.priced, (rank, run.collectives, run.priced)
    if job.model not in UPDATES_BUFFERS:
        return
    buffers = next(r.buffers for r in per_rank if r.buffers)
    for key, value in buffers.items():
        # atol 1e-3 as for parameters: the conv bias before BatchNorm gets a gradient of
        # rounding noise only, which AdamW turns into steps of +-lr, and the running mean
        # follows the bias (the losses agree to 1e-7)
        torch.testing.assert_close(value, ref_state[key], rtol=0, atol=1e-3, msg=key)
    forwards = STEPS * job.reference_microbatches
    if "calls" in buffers:
        assert int(buffers["calls"]) == forwards  # once per forward
    else:
        assert int(buffers["bn.num_batches_tracked"]) == forwards and float(buffers["bn.running_mean"].abs().sum()) > 0


def test_a_dict_batch_model_through_the_cli(tmp_path, capsys):
    model = "tests.factories:dict_batch"
    plan = str(tmp_path / "plan.json")
    assert cli.main(["search", model, "--cluster", "cpu:4", "--global-batch", str(BATCH), "--out", plan]) == 0
    capsys.readouterr()
    code = cli.main(["train", model, "--devices", "4", "--plan", plan, "--steps", str(STEPS), "--check", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["match"] and out["max_rel_loss_diff"] < 1e-4, out


def _compile_worker(rank: int) -> list[float]:
    import autopar
    from tests import factories

    model, _, keywords = factories.keyword_only()
    compiled = autopar.compile(model, "cpu:2", example_kwargs=keywords)
    return [compiled.step(**keywords) for _ in range(STEPS)]


def test_keyword_inputs_through_the_python_api():
    """`autopar.compile(model, mesh, example_kwargs=...)` searches and builds a forward with
    keyword-only arguments; `step(**keywords)` trains it like one process does."""
    from tests import factories

    losses = spawn(_compile_worker, 2)
    model, _, keywords = factories.keyword_only()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref = []
    for _ in range(STEPS):
        loss = model(**keywords)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(float(loss))
    for rank_losses in losses:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(ref), rtol=1e-4, atol=0)
