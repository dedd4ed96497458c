"""autopar.compile inside spawned ranks: function and decorator forms, a user model of
unknown structure, `.code`, and a torch.distributed.checkpoint round trip."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from autopar.api import compile as ap_compile
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.runtime.launch import spawn
from tests.reference import reference_losses

pytestmark = pytest.mark.dist

GPT = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16"


class TwoLayer(nn.Module):
    """A user model: returns outputs, the loss comes from loss_fn."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _reference_user_losses(steps: int) -> list[float]:
    torch.manual_seed(0)
    return reference_losses(TwoLayer(), _data(), steps=steps, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                            loss_fn=nn.functional.mse_loss)


def _worker(rank: int, ckpt_dir: str) -> dict:
    import torch.distributed.checkpoint as dcp

    source = resolve(GPT)
    batch = source.example_inputs(4, generator=torch.Generator().manual_seed(1))
    config = ParallelConfig(tp=2, dp=2)
    torch.manual_seed(0)
    compiled = ap_compile(source.build(), "cpu:4", example_inputs=batch, config=config)
    losses = [compiled.step(batch) for _ in range(2)]
    # batch 4 on dp 2 at micro-batch 1: two microbatches per step
    counts = (compiled.program.collectives_per_step(2), compiled.program.priced, "_c10d_functional" in
              compiled.code["stage0"])
    dcp.save(compiled.state_dict(), checkpoint_id=ckpt_dir)

    @ap_compile(mesh=4, config=config)
    def factory():
        torch.manual_seed(123)  # different init: the checkpoint must overwrite it
        return source.build(), batch

    restored = factory()
    state = restored.state_dict()
    dcp.load(state, checkpoint_id=ckpt_dir)
    restored.load_state_dict(state)
    after = (compiled.step(batch), restored.step(batch))

    torch.manual_seed(0)
    user = ap_compile(TwoLayer(), 4, example_inputs=_data(), loss_fn=nn.functional.mse_loss,
                      optimizer=functools.partial(torch.optim.SGD, lr=0.1), config=ParallelConfig(dp=4, zero=3))
    user_losses = [user.step(_data()) for _ in range(2)]
    with torch.profiler.profile() as prof:  # the step's phases are named in profiler traces
        user_losses.append(user.step(_data()))
    phases = sorted({e.name for e in prof.events() if e.name.startswith("autopar::")})
    torch.manual_seed(0)
    user_tp = ap_compile(TwoLayer(), 4, example_inputs=_data(), loss_fn=nn.functional.mse_loss,
                         optimizer=functools.partial(torch.optim.SGD, lr=0.1), config=ParallelConfig(tp=2, dp=2))
    user_tp_losses = [user_tp.step(_data()) for _ in range(3)]
    tp_sharded = [n for n, p in user_tp.program.model.named_parameters()
                  if any(getattr(pl, "dim", None) is not None for pl in p.placements[1:])]
    return {"losses": losses, "counts": counts, "after": after, "user_losses": user_losses,
            "user_tp_losses": user_tp_losses, "user_tp_sharded": tp_sharded, "phases": phases}


def test_compile_in_spawned_ranks(tmp_path):
    results = spawn(_worker, 4, (str(tmp_path / "ckpt"),))
    r0 = results[0]
    for r in results:
        assert r["losses"] == r0["losses"] and r["user_losses"] == r0["user_losses"]
    # same step on the original and on the checkpoint-restored program: same loss
    for r in results:
        assert r["after"][0] == pytest.approx(r["after"][1], rel=1e-6)
    # the single-process reference for the GPT part
    torch.manual_seed(0)
    source = resolve(GPT)
    model = source.build()
    batch = source.example_inputs(4, generator=torch.Generator().manual_seed(1))
    ref = reference_losses(model, batch, steps=2, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(ref), rtol=1e-4, atol=0)
    torch.testing.assert_close(torch.tensor(r0["user_losses"]), torch.tensor(_reference_user_losses(3)),
                               rtol=1e-4, atol=0)
    # a user model of unknown structure on dp 2 x tp 2: the per-op program (any model, no rule
    # table) trains like the reference, with some parameter split over tp
    torch.testing.assert_close(torch.tensor(r0["user_tp_losses"]), torch.tensor(_reference_user_losses(3)),
                               rtol=1e-4, atol=0)
    # price = run: the collectives in the GPT's per-rank program are those the ILP priced,
    # and tensor parallelism put some on the tp axis
    ran, priced, code_has_collectives = r0["counts"]
    assert priced is not None and ran == priced and code_has_collectives
    assert any(axis == "tp" for _, axis in ran), ran
    assert r0["phases"] == ["autopar::accumulate", "autopar::gather_weights", "autopar::grad_sync",
                            "autopar::loss_report", "autopar::microbatch", "autopar::optimizer"]
