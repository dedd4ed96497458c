"""A rank that fails mid-step must not hang the job: every rank exits within a bound.

Two mechanisms, one test each: the spawning parent notices a dead child and stops the
rest (grace, then SIGTERM/SIGKILL); and, without that help (a long grace), gloo's
collective timeout (`init_process_group(timeout=...)`) makes the survivors raise on
their own.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.runtime import build_program
from autopar.runtime_launch import RankFailure, spawn

pytestmark = pytest.mark.dist

MODEL = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16"


def _fail_mid_step(rank: int, failing_rank: int, how: str, stamp: str) -> float:
    source = resolve(MODEL)
    torch.manual_seed(0)
    world = torch.distributed.get_world_size()
    batch = source.example_inputs(world, generator=torch.Generator().manual_seed(1))
    program = build_program(source.build(), ParallelConfig(dp=world), example_inputs=batch)
    loss = program.step(batch)  # a healthy step first: the process group works
    if rank == failing_rank:
        with open(stamp, "w") as f:  # when the failure happens (start-up time excluded)
            f.write(repr(time.time()))
        if how == "raise":
            raise RuntimeError("injected failure in the middle of step 2")
        os._exit(7)  # a crash without a Python error
    program.step(batch)  # the survivors block in the gradient all-reduce
    return loss


@pytest.mark.parametrize("how,world", [("raise", 4), ("crash", 2)])
def test_parent_stops_every_rank(how, world, tmp_path):
    stamp = tmp_path / "failed_at"
    with pytest.raises(RankFailure) as info:
        spawn(_fail_mid_step, world, (1, how, str(stamp)), collective_timeout_s=120.0, grace_s=2.0)
    elapsed = time.time() - float(stamp.read_text())
    assert info.value.rank == 1
    expected = "injected failure" if how == "raise" else "exit code 7"
    assert expected in str(info.value)
    # 2 s grace + SIGTERM/SIGKILL; far below the 120 s collective timeout
    assert elapsed < 20.0


def test_gloo_timeout_releases_survivors(tmp_path):
    stamp = tmp_path / "failed_at"
    with pytest.raises(RankFailure) as info:
        spawn(_fail_mid_step, 2, (1, "raise", str(stamp)), collective_timeout_s=4.0, grace_s=120.0)
    elapsed = time.time() - float(stamp.read_text())
    assert info.value.rank == 1
    # the parent waited for the survivor (grace 120 s): it ended by its own 4 s gloo timeout
    assert elapsed < 40.0
