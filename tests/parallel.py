"""The dist tests' parent-side work, spread over the machine's cores.

Before a fixture's ranks start, its parent process solves every configuration's per-op
placements (autopar/placing.py `place_job`: a trace and an ILP solve each, single-threaded)
and some fixtures search plans first. That work ran one configuration after another on one
core while the other idled: 35 of the 242 s of test_train_numerics.py and
test_mixed_precision.py together, measured. `pmap` runs such calls in worker processes
forked from the ranks' forkserver (torch and the runtime already imported:
autopar/runtime/launch.py `PRELOAD`), so a worker starts in a fraction of a second, and
`place_jobs` places each configuration of each job as its own task. A worker, like a
rank, has the forkserver's environment, not the caller's (autopar/runtime/launch.py): what it
runs here reads none.

The solve is deterministic across processes (tests/unit/test_search.py
test_plan_json_is_byte_identical_across_processes), so the placements equal those placed
in the parent.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any, Callable, Iterable

from autopar.placing import place_job
from autopar.runtime.launch import PRELOAD

WORKERS = min(2, os.cpu_count() or 1)


def forkserver_context() -> Any:
    """The multiprocessing context the ranks are forked from (autopar/runtime/launch.py `spawn`)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def pmap(fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
    """[fn(item) for item in items], in WORKERS forkserver processes where there are
    several items (`fn` and the items picklable, `fn` importable)."""
    items = list(items)
    if len(items) < 2 or WORKERS < 2:
        return [fn(item) for item in items]
    with ProcessPoolExecutor(max_workers=WORKERS, mp_context=forkserver_context()) as pool:
        return list(pool.map(fn, items))


def _place_one(task: tuple[Any, int]) -> str:
    job, i = task
    one = replace(job, configs=(job.configs[i],), plans=job.plans[i:i + 1], stage_layers=job.stage_layers[i:i + 1])
    return place_job(one).placements[0]


def place_jobs(*jobs: Any) -> tuple[Any, ...]:
    """Each job (autopar/runtime/jobs.py TrainJob) as `place_job` returns it, its
    configurations placed in parallel (module docstring)."""
    tasks = [(job, i) for job in jobs for i in range(len(job.configs))]
    placed = iter(pmap(_place_one, tasks))
    return tuple(replace(job, placements=tuple(next(placed) for _ in job.configs)) for job in jobs)
