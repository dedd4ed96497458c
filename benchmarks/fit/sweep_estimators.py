"""How a recorded CPU sweep's step times are read from its rounds, five ways, judged by the
sweep's own noise probe.

    .venv/bin/python benchmarks/fit/sweep_estimators.py [--md OUT.md] [SWEEP.json ...]

With no files: every recorded sweep (benchmarks/data/cpu_sweeps/sweep_<run>.json) and the headline
(benchmarks/results/sweep_cpu.json). Nothing is re-measured or re-priced: each row's
`measured_times_s` (one step per timed round, rounds interleaved round-robin) and its
stored `predicted_calibrated_s` are read.

Estimators of a configuration's step time from its timed rounds:
- min: the sweep's headline (the convention of Python's timeit: other users only slow a
  step down);
- median: kept beside it in every row (`measured_median_s`);
- q25: the lower quartile (linear interpolation);
- fastest half: the mean of the fastest ceil(n / 2) rounds (a minimum that averages
  several draws instead of resting on one lucky round);
- round-adjusted median: log t[c, k] = a[c] + b[k] + noise, with b[k] the median over the
  group's configurations of log t[c, k] - median_k log t[c, k] (how slow round k was for
  everyone), and the step time exp(median_k (log t[c, k] - b[k])).

The judge that does not look at predictions: each group runs one program twice in the same
rounds (its "(repeat)" row). The two should read alike; how far apart they read is the
estimator's noise. The ranking figures (Spearman per group, the calibrated pick's regret)
are shown beside it for each estimator; they depend on the predictions too.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `benchmarks.*`
from benchmarks.lib.bench_stats import spearman  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
REPEAT = " (repeat)"


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    i = q * (len(xs) - 1)
    lo = math.floor(i)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def _fastest_half(times: list[float]) -> float:
    fast = sorted(times)[:math.ceil(len(times) / 2)]
    return sum(fast) / len(fast)


def _round_adjusted(rows: list[dict]) -> list[float]:
    logs = [[math.log(t) for t in r["measured_times_s"]] for r in rows]
    k = min(len(x) for x in logs)
    centre = [statistics.median(x[:k]) for x in logs]
    slow = [statistics.median(x[j] - c for x, c in zip(logs, centre)) for j in range(k)]
    return [math.exp(statistics.median(x[j] - slow[j] for j in range(k))) for x in logs]


ESTIMATORS = {
    "min": lambda rows: [min(r["measured_times_s"]) for r in rows],
    "median": lambda rows: [statistics.median(r["measured_times_s"]) for r in rows],
    "q25": lambda rows: [_quantile(r["measured_times_s"], 0.25) for r in rows],
    "fastest half": lambda rows: [_fastest_half(r["measured_times_s"]) for r in rows],
    "round-adjusted median": _round_adjusted,
}


def judge(rows: list[dict]) -> dict[str, dict]:
    """Per estimator: the twins' distances apart, the per-group Spearman values and pick regrets."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["size"], r["world"]), []).append(r)
    out = {}
    for name, fn in ESTIMATORS.items():
        apart, rho, regret = [], [], []
        for members in groups.values():
            value = dict(zip((r["label"] for r in members), fn(members)))
            for label, v in value.items():
                if label.endswith(REPEAT):
                    twin = value[label.removesuffix(REPEAT)]
                    apart.append(max(v, twin) / min(v, twin) - 1)
            kept = [r for r in members if not r["label"].endswith(REPEAT)]
            measured = [value[r["label"]] for r in kept]
            predicted = [r["predicted_calibrated_s"] for r in kept]
            rho.append(spearman(predicted, measured))
            pick = min(range(len(kept)), key=predicted.__getitem__)
            regret.append(measured[pick] / min(measured) - 1)
        out[name] = {"apart": apart, "spearman": rho, "regret": regret}
    return out


def main(argv: list[str] | None = None) -> int:
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--md", default=None, help="write the table here as markdown")
    args = ap.parse_args(argv)
    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        ap.error(f"no such sweep file: {', '.join(missing)}; give JSON files benchmarks/sweep_cpu.py wrote "
                 "(--json), or none for every recorded sweep")
    files = [Path(f) for f in args.files] or (
        sorted(p for p in (ROOT / "benchmarks" / "data" / "cpu_sweeps").glob("sweep_*.json")
               if "repriced" not in p.name)
        + [ROOT / "benchmarks" / "results" / "sweep_cpu.json"])
    lines = ["| sweep | estimator | twins apart, median | max | Spearman, worst group | mean | worst pick regret |",
             "|---|---|---|---|---|---|---|"]
    pooled: dict[tuple[str, bool], list[float]] = {}
    for path in files:
        data = json.loads(path.read_text())
        rows = data.get("rows", [])
        if not rows or "measured_times_s" not in rows[0] or not any(r["label"].endswith(REPEAT) for r in rows):
            print(f"{path}: no per-round times with repeated programs; skipped", file=sys.stderr)
            continue
        noisy = bool(data.get("noisy_groups")) or "noisy" in path.name
        for name, f in judge(rows).items():
            pooled.setdefault((name, noisy), []).extend(f["apart"])
            lines.append(f"| {path.stem}{' (noisy)' if noisy else ''} | {name} | {statistics.median(f['apart']):.1%} | "
                         f"{max(f['apart']):.1%} | {min(f['spearman']):.2f} | {statistics.mean(f['spearman']):.3f} | "
                         f"{max(f['regret']):.1%} |")
    lines += ["", "| estimator | runs | twin pairs | apart, median | mean | p90 |", "|---|---|---|---|---|---|"]
    for (name, noisy), xs in sorted(pooled.items(), key=lambda kv: (kv[0][1], list(ESTIMATORS).index(kv[0][0]))):
        lines.append(f"| {name} | {'noisy' if noisy else 'quiet'} | {len(xs)} | {statistics.median(xs):.2%} | "
                     f"{statistics.mean(xs):.2%} | {_quantile(xs, 0.9):.1%} |")
    text = "\n".join(lines)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
