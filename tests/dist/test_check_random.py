"""`autopar train FACTORY --check` on a model with dropout: the check passes on a correct
plan and fails (exit 3) on a broken one.

The model is GPT-2 from a Hugging Face config with its default dropout 0.1
(tests/factories.py). Without help the parallel run and the reference draw different masks
and never match; the launcher finds the random ops in the traced step and both runs draw
them from the same fixed field (autopar/determinism.py), which the output says. The broken
plan is dp2 with one gradient left out of the all-reduce (the runtime's test-only hook
AUTOPAR_TEST_DROP_GRAD_SYNC): the ranks' copies of that parameter drift apart and the loss
leaves the reference's.
"""

from __future__ import annotations

import json

import pytest

from autopar import cli
from autopar.commands.train import EXIT_CHECK_MISMATCH

pytestmark = pytest.mark.dist
pytest.importorskip("transformers", reason="transformers not installed (extra 'test')")

FACTORY = "tests.factories:hf_gpt2_dropout"
TIED_EMBEDDING = "lm.transformer.wte.weight"
"""The parameter whose gradient the broken plan does not all-reduce (embedding and head)."""


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


def test_broken_plan_fails_the_check(capsys, monkeypatch):
    monkeypatch.setenv("AUTOPAR_TEST_DROP_GRAD_SYNC", TIED_EMBEDDING)
    code = cli.main(["train", FACTORY, "--devices", "2", "--steps", "2", "--check"])
    out = capsys.readouterr().out
    assert code == EXIT_CHECK_MISMATCH == 3, out
    assert "random ops in the traced step: aten.native_dropout.default x7; both runs drew them deterministically" in out
    assert "check: MISMATCH" in out
