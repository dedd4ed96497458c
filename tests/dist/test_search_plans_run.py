"""Every plan `autopar search` ranks runs: the top 5 plans for a zoo model and for a
Hugging Face model (GPT-2 from a config, with dropout: `--check` draws the masks
deterministically) each train on real gloo ranks with `autopar train --plan P --check`, the
losses matching the single-process reference, and for one-stage (per-op) plans the
collectives each program ran equal to those its plan priced. Pipelines (pp > 1) run the
module-level program today (autopar/capabilities.py), which reports no per-op
collectives; the factory model is never given one."""

from __future__ import annotations

import json

import pytest

from autopar import cli
from autopar.api import search_plans

pytestmark = pytest.mark.dist

CASES = [
    ("llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,vocab=64,seq=16", 8),
    ("tests.factories:hf_gpt2_dropout", None),
]


@pytest.mark.parametrize("model, global_batch", CASES, ids=["zoo-llama", "hf-gpt2"])
def test_top5_plans_train_and_match(model, global_batch, tmp_path, capsys):
    if model.startswith("tests.factories:hf"):
        pytest.importorskip("transformers", reason="transformers not installed (extra 'test')")
        from tests.factories import hf_gpt2_dropout

        global_batch = int(hf_gpt2_dropout()[1][0].shape[0])
    result = search_plans(model, "cpu:4", global_batch=global_batch, top=5)
    assert len(result.plans) == len(result.ranked) >= 2
    assert result.plans[0] is result.plan
    meshes = set()
    for i, plan in enumerate(result.plans):
        assert plan.config == result.ranked[i].config and (plan.placements or plan.config.pp > 1)
        if model.startswith("tests.factories:") and plan.config.pp > 1:
            assert plan.config.tp == 1, plan.config  # a factory's pipeline runs data-parallel stages
        meshes.add((plan.config.dp, plan.config.tp))
        path = tmp_path / f"plan{i}.json"
        plan.save(path)
        capsys.readouterr()
        code = cli.main(["train", model, "--devices", "4", "--plan", str(path), "--steps", "2", "--check", "--json"])
        out = json.loads(capsys.readouterr().out)
        assert code == 0 and out["match"], (i, plan.config, out)
        if plan.config.pp == 1:
            assert out["price_equals_run"], (i, plan.config, out)
    assert len(meshes) >= 2, meshes  # the ranked plans are not one mesh
