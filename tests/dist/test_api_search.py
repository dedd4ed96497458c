"""autopar.compile(model, mesh) with no plan and no config: it traces the model, searches a
plan with the cost model (the same on every rank), and trains it to the single-process losses."""

from __future__ import annotations

import functools

import pytest
import torch

from autopar.api import compile as ap_compile
from autopar.models import resolve
from autopar.runtime.launch import spawn
from tests.reference import reference_losses

pytestmark = pytest.mark.dist

LLAMA = "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,vocab=64,seq=16"
STEPS = 3


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return resolve(LLAMA).example_inputs(8, generator=torch.Generator().manual_seed(1))


def _reference() -> list[float]:
    torch.manual_seed(0)
    model = resolve(LLAMA).build()
    return reference_losses(model, _batch(), steps=STEPS, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))


def _worker(rank: int) -> dict:
    torch.manual_seed(0)
    model = resolve(LLAMA).build()
    batch = _batch()
    compiled = ap_compile(model, "cpu:4", example_inputs=batch)
    losses = [compiled.step(batch) for _ in range(STEPS)]
    return {"losses": losses, "config": compiled.config.to_json(), "plan": compiled.plan.dumps()}


def test_compile_without_plan_searches_and_matches_reference():
    results = spawn(_worker, 4)
    assert len({r["plan"] for r in results}) == 1  # every rank searched the same plan
    config = results[0]["config"]
    assert config["dp"] * config["tp"] * config["pp"] == 4
    expected = _reference()
    for r in results:
        assert r["losses"] == pytest.approx(expected, rel=1e-4)
