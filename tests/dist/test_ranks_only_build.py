"""Ranks only build and run: each traces its model once and never enters the solver.

The per-op placements are decided before any rank builds (autopar/placing.py); a rank traces
its step once, applies them and trains (autopar/build/). Checked on real gloo ranks, counted
inside each rank's own process (a monkeypatch in the test's process does not reach the
ranks, which are forks of a forkserver; `_instrument` runs in the rank):
- traces: calls of `autopar.trace.trace`, which every trace of a step or a pipeline chunk
  goes through (`trace_step`, `trace_stage`; torch's pipeline tracer, which cuts a
  pipeline's model into its chunks before they are traced, is not counted);
- the solver: a `sys.meta_path` finder records every import of a `solver` module in the
  rank (none is preloaded: the rank's solver modules are those it imported), and, where
  the solver was imported before the build (rank 0 of `autopar.compile(model, mesh)`,
  which searches the plan), a profile hook records every call of a function defined under
  solver/ during the build.
For `autopar train --plan p.json` (a saved plan, its placements read), `autopar train` with
configuration flags (solved once in the launcher) and `autopar.compile(model, mesh)` (rank 0 searches the plan, as the API does inside ranks;
every rank then builds from it) and `autopar.compile(model, mesh, plan=...)`.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from autopar import cli
from autopar.commands import train as train_command
from autopar.models import resolve
from autopar.runtime.launch import spawn
from tests.reference import reference_losses

pytestmark = pytest.mark.dist

SOLVER_DIR = str(Path(__file__).resolve().parents[2] / "solver")
MODEL = "gpt-tiny"
STEPS = 3


class _SolverImports:
    """A meta-path finder that records the `solver` modules a process imports (finds none itself)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.split(".")[0] == "solver":
            self.names.append(name)
        return None


def _instrument() -> dict[str, Any]:
    """In the rank: count `autopar.trace.trace` calls and record solver imports from now on."""
    import importlib

    tracer = importlib.import_module("autopar.trace")  # the module (`autopar.trace` is also a re-exported function)
    counts: dict[str, Any] = {"traces": 0, "solver_loaded": sorted(m for m in sys.modules
                                                                  if m.split(".")[0] == "solver")}
    real = tracer.trace

    def counting(*args: Any, **kwargs: Any) -> Any:
        counts["traces"] += 1
        return real(*args, **kwargs)

    # every module holding the function by name (autopar.trace, and the build's chunk tracer
    # that imported it); a module imported later takes `counting` from autopar.trace
    for module in list(sys.modules.values()):
        if getattr(module, "trace", None) is real:
            module.trace = counting
    finder = _SolverImports()
    sys.meta_path.insert(0, finder)
    counts["finder"] = finder
    return counts


