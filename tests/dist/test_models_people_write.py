"""Models people write, end to end on 4 gloo ranks: `autopar search`, then `autopar train
--plan --check` for 3 steps, losses equal to the single-process reference (rtol 1e-4).

Aliased parameters: one Parameter registered under two names (a masked-LM head whose bias
is its decoder's bias, tests/factories.py `shared_bias`, and Hugging Face's BERT, whose
`cls.predictions.bias` is `cls.predictions.decoder.bias`), and one module applied twice.
The tracer makes each aliased tensor one graph input with one gradient (autopar/trace.py
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
data parallelism); the buffers after 3 steps equal the reference's.
"""

from __future__ import annotations

import json

import pytest
import torch

from autopar import cli
from autopar.config import ParallelConfig as C
from autopar.runtime.jobs import TrainJob, reference_run, train_worker
from autopar.runtime.launch import spawn

pytestmark = pytest.mark.dist

STEPS = 3
MODELS = {
    "batchnorm-cnn": ("tests.factories:batchnorm_cnn", "8"),
    "counting-mlp": ("tests.factories:counting_mlp", "8"),
    "dict-batch": ("tests.factories:dict_batch", "8"),
    "keyword-only": ("tests.factories:keyword_only", "8"),
    "shared-bias": ("tests.factories:shared_bias", "8"),
    "module-twice": ("tests.factories:module_twice", "8"),
    "hf-bert": ("tests.hf_factories:bert", "8"),
    "hf-t5": ("tests.hf_factories:t5", "8"),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_search_then_train_matches_the_reference(name, tmp_path, capsys):
    model, batch = MODELS[name]
    plan = str(tmp_path / "plan.json")
    assert cli.main(["search", model, "--cluster", "cpu:4", "--global-batch", batch, "--out", plan]) == 0
    capsys.readouterr()
    code = cli.main(["train", model, "--devices", "4", "--plan", plan, "--steps", str(STEPS), "--check", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["match"], out
    assert len(out["losses"]) == STEPS and out["max_rel_loss_diff"] < 1e-4, out


# Forced plans with several microbatches per step (the searched ones run one): BatchNorm's
# statistics then cover 2 rows per forward, and the counter counts 4 forwards per step.
BUFFER_CASES = {
    "tests.factories:batchnorm_cnn": (C(tp=4, micro_batch=2), 4),
    "tests.factories:counting_mlp": (C(dp=4, micro_batch=1), 2),
}


def _worker(rank: int, jobs: tuple[TrainJob, ...]) -> list:
    return [train_worker(rank, job) for job in jobs]


def test_buffers_after_training_equal_the_reference():
    jobs = tuple(TrainJob(model=m, configs=(c,), steps=STEPS, global_batch=8, return_parameters=True,
                          reference_microbatches=micro) for m, (c, micro) in BUFFER_CASES.items())
    results = spawn(_worker, 4, (jobs,))
    for j, job in enumerate(jobs):
        ref_losses, ref_state = reference_run(job)
        run = results[0][j][0]
        torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
        assert run.buffers, f"{job.model}: no buffer came back"
        for name, value in run.buffers.items():
            # atol 1e-3 as for parameters: the conv bias before BatchNorm gets a gradient of
            # rounding noise only, which AdamW turns into steps of +-lr, and the running mean
            # follows the bias (the losses agree to 1e-7)
            torch.testing.assert_close(value, ref_state[name], rtol=0, atol=1e-3, msg=name)
    counter = results[0][1][0].buffers["calls"]
    assert int(counter) == STEPS * BUFFER_CASES["tests.factories:counting_mlp"][1]  # once per forward
    bn = results[0][0][0].buffers
    assert int(bn["bn.num_batches_tracked"]) == STEPS * 4 and float(bn["bn.running_mean"].abs().sum()) > 0


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


def test_t5_under_forced_data_parallelism(capsys):
    code = cli.main(["train", "tests.hf_factories:t5", "--devices", "4", "--dp", "4", "--steps", str(STEPS), "--check",
                     "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["match"] and out["max_rel_loss_diff"] < 1e-4, out
