"""The benchmarks' memory phase changes glibc's allocator in its own ranks only.

benchmarks/measure_cpu.py and measure_torchtitan.py measure memory in one set of ranks,
with glibc returning freed memory to the OS (mmap threshold 64 KiB), and time the programs
in a second set with glibc's defaults. Ranks are forks of one forkserver reused by every
spawn (autopar/runtime/launch.py), so a threshold set through the environment around the
first spawn reached the forkserver and every timed rank after it (steps measured 1.6-1.9x
slower).

A spawn whose environment changes such a variable after the forkserver started is refused
(autopar.runtime.launch.check_process_start_environment).

Read without timing: glibc's `mallinfo2().hblks` counts the live mmapped chunks. A 1 MiB
block malloc'd after one was freed is mmapped under the fixed 64 KiB threshold (hblks
>= 1) and comes from the heap under glibc's default, whose threshold rises to the size of
a freed mmapped chunk (hblks 0).
"""

from __future__ import annotations

import ctypes

import pytest

from autopar.runtime.launch import spawn

pytestmark = pytest.mark.dist

BLOCK = 1 << 20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mmapped_blocks_of_second_block() -> int:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = _Mallinfo2
    libc.free(libc.malloc(BLOCK))  # under glibc's default, this free raises the threshold past BLOCK
    before = libc.mallinfo2().hblks
    p = libc.malloc(BLOCK)
    after = libc.mallinfo2().hblks
    libc.free(p)
    return after - before


def _rank(rank: int, memory_phase: bool) -> int:
    if memory_phase:
        from benchmarks.measure_cpu import return_freed_memory_to_os  # the repository root: conftest.py

        return_freed_memory_to_os()
    return _mmapped_blocks_of_second_block()


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="needs glibc >= 2.33 (mallinfo2)")
def test_memory_phase_allocator_stays_out_of_later_timed_ranks():
    memory = spawn(_rank, 2, (True,))
    timed = spawn(_rank, 2, (False,))  # the same forkserver, as in the benchmarks
    assert memory == [1, 1], f"memory-phase ranks did not mmap a freed-and-reallocated 1 MiB block: {memory}"
    assert timed == [0, 0], (f"ranks spawned after the memory phase still mmap every 1 MiB block ({timed}): "
                             "the memory phase's allocator settings leaked into the timed ranks")


def test_spawn_refuses_a_process_start_variable_the_ranks_would_not_get(monkeypatch):
    """The environment route, refused before any rank starts: ranks are forks of the
    forkserver, so a glibc variable set for one later spawn would not reach its ranks (the
    server keeps the value it started with) and would silently not apply."""
    spawn(_rank, 1, (False,))  # the forkserver exists, started with this process's environment
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65543")
    with pytest.raises(ValueError, match=r"MALLOC_MMAP_THRESHOLD_=65543 \(ranks have .*mallopt"):
        spawn(_rank, 1, (False,))
    monkeypatch.undo()
    assert spawn(_rank, 1, (False,)) == [0]  # the server's environment again: accepted
