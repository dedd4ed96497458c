"""Fit the cost model's global efficiency constants on published runs (never by hand, never per row).

    python benchmarks/fit/fit_cost_model.py [--csv benchmarks/data/published_runs.csv]
        [--out benchmarks/results/fitted_constants.json] [--loso results/loso.json]

The closed-form baseline's fit. Its output is results/fitted_constants.json; with
`--out cost_model/fitted_constants.json` it commits its constants to the product, keeping
those the one model's fit committed there (benchmarks/fit/fit_one_model.py --commit).

What is fitted: the fields `cost_model.efficiency.FITTED` (GEMM efficiency relative to the
hardware's best-shape matmul rate, the GEMM K-ramp, fused attention efficiency, memory-bound
efficiency, compute/communication overlap, torch.compile's memory factor): one value each,
shared by every row and every GPU. Everything else in the model is a documented fact.

Objective (minimised with Nelder-Mead over the log of the constants, within bounds):
    mean over training rows without flags of |log(predicted / reported tokens/s per GPU)|
  + mean over ranking groups (one model, one cluster, one sequence length, 2+ configurations,
    flagged rows included) of the mean |log-error - the group's mean log-error|
The first term is absolute accuracy; the second is ranking accuracy, and it is what
informs constants (torch.compile's factor) whose only rows run on a GPU of unknown peak:
the unknown peak is a common factor of a group and cancels in the centred errors.

Modes:
- default: fit on every row and write `--out` (the model's committed constants, with the
  rows they were fitted on);
- `--loso PATH`: leave one source out: for every source_id, fit on all other sources and
  price the left-out one; writes per-row out-of-sample predictions (what
  validate_cost_model.py reports as its headline) and prints the summary.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.*`

from benchmarks.lib.published_runs import DATA_CSV, ROOT, Run, load_runs, price_run, profiles_for  # noqa: E402

BOUNDS = {
    "gemm_efficiency": (0.5, 1.0),
    "gemm_k_ramp": (1.0, 512.0),
    "flash_attention_efficiency": (0.2, 0.9),
    "memory_efficiency": (0.4, 0.95),
    "overlap_efficiency": (0.05, 1.0),
    "compiled_memory_factor": (0.1, 1.0),
    "gemm_overhead_s": (5e-7, 2e-5),
    "memory_overhead_s": (5e-7, 1e-5),
    "grad_sync_overlap_efficiency": (0.05, 1.0),
}
"""Physical ranges, not fits: a training GEMM reaches at most the best-shape rate; FlashAttention-2
reaches 30-73% of A100 peak (its paper) and its backward no more than its forward; memory-bound
kernels reach at most ~95% of HBM peak (STREAM copy); a K-ramp beyond a few tiles' depth (512)
would contradict cuBLAS's near-peak rates at K = 1024-2048; a GPU kernel's fixed time lies between
the ~0.5-1 us gap of back-to-back kernels in a CUDA graph and the ~10-20 us of a host-bound launch.
`grad_sync_overlap_efficiency` is the one model's (benchmarks/fit/fit_one_model.py fits it; this
script does not): a share of the backward, at most all of it."""
START = {
    "gemm_efficiency": 0.85, "gemm_k_ramp": 64.0, "flash_attention_efficiency": 0.5, "memory_efficiency": 0.8,
    "overlap_efficiency": 0.8, "compiled_memory_factor": 0.5, "gemm_overhead_s": 4e-6, "memory_overhead_s": 2e-6,
    "grad_sync_overlap_efficiency": 0.5,
}
"""Where every fit starts (so that a fit depends on its rows only, not on the constants
committed before it): round physical guesses (large GEMMs near their best rate, STREAM-like
memory efficiency, mostly hidden communication, inductor fusing half the traffic away; the one
model's gradient sync hidden behind half of the backward it overlaps, whose window W is the
whole backward, an upper bound)."""
RANK_WEIGHT = 1.0
"""Weight of the ranking term against the absolute term."""


def _clip(name: str, value: float) -> float:
    lo, hi = BOUNDS[name]
    return min(hi, max(lo, value))


def log_errors(runs: list[Run], profiles: dict[str, Any], eff: Any) -> list[float]:
    out = []
    for run in runs:
        est = price_run(run, profiles, eff)
        out.append(math.log(est.tokens_per_s_per_device / run.reported_tokens_per_gpu))
    return out


def objective(runs: list[Run], profiles: dict[str, Any], eff: Any) -> float:
    errs = log_errors(runs, profiles, eff)
    clean = [abs(e) for e, r in zip(errs, runs) if not r.flags]
    groups: dict[Any, list[float]] = {}
    for e, r in zip(errs, runs):
        groups.setdefault(r.group, []).append(e)
    ranked = [statistics.fmean(abs(e - statistics.fmean(g)) for e in g) for g in groups.values() if len(g) > 1]
    return (statistics.fmean(clean) if clean else 0.0) + RANK_WEIGHT * (statistics.fmean(ranked) if ranked else 0.0)


def nelder_mead(f: Callable[[list[float]], float], x0: list[float], step: float = 0.15, iters: int = 400,
                tol: float = 1e-5) -> tuple[list[float], float]:
    """Plain Nelder-Mead (reflection 1, expansion 2, contraction 0.5, shrink 0.5)."""
    n = len(x0)
    simplex = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = sorted(range(n + 1), key=lambda i: values[i])
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = [statistics.fmean(x[j] for x in simplex[:-1]) for j in range(n)]
        worst = simplex[-1]
        reflect = [c + (c - w) for c, w in zip(centroid, worst)]
        fr = f(reflect)
        if fr < values[0]:
            expand = [c + 2 * (c - w) for c, w in zip(centroid, worst)]
            fe = f(expand)
            simplex[-1], values[-1] = (expand, fe) if fe < fr else (reflect, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflect, fr
        else:
            contract = [c + 0.5 * (w - c) for c, w in zip(centroid, worst)]
            fc = f(contract)
            if fc < values[-1]:
                simplex[-1], values[-1] = contract, fc
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, s)] for s in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    i = min(range(n + 1), key=lambda k: values[k])
    return simplex[i], values[i]


def fit(runs: list[Run], profiles: dict[str, Any], start: Any = None, *, restarts: int = 2) -> tuple[Any, float]:
    """Efficiency with the FITTED fields minimising `objective` on `runs`."""
    from cost_model.efficiency import DEFAULT_EFFICIENCY, FITTED

    base = start or replace(DEFAULT_EFFICIENCY, **START)

    def make(x: list[float]) -> Any:
        return replace(base, **{name: _clip(name, math.exp(v)) for name, v in zip(FITTED, x)})

    x = [math.log(getattr(base, name)) for name in FITTED]
    best = float("inf")
    for _ in range(restarts):
        x, best = nelder_mead(lambda v: objective(runs, profiles, make(v)), x)
    return make(x), best


def _summary(errs: list[float]) -> str:
    a = sorted(abs(math.exp(e) - 1) for e in errs)
    if not a:
        return "no rows"
    p90 = a[min(len(a) - 1, int(round(0.9 * (len(a) - 1))))]
    return f"median |error| {statistics.median(a):.1%}, p90 {p90:.1%}, max {a[-1]:.1%} over {len(a)} rows"


def keep_one_model(path: Path, out: dict) -> None:
    """The constants the one model fits (benchmarks/fit/fit_one_model.py `--commit`) are the
    product's: when `path` already holds them (its "one_model" record), `out` keeps their
    values and the record, so refitting this baseline never overwrites them. This fit's
    own figures stay in `out` ("in_sample", "objective") for the constants it alone sets."""
    if not path.exists():
        return
    earlier = json.loads(path.read_text())
    record = earlier.get("one_model")
    if record:
        out["one_model"] = record
        out["constants"].update({k: earlier["constants"][k] for k in record["constants"]})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default=str(DATA_CSV))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fitted_constants.json"),
                    help="where to write the fit; given the committed cost_model/fitted_constants.json, the "
                         "constants the one model fits there (its 'one_model' record) are kept")
    ap.add_argument("--loso", default=None, help="leave-one-source-out: write out-of-sample predictions here")
    ap.add_argument("--holdout", choices=("source_id", "publication"), default="source_id",
                    help="what one left-out unit is: a source (one table of one publication) or a whole publication")
    args = ap.parse_args(argv)
    import autopar  # noqa: F401  (autopar before cost_model: import order)
    from cost_model.efficiency import FITTED

    start = time.perf_counter()
    runs, skipped = load_runs(args.csv)
    for message in skipped:
        print(f"skipped {message}", file=sys.stderr)
    profiles = profiles_for(runs, log=lambda m: print(m, file=sys.stderr))
    print(f"{len(runs)} rows, {len(profiles)} model shapes ({time.perf_counter() - start:.0f} s)", flush=True)
    if args.loso:
        return _loso(runs, profiles, Path(args.loso), args.holdout)
    eff, value = fit(runs, profiles)
    errs = log_errors(runs, profiles, eff)
    clean = [e for e, r in zip(errs, runs) if not r.flags]
    constants = {name: float(f"{getattr(eff, name):.4g}") for name in FITTED}
    out = {
        "constants": constants,
        "fitted_on": {
            "csv": str(Path(args.csv).resolve().relative_to(ROOT)) if Path(args.csv).resolve().is_relative_to(ROOT)
            else args.csv,
            "rows": len(runs),
            "rows_in_absolute_term": len(clean),
            "sources": sorted({r.source_id for r in runs}),
            "flagged_rows": [r.index for r in runs if r.flags],
        },
        "objective": round(value, 5),
        "in_sample": _summary(clean),
        "script": "benchmarks/fit/fit_cost_model.py",
        "date": datetime.date.today().isoformat(),
    }
    keep_one_model(Path(args.out), out)
    Path(args.out).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    print(json.dumps(constants, indent=2))
    print(f"in-sample (unflagged rows): {_summary(clean)}; written to {args.out} "
          f"({time.perf_counter() - start:.0f} s)")
    return 0


def _loso(runs: list[Run], profiles: dict[str, Any], path: Path, holdout: str = "source_id") -> int:
    from cost_model.efficiency import FITTED

    unit = (lambda r: r.source_id) if holdout == "source_id" else (lambda r: r.row["publication"])  # noqa: E731
    sources = sorted({unit(r) for r in runs})
    rows: dict[int, dict[str, Any]] = {}
    fits: dict[str, Any] = {}
    for source in sources:
        t = time.perf_counter()
        train = [r for r in runs if unit(r) != source]
        test = [r for r in runs if unit(r) == source]
        eff, _ = fit(train, profiles)
        fits[source] = {name: float(f"{getattr(eff, name):.4g}") for name in FITTED}
        for run, err in zip(test, log_errors(test, profiles, eff)):
            rows[run.index] = {"log_error": err, "source_id": source}
        clean = [rows[r.index]["log_error"] for r in test if not r.flags]
        print(f"left out {source} ({len(test)} rows): {_summary(clean)}; fit {fits[source]} "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
    clean = [rows[r.index]["log_error"] for r in runs if not r.flags]
    print(f"leave-one-source-out over all unflagged rows: {_summary(clean)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"holdout": holdout, "rows": {str(k): v for k, v in sorted(rows.items())},
                                "fits": fits, "summary": _summary(clean)}, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
