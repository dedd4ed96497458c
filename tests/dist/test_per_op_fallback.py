"""An op with no sharding strategy and no decomposition (a user's custom op) still runs:
the strategy space offers it replicated only, with a warning naming the op and its module,
and the per-rank program computes it on whole tensors. 2 gloo ranks, data parallel; the
losses equal the single-process run's."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from autopar.api import compile as ap_compile
from autopar.config import ParallelConfig
from autopar.runtime.launch import spawn
from tests.reference import reference_losses

pytestmark = pytest.mark.dist


@torch.library.custom_op("autopar_test::odd_scale", mutates_args=())
def odd_scale(x: torch.Tensor) -> torch.Tensor:
    """x * 1.5 + 0.1: an op DTensor knows nothing about."""
    return x * 1.5 + 0.1


@odd_scale.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    return grad * 1.5


odd_scale.register_autograd(_backward)


class WithCustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 16)
        self.outer = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(odd_scale(self.inner(x)))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _reference(steps: int) -> list[float]:
    torch.manual_seed(0)
    return reference_losses(WithCustomOp(), _data(), steps=steps,
                            optimizer=functools.partial(torch.optim.SGD, lr=0.1), loss_fn=nn.functional.mse_loss)


def _worker(rank: int) -> dict:
    torch.manual_seed(0)
    # searched (no config): forced data parallelism cannot split the batch through an op that
    # needs whole inputs without gathering activations over dp, and says so (below)
    compiled = ap_compile(WithCustomOp(), 2, example_inputs=_data(), loss_fn=nn.functional.mse_loss,
                          optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    losses = [compiled.step(_data()) for _ in range(3)]
    try:
        ap_compile(WithCustomOp(), 2, example_inputs=_data(), loss_fn=nn.functional.mse_loss, config=ParallelConfig(dp=2))
        forced = ""
    except Exception as exc:  # noqa: BLE001 - the message is the point
        forced = f"{type(exc).__name__}: {exc}"
    return {"losses": losses, "forced": forced}


def test_op_without_strategy_runs_replicated(caplog):
    results = spawn(_worker, 2)
    expected = _reference(3)
    for r in results:
        assert r["losses"] == pytest.approx(expected, rel=1e-5)
        assert "InfeasiblePlanError" in r["forced"] and "autopar_test.odd_scale.default" in r["forced"], r["forced"]


def test_the_space_names_the_op_and_module(caplog):
    from autopar.trace import trace_step
    from solver.intra_op.space import enumerate_strategies

    _, graph = trace_step(WithCustomOp(), _data(), loss_fn=nn.functional.mse_loss)
    space = enumerate_strategies(graph, (2, 1))
    assert "autopar_test.odd_scale.default" in space.fallback_ops
    assert "autopar_test.odd_scale.default" in caplog.text