def _solver_calls_during(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """`fn()` and the functions defined under solver/ it called (a profile hook)."""
    called: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(SOLVER_DIR):
            called.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, called


def _report(counts: dict[str, Any], out_dir: str, rank: int, **extra: Any) -> None:
    finder = counts.pop("finder")
    counts["solver_imported"] = sorted(set(finder.names))
    Path(out_dir, f"{rank}.json").write_text(json.dumps({**counts, **extra}))


def _counting_train_worker(out_dir: str, rank: int, job: Any) -> Any:
    """`autopar train`'s rank (autopar.build.train_worker), counted."""
    from autopar.build import train_worker

    counts = _instrument()
    results = train_worker(rank, job)
    _report(counts, out_dir, rank)
    return results


def _read(out_dir: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out_dir / f"{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("how", ["saved plan", "tp flags", "pp flags"])
def test_train_traces_once_per_rank_and_never_solves(how, tmp_path, monkeypatch, capsys):
    """`autopar train` with a saved plan (its placements read), or with configuration flags
    (solved once, in the launcher, before the ranks start: one-stage, and a two-stage pipeline
    whose ranks each trace their one chunk)."""
    if how == "saved plan":
        plan = tmp_path / "plan.json"
        assert cli.main(["search", MODEL, "--cluster", "cpu:2", "--global-batch", "4", "--max-pp", "1", "--json",
                         "--out", str(plan)]) == 0
        capsys.readouterr()
        given = ["--plan", str(plan)]
    else:
        given = ["--tp", "2"] if how == "tp flags" else ["--pp", "2", "--global-batch", "4"]
    real_spawn = train_command.spawn

    def spawn_counting(fn: Any, world_size: int, args: tuple = (), **kwargs: Any) -> Any:
        return real_spawn(functools.partial(_counting_train_worker, str(tmp_path)), world_size, args, **kwargs)

    monkeypatch.setattr(train_command, "spawn", spawn_counting)
    assert cli.main(["train", MODEL, "--devices", "2", "--steps", "2", *given, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["losses"]) == 2 and out.get("price_equals_run", True), out
    for rank, counts in enumerate(_read(tmp_path, 2)):
        assert counts["traces"] == 1, (rank, counts)
        assert counts["solver_loaded"] == [] and counts["solver_imported"] == [], (rank, counts)


def _batch() -> tuple[torch.Tensor, ...]:
    from autopar.models import resolve

    return resolve(MODEL).example_inputs(4, generator=torch.Generator().manual_seed(1))


def _compile_worker(rank: int, out_dir: str, plan_text: str | None) -> float:
    """`autopar.compile(model, 2, ...)` in the rank, counted: with `plan_text` the plan runs
    as given; without, rank 0 searches it (the API's search inside ranks) and every rank
    builds from it. The build's traces and solver calls are counted apart from the search's."""
    import autopar
    import autopar.build
    from autopar.models import resolve
    from autopar.plan import Plan

    counts = _instrument()
    real_build = autopar.build.build_program
    build: dict[str, Any] = {}

    def counting_build(*args: Any, **kwargs: Any) -> Any:
        before = counts["traces"]
        program, called = _solver_calls_during(lambda: real_build(*args, **kwargs))
        build.update(traces=counts["traces"] - before, solver_calls=sorted(set(called)))
        return program

    autopar.build.build_program = counting_build
    torch.manual_seed(0)
    plan = Plan.loads(plan_text) if plan_text is not None else None
    compiled = autopar.compile(resolve(MODEL).build(), 2, example_inputs=_batch(), plan=plan)
    losses = [compiled.step(_batch()) for _ in range(STEPS)]
    _report(counts, out_dir, rank, build=build, searched=plan is None, plan=compiled.plan.dumps())
    return losses


def test_compile_builds_each_rank_with_one_trace_and_no_solver(tmp_path):
    searched, given = tmp_path / "searched", tmp_path / "given"
    searched.mkdir()
    given.mkdir()
    losses = spawn(_compile_worker, 2, (str(searched), None))
    assert losses[0] == losses[1]
    # the plan the ranks searched trains like one process (same seed, data and optimizer)
    assert len({counts["plan"] for counts in _read(searched, 2)}) == 1  # every rank got the same plan
    torch.manual_seed(0)
    expected = reference_losses(resolve(MODEL).build(), _batch(), steps=STEPS,
                                optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    assert losses[0] == pytest.approx(expected, rel=1e-4)
    for rank, counts in enumerate(_read(searched, 2)):
        # every rank's build: one trace, no solver call
        assert counts["build"] == {"traces": 1, "solver_calls": []}, (rank, counts)
        if rank != 0:  # only rank 0 searched: no other rank imported a solver module or traced twice
            assert counts["traces"] == 1 and counts["solver_imported"] == [], (rank, counts)
    assert _read(searched, 2)[0]["solver_imported"], "rank 0 searched the plan (the API's search in the ranks)"

    from autopar.api import search_plan

    torch.manual_seed(0)
    plan = search_plan(resolve(MODEL).build(), 2, example_inputs=_batch())  # before the ranks start
    assert spawn(_compile_worker, 2, (str(given), plan.dumps())) == losses
    for rank, counts in enumerate(_read(given, 2)):
        assert counts["traces"] == 1 and counts["solver_loaded"] == [] and counts["solver_imported"] == [], \
            (rank, counts)
