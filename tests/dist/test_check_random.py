"""`autopar train FACTORY --check` on a model with dropout: the check passes on a correct
plan and fails (exit 3) on a broken one.

The model is GPT-2 from a Hugging Face config with its default dropout 0.1
(tests/factories.py). Without help the parallel run and the reference draw different masks
and never match; the launcher finds the random ops in the traced step and both runs draw
them from the same fixed field (autopar/determinism.py), which the output says. The broken
program is dp2 with one gradient left out of the gradient sync, broken by this test inside
each rank (`_train_worker_leaving_one_gradient_unsynced`, run in place of the CLI's
`train_worker`): each rank steps that parameter with its own half-batch gradient, the
ranks' copies drift apart and the loss leaves the reference's. The CLI, the reference and
the comparison are the product's own.
"""

from __future__ import annotations

import json

import pytest

from autopar import cli
from autopar.commands import train as train_command
from autopar.commands.train import EXIT_CHECK_MISMATCH
from autopar.build import train_worker

pytestmark = pytest.mark.dist
pytest.importorskip("transformers", reason="transformers not installed (extra 'test')")

FACTORY = "tests.factories:hf_gpt2_dropout"
TIED_EMBEDDING = "lm.transformer.wte.weight"
"""The parameter whose gradient the broken program does not sync (embedding and head)."""


def _train_worker_leaving_one_gradient_unsynced(rank: int, job):
    """`train_worker` on a program whose TIED_EMBEDDING gradient skips the gradient sync:
    `SpmdProgram.set_gradients` is wrapped here, in the rank's own process (a monkeypatch in
    the test's process does not reach the spawned ranks), so the parameter's `.grad` is this
    rank's own accumulated gradient instead of the all-reduced one."""
    from autopar.runtime.program import gradient_for
    from autopar.runtime.spmd import SpmdProgram

    synced_set = SpmdProgram.set_gradients

    def set_gradients(self, raw):
        # the raw gradients exist apart only where the step does not sync during its
        # backward: more than one microbatch per step (4 rows, dp 2, micro-batch 1)
        assert self.graphs.grad_sync is not None, "the step synced its gradients itself: nothing to leave out"
        names = [name for name, _, _ in self.graphs.grads]
        own = raw[names.index(TIED_EMBEDDING)].clone()
        grad_bytes = synced_set(self, raw)
        param = self._params[TIED_EMBEDDING]
        param.grad = gradient_for(param, own.to(param.dtype))
        return grad_bytes

    SpmdProgram.set_gradients = set_gradients
    return train_worker(rank, job)


def test_check_passes_on_dp2_with_dropout(capsys):
    code = cli.main(["train", FACTORY, "--devices", "2", "--steps", "2", "--check", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out
    assert out["random_ops"] == {"aten.native_dropout.default": 7} and out["deterministic_random"] is True
    assert out["match"] and out["max_rel_loss_diff"] < 1e-4
    assert out["losses"][1] < out["losses"][0]  # it trains


def test_check_passes_on_tp2_with_dropout(capsys):
    code = cli.main(["train", FACTORY, "--devices", "2", "--tp", "2", "--steps", "2", "--check", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["deterministic_random"] and out["match"], out


def test_broken_program_fails_the_check(capsys, monkeypatch):
    spawned = []

    def spawn(fn, world_size, args=(), **kwargs):
        assert fn is train_worker  # what `autopar train` runs on each rank, replaced by the broken one
        spawned.append(world_size)
        return real_spawn(_train_worker_leaving_one_gradient_unsynced, world_size, args, **kwargs)

    real_spawn = train_command.spawn
    monkeypatch.setattr(train_command, "spawn", spawn)
    code = cli.main(["train", FACTORY, "--devices", "2", "--steps", "2", "--check"])
    out = capsys.readouterr().out
    assert spawned == [2], out
    assert code == EXIT_CHECK_MISMATCH == 3, out
    assert "random ops in the traced step: aten.native_dropout.default x7; both runs drew them deterministically" in out
    assert "check: MISMATCH" in out
