"""Fit the one model's global constants on the published runs; validate it by held-out publications and sources.

    python benchmarks/fit/fit_one_model.py [--csv CSV] [--out results/one_model_fit.json]
        [--report results/one_model_fit.md] [--step 0.1] [--radius 0.5] [--workers 2] [--rows 10-15,22]
        [--refit results/one_model_fit.json] [--reuse-columns results/one_model_fit.json]
        [--commit cost_model/fitted_constants.json]

The one model is what `autopar search` and `autopar price` compute: every row's
configuration priced by `autopar.price` (benchmarks/validate_one_model.py
`price_one_model`: the search restricted to the row's configuration, the intra-op ILP
under its rules, the stage DP with its cuts). Its constants are the FITTED fields of
cost_model/efficiency.py that it reads (ONE_MODEL_FITTED); the hardware facts stay facts.

One evaluation of the one model on every row re-solves hundreds of ILPs (minutes), so
the fit cannot call it inside an optimiser's loop as benchmarks/fit/fit_cost_model.py calls
the closed-form model. It fits a first-order model of it instead (Gauss-Newton):

    log T_r(theta) ~ log T_r(theta0) + sum_k J_rk (log theta_k - log theta0_k)

- theta0: the committed constants; J by one-sided finite differences, each constant
  scaled by e^step in its own evaluation of every row (the ILPs re-solved, so a plan
  that changes with the constants is in J);
- the objective is fit_cost_model.py's (mean |log error| of the unflagged rows + the
  ranking term over groups of one model on one cluster) over log theta within the
  physical BOUNDS and a trust region |log theta_k - log theta0_k| <= radius. On the
  first-order model it is convex (absolute values of linear functions, plus the prior's
  square), so it is solved exactly as a linear program by HiGHS (`solve_surrogate`), not
  searched: a simplex search stalls on its kinks, and a fold's constants then depend on
  where the search stopped rather than on the fold's rows;
- every reported error is the one model itself priced at the fitted constants, never
  the first-order model.

A prior holds constants that the training rows do not pin near physics: the objective
gains lambda x the mean squared log distance from fit_cost_model.py's START (round
physical guesses, fixed before any fit), with lambda chosen from PRIOR_WEIGHTS by leaving
one publication of the training rows out at a time (nested inside every held-out fold, so
the held-out rows never choose it). `--refit` reuses an earlier run's Jacobian (saved in
its JSON) and re-fits and re-prices the folds only. `--reuse-columns` takes an earlier
run's columns for the constants it fitted at the same committed values and evaluates the
base and the other columns (a constant added since: one evaluation instead of one per
constant); the reused columns are that run's model's derivatives, which is the first-order
model of this one wherever the two price alike.

Held-out validation, the honest stand-in for runs not seen: for each publication
(leave-one-publication-out, the headline) and each source (leave-one-source-out), the
constants are fitted on the other rows (the same J) and the left-out rows are priced by
the one model at those constants. Beside it, each publication is also priced by the one
model at the constants the closed-form baseline fitted without it (`--borrowed`): what
fitting the one model on itself gains over borrowing the baseline's fit. Constants are global: nothing is keyed on a row's
source. Rows whose configuration the one model cannot price are listed, not dropped
silently.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.*`

from benchmarks.lib.bench_stats import percentile  # noqa: E402
from benchmarks.fit.fit_cost_model import BOUNDS, RANK_WEIGHT, START  # noqa: E402
from benchmarks.lib.published_runs import DATA_CSV, ROOT, Run, load_runs  # noqa: E402

ONE_MODEL_FITTED = ("gemm_efficiency", "gemm_k_ramp", "flash_attention_efficiency", "memory_efficiency",
                    "gemm_overhead_s", "memory_overhead_s", "grad_sync_overlap_efficiency")
"""The FITTED constants the one model reads: the ILP's op costs (cost_model/compute.py) and
the share of a phase's compute that hides an overlapped collective (rho of
cost_model/table.py `exposed_sync_s` and `hidden_comm_s`: the gradient sync and the
weights' collectives issued ahead; the one model's own, cost_model/efficiency.py
ONE_MODEL_ONLY). Not fitted here: `overlap_efficiency`, a term of the closed-form baseline
only (its overlap multiplies another window than the one model's), and
`compiled_memory_factor`, kept as fit_cost_model.py fits it."""

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "one_model_fit.json"
DEFAULT_REPORT = ROOT / "benchmarks" / "results" / "one_model_fit.md"


def with_constants(cluster: Any, values: dict[str, float]) -> Any:
    """`cluster` whose hardware carries `values` as efficiency overrides
    (cost_model.efficiency.efficiency_for), except fields the profile overrides itself."""
    hw = cluster.hardware
    merged = dict(values)
    merged.update(dict(hw.efficiency))
    return replace(cluster, hardware=replace(hw, efficiency=tuple(sorted(merged.items()))))


def price_rows(runs: list[Run], values: dict[str, float]) -> dict[int, dict[str, Any]]:
    """Every row priced by the one model at `values`: {row: {"tps": tokens/s per GPU,
    "terms": time breakdown}} or {row: {"error": why}}."""
    from benchmarks.validate_one_model import price_one_model

    out: dict[int, dict[str, Any]] = {}
    for run in runs:
        try:
            plan = price_one_model(replace(run, cluster=with_constants(run.cluster, values)))
        except (ValueError, RuntimeError) as exc:
            out[run.index] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
            continue
        est = plan.predicted
        out[run.index] = {"tps": est.tokens_per_s_per_device, "terms": dict(est.time_breakdown),
                          "step_s": est.step_time_s}
    return out


def _job(args: tuple[str, list[int], dict[str, float]]) -> tuple[str, dict[int, dict[str, Any]]]:
    csv, indices, values = args
    runs, _ = load_runs(csv)
    keep = set(indices)
    return csv, price_rows([r for r in runs if r.index in keep], values)


def evaluate(csv: str, jobs: list[tuple[list[int], dict[str, float]]], workers: int) -> list[dict[int, dict[str, Any]]]:
    """Price each (rows, constants) job, `workers` processes at a time (each its own traces)."""
    tasks = [(csv, rows, values) for rows, values in jobs]
    if workers <= 1 or len(tasks) == 1:
        return [_job(t)[1] for t in tasks]
    with multiprocessing.get_context("fork").Pool(min(workers, len(tasks)), maxtasksperchild=1) as pool:
        return [r for _, r in pool.map(_job, tasks, chunksize=1)]


PRIOR_WEIGHTS = (0.0, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
"""The prior's weights a fit chooses from (`prior_weight`): lambda in
objective + lambda * mean_k (log theta_k - log START_k)^2, START being fit_cost_model.py's
round physical guesses. A publication's rows pin the constants its regime exercises
(large GEMMs at scale; small models' per-kernel overheads); constants no training row pins
drift to a bound where they help the rows seen (without llm-foundry, memory_efficiency went
to its 0.95 bound and the held-out small models were priced 60-70% fast). The prior holds
such constants near physics. Its weight is chosen by the script, never by hand: by leaving
one publication out inside the training rows (`prior_weight`)."""


class _Surrogate:
    """The first-order model (module docstring) over a fixed set of rows, vectorised:
    log error(d) = base - J d for a step d in log theta from theta0."""

    def __init__(self, rows: list[Run], base: dict[int, float], jac: dict[int, list[float]]) -> None:
        import numpy as np

        self.rows = rows
        self.base = np.array([base[r.index] for r in rows])
        self.jac = np.array([jac[r.index] for r in rows]).reshape(len(rows), len(ONE_MODEL_FITTED))
        self.clean = np.array([not r.flags for r in rows])
        keys: dict[Any, int] = {}
        self.group = np.array([keys.setdefault(r.group, len(keys)) for r in rows], dtype=int)
        counts = np.bincount(self.group, minlength=len(keys)) if rows else np.zeros(0, dtype=int)
        self.counts = counts
        self.multi = counts > 1

    def errors(self, d: Any) -> Any:
        return self.base - self.jac @ d

    def objective(self, d: Any) -> float:
        """fit_cost_model.py's objective on the surrogate's log errors: the mean |log error|
        of the unflagged rows, plus RANK_WEIGHT x the mean over groups of one model on one
        cluster (two rows or more) of each group's mean absolute deviation from its mean
        (what the ranking within a group depends on)."""
        import numpy as np

        e = self.errors(d)
        clean = float(np.abs(e[self.clean]).mean()) if self.clean.any() else 0.0
        if not self.multi.any():
            return clean
        mean = np.bincount(self.group, weights=e) / np.maximum(self.counts, 1)
        dev = np.bincount(self.group, weights=np.abs(e - mean[self.group])) / np.maximum(self.counts, 1)
        return clean + RANK_WEIGHT * float(dev[self.multi].mean())


PRIOR_TANGENTS = 81
"""Tangent lines that bound each constant's prior square from below in the linear program
(`solve_surrogate`), evenly over its box: the square is exact at them and off by at most
(box width / 80)^2 / 4 between them (4e-5 in the squared log distance for a radius of 0.5)."""


def solve_surrogate(sur: _Surrogate, x0: Any, lo: Any, hi: Any, start: Any, prior: float) -> Any:
    """The log constants x in [lo, hi] minimising `_Surrogate.objective(x - x0)` plus
    `prior` x mean_k (x_k - start_k)^2, exactly, as one linear program (HiGHS):

        min  sum_r w_r t_r + sum_r v_r u_r + (prior / K) sum_k q_k
        t_r >= +-(c_r - J_r x)                       (|log error| of unflagged row r)
        u_r >= +-((c_r - cbar_g) - (J_r - Jbar_g) x)  (deviation from its group's mean)
        q_k >= 2 z (x_k - start_k) - z^2  for PRIOR_TANGENTS values z  (the square)

    with c = base + J x0 (so log error = c - J x), w_r = 1 / unflagged rows, v_r =
    RANK_WEIGHT / (groups of two rows or more x rows in r's group)."""
    import highspy
    import numpy as np

    k_n = len(x0)
    c = sur.base + sur.jac @ x0
    inf = highspy.kHighsInf
    cost, lower, upper = [0.0] * k_n, list(lo), list(hi)
    rows: list[tuple[float, dict[int, float]]] = []  # (lower bound, {column: coefficient}), upper bound inf

    def var(weight: float) -> int:
        cost.append(weight)
        lower.append(0.0)
        upper.append(inf)
        return len(cost) - 1

    def absolute(weight: float, value: float, slope: Any) -> None:
        # t >= value - slope . x and t >= -(value - slope . x)
        t = var(weight)
        rows.append((value, {t: 1.0, **{k: float(slope[k]) for k in range(k_n)}}))
        rows.append((-value, {t: 1.0, **{k: -float(slope[k]) for k in range(k_n)}}))

    clean = np.flatnonzero(sur.clean)
    for r in clean:
        absolute(1.0 / len(clean), float(c[r]), sur.jac[r])
    multi = np.flatnonzero(sur.multi)
    for g in multi:
        members = np.flatnonzero(sur.group == g)
        c_mean, j_mean = c[members].mean(), sur.jac[members].mean(axis=0)
        for r in members:
            absolute(RANK_WEIGHT / (len(multi) * len(members)), float(c[r] - c_mean), sur.jac[r] - j_mean)
    if prior > 0:
        for k in range(k_n):
            q = var(prior / k_n)
            for z in np.linspace(lo[k] - start[k], hi[k] - start[k], PRIOR_TANGENTS):
                rows.append((float(-2.0 * z * start[k] - z * z), {q: 1.0, k: float(-2.0 * z)}))
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.addVars(len(cost), np.array(lower), np.array(upper))
    h.changeColsCost(len(cost), np.arange(len(cost), dtype=np.int32), np.array(cost))
    starts, index, value = [], [], []
    for _, coef in rows:
        starts.append(len(index))
        index += list(coef)
        value += list(coef.values())
    h.addRows(len(rows), np.array([lb for lb, _ in rows]), np.full(len(rows), inf), len(index),
              np.array(starts, dtype=np.int32), np.array(index, dtype=np.int32), np.array(value))
    h.run()
    status, x = h.getModelStatus(), np.array(h.getSolution().col_value[:k_n])
    # HiGHS's worker threads belong to this process: a pool forked after this solve (`evaluate`)
    # would inherit a scheduler without its threads, and the ILPs its children solve end
    # "Not Solved" at once. Stop them, so forked children start their own.
    highspy.Highs.resetGlobalScheduler(True)
    if status != highspy.HighsModelStatus.kOptimal:
        raise RuntimeError(f"the surrogate fit's linear program ended {status}")
    return np.clip(x, lo, hi)


def fit_surrogate(runs: list[Run], base: dict[int, float], jac: dict[int, list[float]], theta0: dict[str, float],
                  radius: float, prior: float = 0.0) -> dict[str, float]:
    """Constants minimising `objective` on the first-order model (module docstring), plus
    `prior` x the mean squared log distance from START (PRIOR_WEIGHTS), solved exactly
    (`solve_surrogate`)."""
    import numpy as np

    sur = _Surrogate([r for r in runs if r.index in base and r.index in jac], base, jac)
    x0 = np.array([math.log(theta0[k]) for k in ONE_MODEL_FITTED])
    start = np.array([math.log(START[k]) for k in ONE_MODEL_FITTED])
    lo = np.array([max(math.log(BOUNDS[k][0]), x - radius) for k, x in zip(ONE_MODEL_FITTED, x0)])
    hi = np.array([min(math.log(BOUNDS[k][1]), x + radius) for k, x in zip(ONE_MODEL_FITTED, x0)])
    x = solve_surrogate(sur, x0, lo, hi, start, prior)
    return {k: float(f"{math.exp(v):.4g}") for k, v in zip(ONE_MODEL_FITTED, x)}


def held_out_error(train: list[Run], held: list[Run], base: dict[int, float], jac: dict[int, list[float]],
                   theta0: dict[str, float], radius: float, prior: float) -> list[float]:
    """|log error| of `held` on the surrogate at the constants fitted on `train`."""
    import numpy as np

    fitted = fit_surrogate(train, base, jac, theta0, radius, prior)
    d = np.array([math.log(fitted[k]) - math.log(theta0[k]) for k in ONE_MODEL_FITTED])
    sur = _Surrogate([r for r in held if r.index in base and r.index in jac], base, jac)
    return [abs(float(e)) for e in sur.errors(d)]


def prior_weight(train: list[Run], base: dict[int, float], jac: dict[int, list[float]], theta0: dict[str, float],
                 radius: float) -> float:
    """The prior's weight for a fit on `train` (PRIOR_WEIGHTS): the one whose fits leave one
    publication of `train` out at a time and price it (on the surrogate) with the smallest
    median |log error| over every left-out row; 0 when `train` holds one publication."""
    pubs = sorted({r.row["publication"] for r in train})
    if len(pubs) < 2:
        return 0.0
    scores = {}
    for lam in PRIOR_WEIGHTS:
        errs: list[float] = []
        for pub in pubs:
            errs += held_out_error([r for r in train if r.row["publication"] != pub],
                                   [r for r in train if r.row["publication"] == pub], base, jac, theta0, radius, lam)
        scores[lam] = statistics.median(errs)
    return min(PRIOR_WEIGHTS, key=lambda lam: (scores[lam], lam))


def _log_errors(runs: list[Run], priced: dict[int, dict[str, Any]]) -> dict[int, float]:
    return {r.index: math.log(priced[r.index]["tps"] / r.reported_tokens_per_gpu)
            for r in runs if "tps" in priced.get(r.index, {})}


def summary(errs: list[float]) -> dict[str, float]:
    a = [abs(math.exp(e) - 1) for e in errs]
    return {"rows": len(a), "median": statistics.median(a) if a else math.nan,
            "p90": percentile(a, 0.9) if a else math.nan, "max": max(a) if a else math.nan}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default=str(DATA_CSV))
    ap.add_argument("--out", default=str(DEFAULT_JSON))
    ap.add_argument("--report", default=str(DEFAULT_REPORT))
    ap.add_argument("--step", type=float, default=0.1, help="log step of the finite differences")
    ap.add_argument("--radius", type=float, default=0.5, help="trust region on log theta")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rows", default=None, help="only these row indices (e.g. 10-15,22): a smoke run")
    ap.add_argument("--commit", default=None, metavar="CONSTANTS_JSON",
                    help="also write the constants fitted on every row into this file (the product's: "
                         "cost_model/fitted_constants.json), with a 'one_model' record of how they were fitted "
                         "and validated; its other constants (the closed-form baseline's) are kept")
    ap.add_argument("--refit", default=None, help="an earlier --out JSON: reuse its committed prices and Jacobian "
                                                  "(same constants and rows), refit and re-price the folds only")
    ap.add_argument("--reuse-columns", default=None, metavar="EARLIER_JSON",
                    help="an earlier --out JSON: evaluate the base and the columns of the constants it lacks (or "
                         "whose committed value changed), reuse its columns of the others")
    ap.add_argument("--borrowed", default=str(ROOT / "benchmarks" / "results" / "loso_by_publication.json"),
                    help="the baseline's leave-one-publication-out fits (fit_cost_model.py --loso --holdout "
                         "publication): each left-out publication also priced by the one model at the constants "
                         "fitted on the baseline without it ('' to skip)")
    args = ap.parse_args(argv)
    import autopar  # noqa: F401  (autopar before cost_model: import order)
    from cost_model.efficiency import DEFAULT_EFFICIENCY

    t0 = time.perf_counter()
    runs, skipped = load_runs(args.csv, args.rows)
    every = [r.index for r in runs]
    if args.refit:
        # the committed constants' prices and the Jacobian of an earlier run of this script
        try:
            earlier = json.loads(Path(args.refit).read_text())
        except (OSError, ValueError) as exc:
            ap.error(f"--refit {args.refit}: {exc}")
        if "jacobian" not in earlier or "base" not in earlier:
            ap.error(f"--refit {args.refit}: no saved Jacobian (written by an older fit_one_model.py); "
                     "run without --refit to compute it")
        theta0 = earlier["theta0"]
        priced = [{int(i): row["committed"] for i, row in earlier["rows"].items() if row.get("committed")}]
        base = {int(i): v for i, v in earlier["base"].items()}
        jac = {int(i): v for i, v in earlier["jacobian"].items()}
    else:
        theta0 = {k: getattr(DEFAULT_EFFICIENCY, k) for k in ONE_MODEL_FITTED}
        reused = _reused_columns(args.reuse_columns, theta0, args.step) if args.reuse_columns else {}
        fresh = [k for k in ONE_MODEL_FITTED if k not in reused]
        # the base and one evaluation per constant not reused, scaled by e^step
        jobs = [(every, theta0)] + [(every, {**theta0, k: theta0[k] * math.exp(args.step)}) for k in fresh]
        priced = evaluate(args.csv, jobs, args.workers)
        print(f"Jacobian: {len(jobs)} evaluations of {len(runs)} rows ({time.perf_counter() - t0:.0f} s)"
              + (f"; columns of {sorted(reused)} from {args.reuse_columns}" if reused else ""), flush=True)
        base = _log_errors(runs, priced[0])
        shifted = dict(zip(fresh, (_log_errors(runs, p) for p in priced[1:])))
        # d log T / d log theta_k = -(d log tps / d log theta_k)
        jac = {i: [reused[k][i] if k in reused else -(shifted[k][i] - base[i]) / args.step for k in ONE_MODEL_FITTED]
               for i in base if all(i in shifted[k] for k in fresh) and all(i in reused[k] for k in reused)}
    priors: dict[str, dict[str, float]] = {"all": {"all": prior_weight(runs, base, jac, theta0, args.radius)}}
    fitted = fit_surrogate(runs, base, jac, theta0, args.radius, priors["all"]["all"])
    print(f"fitted on every row (prior weight {priors['all']['all']}): {fitted}", flush=True)

    units = {"publication": lambda r: r.row["publication"], "source": lambda r: r.source_id}
    folds: dict[str, dict[str, dict[str, float]]] = {}
    jobs = [(every, fitted)]
    labels = [("all", "all")]
    for name, unit in units.items():
        folds[name], priors[name] = {}, {}
        for held in sorted({unit(r) for r in runs}):
            train = [r for r in runs if unit(r) != held]
            # the prior's weight is chosen on the training rows alone (nested)
            priors[name][held] = prior_weight(train, base, jac, theta0, args.radius)
            folds[name][held] = fit_surrogate(train, base, jac, theta0, args.radius, priors[name][held])
            jobs.append(([r.index for r in runs if unit(r) == held], folds[name][held]))
            labels.append((name, held))
        print(f"{name} folds fitted; prior weights {priors[name]}", flush=True)
    borrowed = json.loads(Path(args.borrowed).read_text())["fits"] if args.borrowed else {}
    for held, constants in sorted(borrowed.items()):
        rows = [r.index for r in runs if r.row["publication"] == held]
        if rows:
            # the baseline fits no constant of the one model's own (ONE_MODEL_ONLY): its committed value
            jobs.append((rows, {k: constants.get(k, theta0[k]) for k in ONE_MODEL_FITTED}))
            labels.append(("borrowed", held))
    priced_folds = evaluate(args.csv, jobs, args.workers)
    in_sample = priced_folds[0]
    held_out: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in (*units, "borrowed")}
    for (name, _held), p in zip(labels[1:], priced_folds[1:]):
        held_out[name].update(p)
    elapsed = time.perf_counter() - t0
    result = {
        "script": "benchmarks/fit/fit_one_model.py", "csv": args.csv, "step": args.step, "radius": args.radius,
        "theta0": theta0, "fitted": fitted, "folds": folds, "priors": priors, "seconds": round(elapsed),
        "refit": bool(args.refit), "reused_columns": args.reuse_columns,
        "start": {k: START[k] for k in ONE_MODEL_FITTED},
        "base": {str(i): v for i, v in sorted(base.items())}, "jacobian": {str(i): v for i, v in sorted(jac.items())},
        "rows": {str(r.index): {
            "publication": r.row["publication"], "source": r.source_id, "model": r.row["model"],
            "config": r.label, "reported": r.reported_tokens_per_gpu, "flags": list(r.flags),
            "gpus": r.cluster.num_devices,
            "committed": priced[0].get(r.index), "in_sample": in_sample.get(r.index),
            "lopo": held_out["publication"].get(r.index), "loso": held_out["source"].get(r.index),
            "lopo_borrowed": held_out["borrowed"].get(r.index)}
            for r in runs},
    }
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    Path(args.report).write_text(report(result, skipped))
    if args.commit:
        commit_constants(Path(args.commit), result)
        print(f"committed the constants fitted on every row to {args.commit}")
    print(f"wrote {args.out} and {args.report} ({elapsed:.0f} s)")
    return 0


def _reused_columns(path: str, theta0: dict[str, float], step: float) -> dict[str, dict[int, float]]:
    """{constant: {row: d log T / d log theta}}: the Jacobian columns of an earlier run of this
    script (its JSON at `path`) for the constants it fitted at the same committed value and
    finite-difference step. They were taken around the one model of that run: where the
    model changed since (a new term), the columns of the old constants are its first-order
    model, not this one's; the held-out errors are still the one model priced."""
    earlier = json.loads(Path(path).read_text())
    # that run's column order: its ONE_MODEL_FITTED, which this one extends at its end (the
    # JSON's theta0 is written with sorted keys, so it does not keep the order)
    old = [k for k in ONE_MODEL_FITTED if k in earlier["theta0"]]
    if earlier.get("step") != step or "jacobian" not in earlier:
        raise SystemExit(f"--reuse-columns {path}: no Jacobian at step {step}")
    return {k: {int(i): col[old.index(k)] for i, col in earlier["jacobian"].items()}
            for k in ONE_MODEL_FITTED if k in earlier["theta0"] and earlier["theta0"][k] == theta0[k]}


def commit_constants(path: Path, result: dict[str, Any]) -> None:
    """Write `result`'s constants fitted on every row into the constants file at `path`
    (cost_model/fitted_constants.json), with the record of their fit: the script, its
    prior weight, and the one model's errors at them in sample and held out. The file's
    other constants stay (the terms of the closed-form baseline only, which
    benchmarks/fit/fit_cost_model.py fits and keeps these when it refits)."""
    import datetime

    data = json.loads(path.read_text())
    data["constants"].update(result["fitted"])
    data["one_model"] = {
        "script": "benchmarks/fit/fit_one_model.py",
        "date": datetime.date.today().isoformat(),
        "constants": sorted(result["fitted"]),
        "prior_weight": result["priors"]["all"]["all"],
        "theta0": result["theta0"],
        **{label: "median |error| {median:.1%}, p90 {p90:.1%} over {rows} rows".format(**summary(_errs(result, key)))
           for key, label in (("in_sample", "in_sample"), ("lopo", "leave_one_publication_out"),
                              ("loso", "leave_one_source_out"))},
    }
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _errs(result: dict[str, Any], key: str, *, unflagged: bool = False,
          publication: str | None = None) -> list[float]:
    out = []
    for row in result["rows"].values():
        cell = row.get(key) or {}
        if "tps" not in cell or (unflagged and row["flags"]) or (publication and row["publication"] != publication):
            continue
        out.append(math.log(cell["tps"] / row["reported"]))
    return out


def _cell(errs: list[float]) -> str:
    s = summary(errs)
    return f"{s['median']:.1%} / {s['p90']:.1%}" if s["rows"] else "-"


def report(result: dict[str, Any], skipped: list[str]) -> str:
    keys = (("committed", "committed constants (in sample)"), ("in_sample", "fitted on every row (in sample)"),
            ("lopo", "leave one publication out"), ("loso", "leave one source out"),
            ("lopo_borrowed", "leave one publication out, the baseline's fold constants"))
    lines = ["# The one model fitted on published runs", "",
             "Generated by `.venv/bin/python benchmarks/fit/fit_one_model.py` "
             f"({result['seconds']} s" + (", refitted from an earlier run's Jacobian with `--refit`"
                                          if result.get("refit") else "")
             + (f", the Jacobian's columns of the constants an earlier run fitted at the same values taken from "
                f"it with `--reuse-columns`, the base and the other columns evaluated"
                if result.get("reused_columns") else "") + "). Errors are |predicted / reported - 1| of tokens/s per GPU, the one model "
             "(`autopar price` of each row's configuration) at each set of constants. Held-out rows are priced at "
             "constants fitted without their publication (or source); the fit is a first-order model of the one "
             "model around the committed constants (the script's docstring).", "",
             "| constants | rows | median / p90 |", "|---|---|---|"]
    for key, label in keys:
        errs = _errs(result, key)
        lines.append(f"| {label} | {len(errs)} | {_cell(errs)} |")
    pubs = sorted({row["publication"] for row in result["rows"].values()})
    lines += ["", "Per publication (median / p90):", "",
              "| publication | rows | " + " | ".join(label for _, label in keys) + " |",
              "|---|---|" + "---|" * len(keys)]
    for pub in pubs:
        n = len(_errs(result, "committed", publication=pub))
        lines.append(f"| {pub} | {n} | " + " | ".join(_cell(_errs(result, key, publication=pub))
                                                      for key, _ in keys) + " |")
    names = list(result["fitted"])
    lines += ["", "## Constants", "", "| constant | committed | fitted on every row | "
              + " | ".join(f"without {p}" for p in result["folds"]["publication"]) + " |",
              "|---|---|---|" + "---|" * len(result["folds"]["publication"])]
    for k in names:
        lines.append(f"| `{k}` | {result['theta0'][k]:.4g} | {result['fitted'][k]:.4g} | "
                     + " | ".join(f"{f[k]:.4g}" for f in result["folds"]["publication"].values()) + " |")
    if "priors" in result:
        lines.append("| prior weight (PRIOR_WEIGHTS, chosen on the fold's rows) | - | "
                     f"{result['priors']['all']['all']:g} | "
                     + " | ".join(f"{result['priors']['publication'][p]:g}" for p in result["folds"]["publication"])
                     + " |")
        lines.append("")
        lines.append("The prior's centre (fit_cost_model.py START): "
                     + ", ".join(f"`{k}` {v:.4g}" for k, v in result["start"].items()) + ".")
    lines += ["", "## The 10 worst rows left one publication out", "",
              "The term: the one model's largest time component at the fold's constants.", "",
              "| row | publication | model | GPUs | config | reported | held out | term |", "|---|---|---|---|---|---|---|---|"]
    rows = [(i, row) for i, row in result["rows"].items() if "tps" in (row.get("lopo") or {})]
    rows.sort(key=lambda ir: -abs(ir[1]["lopo"]["tps"] / ir[1]["reported"] - 1))
    for i, row in rows[:10]:
        cell = row["lopo"]
        term, value = max(cell["terms"].items(), key=lambda kv: kv[1])
        lines.append(f"| {i} | {row['publication']} | {row['model']} | {row['gpus']} | {row['config']} | "
                     f"{row['reported']:,.0f} | {cell['tps']:,.0f} ({cell['tps'] / row['reported'] - 1:+.0%}) | "
                     f"{term.removesuffix('_s')} {value / cell['step_s']:.0%} of {cell['step_s']:.3g} s |")
    failed = [(i, row) for i, row in result["rows"].items() if "error" in (row.get("committed") or {})]
    if failed or skipped:
        lines += ["", "## Not priced", ""]
        lines += [f"- row {i} {row['model']} {row['config']}: {row['committed']['error']}" for i, row in failed]
        lines += [f"- {s}" for s in skipped]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
