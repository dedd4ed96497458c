"""The one model's fit (benchmarks/fit/fit_one_model.py): its first-order model is solved
exactly, so a fold's constants are the optimum of its rows, not where a search stopped."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.fit.fit_cost_model import START  # noqa: E402
from benchmarks.fit.fit_one_model import ONE_MODEL_FITTED, _Surrogate, fit_surrogate, solve_surrogate  # noqa: E402


def _rows(n: int, groups: int, flagged: int = 0) -> list[SimpleNamespace]:
    return [SimpleNamespace(index=i, flags=("flag",) if i < flagged else (), group=("model", i % groups))
            for i in range(n)]


def test_noise_free_rows_give_back_their_constants() -> None:
    rng = np.random.default_rng(0)
    rows = _rows(40, 5)
    k = len(ONE_MODEL_FITTED)
    jac = {r.index: list(rng.uniform(-1.0, 0.2, k)) for r in rows}
    truth = rng.uniform(-0.1, 0.1, k)  # log theta - log theta0, inside every BOUNDS
    base = {r.index: float(np.dot(jac[r.index], truth)) for r in rows}  # log error = base - J d = 0 at truth
    theta0 = dict(START)
    fitted = fit_surrogate(rows, base, jac, theta0, radius=1.0, prior=0.0)
    got = np.array([math.log(fitted[n]) - math.log(theta0[n]) for n in ONE_MODEL_FITTED])
    assert got == pytest.approx(truth, abs=2e-3)  # 4 significant digits in the written constants


@pytest.mark.parametrize("prior", [0.0, 0.3, 3.0])
def test_the_solution_is_the_objective_s_minimum(prior: float) -> None:
    """No point of the box, random or on its corners, beats the linear program's solution
    on the objective it stands for (mean |error| + ranking term + prior)."""
    rng = np.random.default_rng(1)
    rows = _rows(60, 7, flagged=5)
    k = len(ONE_MODEL_FITTED)
    jac = {r.index: list(rng.normal(-0.4, 0.4, k)) for r in rows}
    base = {r.index: float(rng.normal(0.0, 0.2)) for r in rows}
    sur = _Surrogate(rows, base, jac)
    x0 = np.zeros(k)
    start = rng.normal(0.0, 0.3, k)
    lo, hi = x0 - 0.5, x0 + 0.5

    def f(x: np.ndarray) -> float:
        return sur.objective(x - x0) + prior * float(((x - start) ** 2).mean())

    best = f(solve_surrogate(sur, x0, lo, hi, start, prior))
    others = [rng.uniform(lo, hi) for _ in range(300)] + [np.where(rng.random(k) < 0.5, lo, hi) for _ in range(50)]
    assert best <= min(f(x) for x in others) + 1e-4
    # nor does the point the fit starts from
    assert best <= f(x0) + 1e-12


def _child_solves_a_mip(out) -> None:  # in a forked child: a knapsack, as the ILP's branch and bound runs
    import highspy

    rng = np.random.default_rng(3)
    n = 40
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.addVars(n, np.zeros(n), np.ones(n))
    h.changeColsIntegrality(n, np.arange(n, dtype=np.int32), np.array([highspy.HighsVarType.kInteger] * n))
    h.changeColsCost(n, np.arange(n, dtype=np.int32), -rng.uniform(1, 10, n))
    h.addRows(1, np.array([-highspy.kHighsInf]), np.array([50.0]), n, np.array([0], dtype=np.int32),
              np.arange(n, dtype=np.int32), rng.uniform(1, 10, n))
    h.run()
    out.put(str(h.getModelStatus()))


def test_a_pool_forked_after_the_fit_can_still_solve() -> None:
    """The fit runs HiGHS in the parent and then forks the pool that prices rows (their ILPs
    are HiGHS too): a child must not inherit a scheduler whose threads stayed behind."""
    import multiprocessing

    rows = _rows(20, 4)
    k = len(ONE_MODEL_FITTED)
    rng = np.random.default_rng(2)
    sur = _Surrogate(rows, {r.index: float(rng.normal()) for r in rows},
                     {r.index: list(rng.normal(size=k)) for r in rows})
    solve_surrogate(sur, np.zeros(k), np.full(k, -0.5), np.full(k, 0.5), np.zeros(k), 1.0)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_solves_a_mip, args=(out,))
    child.start()
    child.join(30)
    if child.is_alive():  # without the fix the child waits forever for its solver's threads
        child.kill()
    assert child.exitcode == 0
    assert out.get(timeout=5) == "HighsModelStatus.kOptimal"


def test_a_published_zero3_runtime_autopar_does_not_run_is_priced_as_its_difference() -> None:
    """SC'21's DeepSpeed ZeRO-3 row (175B on 1,536 A100s, per-tensor collectives): the one
    model's step plus what the runtime model says DeepSpeed-2021 costs over FSDP's runtime
    (autopar's own), throughput scaled to match; an FSDP row gets nothing added."""
    from benchmarks.lib.published_runs import load_runs, price_run, profiles_for
    from benchmarks.validate_one_model import foreign_zero3_s, price_one_model

    runs, _ = load_runs(rows="12")
    (run,) = runs
    assert run.options.zero3 == "deepspeed-2021" and run.config.zero == 3
    profiles = profiles_for([run])
    fsdp = replace(run, options=replace(run.options, zero3="fsdp"))
    extra = foreign_zero3_s(run)
    assert extra == pytest.approx(price_run(run, profiles).step_time_s - price_run(fsdp, profiles).step_time_s)
    assert extra > 1.0  # seconds: 96 layers x 12 tensors x 4 passes of 1,536-rank rings
    assert foreign_zero3_s(fsdp) == 0.0
    own = price_one_model(fsdp).predicted
    got = price_one_model(run).predicted
    assert got.step_time_s == pytest.approx(own.step_time_s + extra)
    assert got.tokens_per_s_per_device == pytest.approx(own.tokens_per_s_per_device * own.step_time_s
                                                        / got.step_time_s)
    assert dict(got.time_breakdown)["zero3_runtime_s"] == pytest.approx(extra)
