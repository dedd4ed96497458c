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
from autopar.build import build_program
from autopar.plan import ProgramPlacements
from autopar.runtime.launch import RankFailure, spawn

pytestmark = [pytest.mark.dist, pytest.mark.alone]

MODEL = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16"


def _batch(world: int) -> tuple[torch.Tensor, ...]:
    return resolve(MODEL).example_inputs(world, generator=torch.Generator().manual_seed(1))


def _placed(world: int) -> str:
    """dp over `world` ranks, its placements solved before the ranks start (as `autopar train` does)."""
    from autopar.placing import program_placements

    return program_placements(resolve(MODEL).build(), ParallelConfig(dp=world), _batch(world)).dumps()


def _fail_mid_step(rank: int, failing_rank: int, how: str, stamp: str, placed: str) -> float:
    source = resolve(MODEL)
    torch.manual_seed(0)
    batch = _batch(torch.distributed.get_world_size())
    program = build_program(source.build(), ProgramPlacements.loads(placed), example_inputs=batch)
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
        spawn(_fail_mid_step, world, (1, how, str(stamp), _placed(world)), collective_timeout_s=120.0, grace_s=2.0)
    elapsed = time.time() - float(stamp.read_text())
    assert info.value.rank == 1
    expected = "injected failure" if how == "raise" else "exit code 7"
    assert expected in str(info.value)
    # 2 s grace + SIGTERM/SIGKILL; far below the 120 s collective timeout
    assert elapsed < 20.0


def test_gloo_timeout_releases_survivors(tmp_path):
    stamp = tmp_path / "failed_at"
    with pytest.raises(RankFailure) as info:
        spawn(_fail_mid_step, 2, (1, "raise", str(stamp), _placed(2)), collective_timeout_s=4.0, grace_s=120.0)
    elapsed = time.time() - float(stamp.read_text())
    assert info.value.rank == 1
    # the parent waited for the survivor (grace 120 s): it ended by its own 4 s gloo timeout
    assert elapsed < 40.0


def _slow_rank0_exchange(rank: int, use_build_exchange: bool) -> object:
    """Rank 0 works alone for 3 s (as it does solving the ILP) before sending its result;
    the world's collective timeout is 1 s."""
    import torch.distributed as dist

    from autopar.runtime.launch import gather_build_results

    if rank == 0:
        time.sleep(3.0)
    value = {"solved": [1, 2, 3]} if rank == 0 else None
    if use_build_exchange:
        return gather_build_results(value)[0]
    box = [value]
    dist.broadcast_object_list(box, src=0)  # bound by the 1 s collective timeout
    return box[0]


def test_build_exchange_outlasts_the_collective_timeout():
    """Ranks waiting for rank 0's solve are not bound by the step collective timeout: the
    same wait through a plain broadcast fails (the contrast shows the test can fail)."""
    got = spawn(_slow_rank0_exchange, 2, (True,), collective_timeout_s=1.0)
    assert got == [{"solved": [1, 2, 3]}] * 2
    with pytest.raises(RankFailure):
        spawn(_slow_rank0_exchange, 2, (False,), collective_timeout_s=1.0)


def _environment(rank: int, name: str) -> tuple[str | None, int, int]:
    return os.environ.get(name), os.getpid(), torch.get_num_threads()


def test_ranks_get_the_callers_environment_each_call(monkeypatch):
    """Ranks fork from a forkserver started once (autopar/runtime/launch.py): each call's
    ranks still see the caller's environment as it is at that call, not the server's."""
    name = "AUTOPAR_TEST_LAUNCH_ENV"
    monkeypatch.setenv(name, "first")
    first = spawn(_environment, 2, (name,))
    monkeypatch.setenv(name, "second")
    second = spawn(_environment, 2, (name,))
    monkeypatch.delenv(name)
    third = spawn(_environment, 2, (name,))
    assert [v for v, _, _ in first] == ["first"] * 2
    assert [v for v, _, _ in second] == ["second"] * 2
    assert [v for v, _, _ in third] == [None] * 2
    pids = {pid for r in (first, second, third) for _, pid, _ in r}
    assert len(pids) == 6 and os.getpid() not in pids  # a fresh process per rank and call
    assert all(threads == 1 for r in (first, second, third) for _, _, threads in r)


def _abort_in_native_code(rank: int) -> int:
    """Rank 1 dies of SIGABRT raised outside Python's error handling (as glibc's heap checks
    end a process): no Python exception, no `.err` file."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 1:
        _native_abort()
    dist.barrier()
    return rank


def _native_abort() -> None:
    os.abort()


def test_a_native_crash_names_the_line_it_crashed_at():
    with pytest.raises(RankFailure) as info:
        spawn(_abort_in_native_code, 2, (), collective_timeout_s=60.0, grace_s=2.0)
    message = str(info.value)
    assert info.value.rank == 1 and "exit code -6" in message
    # faulthandler wrote the crashing thread's stack; the parent quotes its innermost frames
    # and the fatal signal
    assert "it crashed (Aborted) at" in message and "_native_abort" in message and "test_rank_failure.py" in message
