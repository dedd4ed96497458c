"""Models people write, end to end on 4 gloo ranks: `autopar search`, then `autopar train
--plan --check` for 3 steps, losses equal to the single-process reference (rtol 1e-4).

Aliased parameters: one Parameter registered under two names (a masked-LM head whose bias
is its decoder's bias, tests/factories.py `shared_bias`, and Hugging Face's BERT, whose
`cls.predictions.bias` is `cls.predictions.decoder.bias`), and one module applied twice.
The tracer makes each aliased tensor one graph input with one gradient (autopar/trace.py
`_merge_tied`): where only the alias is read, its gradient is the parameter's.
"""

from __future__ import annotations

import json

import pytest

from autopar import cli

pytestmark = pytest.mark.dist

STEPS = 3
MODELS = {
    "shared-bias": ("tests.factories:shared_bias", "8"),
    "module-twice": ("tests.factories:module_twice", "8"),
    "hf-bert": ("tests.hf_factories:bert", "8"),
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
