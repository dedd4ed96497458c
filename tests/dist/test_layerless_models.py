"""Models without a repeated layer stack compile, search and train on 2 gloo processes.

A plain MLP of distinct layers, a small CNN and an embedding + linear head
(tests/factories.py) have 0 layers: the search plans them as one pipeline stage holding
everything (stage_layers [0], pp = 1), and each trains through the decorator form (on a
class and on factories; the function form is the same `_compile_module` call) and the CLI
factory form (`search`, then `train --plan --check`), with losses equal to the
single-process reference. The plans themselves: tests/unit/test_layerless_plan.py.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

import autopar
from autopar import cli
from autopar.runtime.launch import spawn
from tests import factories
from tests.reference import reference_losses

pytestmark = pytest.mark.dist

STEPS = 3


@autopar.compile(mesh="cpu:2", example_inputs=factories.mlp_batch())
class CompiledMLP(factories.MLP):
    """The decorator on a module class: constructing it compiles it."""


@autopar.compile(mesh="cpu:2")
def compiled_cnn():
    return factories.cnn()


@autopar.compile(mesh="cpu:2")
def compiled_embedding_head():
    return factories.embedding_head()


def _reference(factory) -> list[float]:
    model, batch = factory()
    # autopar.compile's default optimizer
    return reference_losses(model, batch, steps=STEPS, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))


def _worker(rank: int) -> dict[str, dict]:
    out = {}
    torch.manual_seed(0)  # the class form builds its model itself: same init as factories.mlp()
    runs = {"mlp": (CompiledMLP(), factories.mlp_batch()), "cnn": (compiled_cnn(), factories.cnn()[1]),
            "embedding_head": (compiled_embedding_head(), factories.embedding_head()[1])}
    for name, (compiled, batch) in runs.items():
        plan = compiled.plan
        out[name] = {"losses": [compiled.step(batch) for _ in range(STEPS)], "num_layers": plan.num_layers,
                     "stage_layers": plan.stage_layers, "config": compiled.config}
    return out


def test_layerless_models_train_through_the_decorator_form():
    results = spawn(_worker, 2)
    references = {"mlp": factories.mlp, "cnn": factories.cnn, "embedding_head": factories.embedding_head}
    for name, factory in references.items():
        got = results[0][name]
        assert results[1][name]["losses"] == got["losses"]
        assert got["num_layers"] == 0 and got["stage_layers"] == (0,) and got["config"].pp == 1, got
        assert got["config"].dp * got["config"].tp == 2
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(_reference(factory)), rtol=1e-4, atol=0)


def test_layerless_model_through_the_cli(tmp_path, capsys):
    plan = str(tmp_path / "plan.json")
    assert cli.main(["search", "tests.factories:mlp", "--cluster", "cpu:2", "--global-batch", "8", "--out", plan]) == 0
    assert json.loads(open(plan).read())["stage_layers"] == [0]
    capsys.readouterr()
    code = cli.main(["train", "tests.factories:mlp", "--devices", "2", "--plan", plan, "--steps", str(STEPS),
                     "--check", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["match"] and out["random_ops"] == {} and not out["deterministic_random"], out
