"""A rank that dies or hangs ends the job with an error naming it, within a bound.

- `autopar train` (in-process `cli.main`, ranks spawned from here) with rank 1 killed in
  the middle of step 2 (os._exit, no Python error): exit code 1, the message names rank 1,
  every rank gone in well under 60 s.
- A rank that hangs (alive, but never joins the next collective) on a PP2 x DP2 mesh: its
  peers wait in *subgroup* collectives (pipeline send/recv on "pp", the gradient
  all-reduce on "dp"), which must honour the job's collective timeout (torch would give
  subgroups a 30-minute default); the parent then names the hung rank, not the ranks that
  timed out waiting for it.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

from autopar import cli
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.build import build_program
from autopar.plan import ProgramPlacements
from autopar.runtime.launch import RankFailure, spawn

pytestmark = [pytest.mark.dist, pytest.mark.alone]

FAULT_ENV = "AUTOPAR_TEST_FAULT"
"""'<rank>:<forward call>:<stamp file>': that rank exits with code 9 at that forward call."""


class _Dying(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.calls = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        rank, call, stamp = os.environ[FAULT_ENV].split(":", 2)
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == int(rank) \
                and self.calls == int(call):
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            os._exit(9)
        return nn.functional.mse_loss(self.net(x), y)


def dying_model() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A factory for `autopar train <this module>:dying_model`."""
    g = torch.Generator().manual_seed(0)
    return _Dying(), (torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))


def test_train_cli_rank_killed_mid_step(tmp_path, monkeypatch, capsys):
    stamp = tmp_path / "killed_at"
    monkeypatch.setenv(FAULT_ENV, f"1:2:{stamp}")
    code = cli.main(["train", f"{__name__}:dying_model", "--devices", "2", "--steps", "3"])
    ended = time.time()
    err = capsys.readouterr().err
    assert code == 1, err
    assert "rank 1 failed" in err and "exit code 9" in err and "all ranks stopped" in err
    assert ended - float(stamp.read_text()) < 60.0


GPT = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16"


HUNG_CONFIG = ParallelConfig(pp=2, dp=2, schedule="gpipe")


def _hung_batch() -> tuple[torch.Tensor, ...]:
    return resolve(GPT).example_inputs(4, generator=torch.Generator().manual_seed(1))


def _hang_in_step_2(rank: int, stamp: str, placed: str) -> None:
    torch.manual_seed(0)
    batch = _hung_batch()
    program = build_program(resolve(GPT).build(), ProgramPlacements.loads(placed), example_inputs=batch)
    program.step(batch)
    if rank == 1:
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
        time.sleep(600)  # alive, but never joins step 2
    program.step(batch)


def test_hung_rank_is_named_and_peers_time_out(tmp_path):
    from autopar.placing import program_placements

    stamp = tmp_path / "hung_at"
    placed = program_placements(resolve(GPT).build(), HUNG_CONFIG, _hung_batch()).dumps()  # before the ranks, as train
    with pytest.raises(RankFailure) as info:
        spawn(_hang_in_step_2, 4, (str(stamp), placed), collective_timeout_s=5.0, grace_s=5.0)
    elapsed = time.time() - float(stamp.read_text())
    assert info.value.rank == 1, str(info.value)
    assert "rank 1 hung" in str(info.value) and "gave up" in str(info.value)
    # the hung rank's stack, asked for before it was stopped, says where it was
    assert "its main thread was at" in str(info.value) and "_hang_in_step_2" in str(info.value), str(info.value)
    # 5 s collective timeout + 5 s grace + teardown; never torch's 30-minute subgroup default
    assert elapsed < 40.0
