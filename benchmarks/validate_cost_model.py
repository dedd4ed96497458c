"""Validate the cost model against published training runs: out of sample first, then rankings.

    python benchmarks/validate_cost_model.py [CSV] [--out results/cost_model_validation.md]
        [--loso results/loso_by_source.json] [--lopo results/loso_by_publication.json]
        [--sweep results/sweep_cpu.json] [--rows 10-15,22]

Prices every row of a published-runs CSV (default: benchmarks/data/published_runs.csv, the
runs shipped with the repository; see benchmarks/data/README.md) with the row's own
configuration and runtime options (benchmarks/lib/published_runs.py: explicit columns only, no
rule keyed on a source's name) and compares predicted with reported tokens/s per GPU.

Headline: leave-one-source-out. For every source (one table of one publication), the
global constants are fitted on all other sources (benchmarks/fit/fit_cost_model.py) and the
left-out rows are priced with that fit; the table gives that out-of-sample error beside the
in-sample one (the committed constants, fitted on every row). `--lopo` adds the stricter
leave-one-publication-out summary. The LOSO predictions are computed here unless a JSON
from `fit/fit_cost_model.py --loso` is given (run_all.py writes them first).

Rankings: for every group of runs of one model on one cluster at one sequence length
measured under 2+ configurations, Spearman(predicted, measured throughput) and the regret
of the model's top pick (1 - measured throughput of the predicted-best configuration /
the measured best), in sample and out of sample; plus this machine's sweep
(benchmarks/sweep_cpu.py's JSON) when given.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `benchmarks.*`

from benchmarks.lib.bench_stats import percentile, spearman  # noqa: E402

from benchmarks.lib.published_runs import DATA_CSV, ROOT, load_runs, price_run, profiles_for  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "cost_model_validation.md"


def _stats(errors: list[float]) -> str:
    a = [abs(e) for e in errors]
    if not a:
        return "| 0 | - | - | - | - |"
    return (f"| {len(a)} | {statistics.median(a):.1%} | {percentile(a, 0.9):.1%} | {max(a):.1%} | "
            f"{statistics.mean(errors):+.1%} |")


def ranking_groups(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Per group of 2+ runs: Spearman of predicted vs reported throughput and the top pick's regret."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for r in rows:
        # a float8 run is priced as its bf16 twin: within a group it would only tie
        if r.get(key) is not None and not any("fp8" in f for f in r["run"].flags):
            groups.setdefault(r["group"], []).append(r)
    out = []
    for name, rs in groups.items():
        if len(rs) < 2:
            continue
        rep, pred = [r["reported"] for r in rs], [r[key] for r in rs]
        pick = max(range(len(rs)), key=lambda i: pred[i])
        best = max(rep)
        out.append({"group": name, "runs": len(rs), "spearman": spearman(pred, rep), "regret": 1 - rep[pick] / best,
                    "pick": rs[pick]["label"], "best": rs[rep.index(best)]["label"]})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="?", default=str(DATA_CSV))
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--loso", default=None, help="fit/fit_cost_model.py --loso JSON (else computed here)")
    ap.add_argument("--lopo", default=None, help="fit/fit_cost_model.py --loso --holdout publication JSON")
    ap.add_argument("--sweep", default=None, help="benchmarks/sweep_cpu.py JSON: this machine's ranking groups")
    ap.add_argument("--rows", default="", help="only these row numbers, e.g. 10-15,22 (for iterating; "
                    "does not write --out unless given explicitly)")
    args = ap.parse_args(argv)
    import autopar  # noqa: F401  (autopar before cost_model: import order)

    start = time.perf_counter()
    runs, skipped = load_runs(args.csv, args.rows)
    profiles = profiles_for(runs, log=lambda m: print(m, file=sys.stderr))
    if args.loso:
        loso = json.loads(Path(args.loso).read_text())
    else:
        from benchmarks.fit import fit_cost_model

        loso_path = Path("/tmp") / f"loso-{int(time.time())}.json"
        fit_cost_model._loso(runs, profiles, loso_path)
        loso = json.loads(loso_path.read_text())
    lopo = json.loads(Path(args.lopo).read_text()) if args.lopo else None
    rows = []
    for run in runs:
        est = price_run(run, profiles)
        rep = run.reported_tokens_per_gpu
        out_of_sample = loso["rows"].get(str(run.index))
        rows.append({
            "i": run.index, "run": run, "est": est, "source": run.source_id, "model": run.row["model"],
            "group": run.group, "label": run.label, "reported": rep, "predicted": est.tokens_per_s_per_device,
            "error": est.tokens_per_s_per_device / rep - 1,
            "loso_predicted": rep * math.exp(out_of_sample["log_error"]) if out_of_sample else None,
            "loso_error": math.exp(out_of_sample["log_error"]) - 1 if out_of_sample else None,
            "lopo_error": (math.exp(lopo["rows"][str(run.index)]["log_error"]) - 1
                           if lopo and str(run.index) in lopo["rows"] else None),
            "flags": "; ".join(run.flags + (("predicted not to fit",) if not est.fits else ())),
        })
    sweep = json.loads(Path(args.sweep).read_text()) if args.sweep and Path(args.sweep).exists() else None
    lines = _report(rows, skipped, time.perf_counter() - start, len(profiles), args.csv, loso, lopo, sweep)
    print("\n".join(lines))
    if args.rows and args.out == str(DEFAULT_OUT):
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return 0


def _report(rows: list[dict[str, Any]], skipped: list[str], elapsed: float, traces: int, path: str,
            loso: dict[str, Any], lopo: dict[str, Any] | None, sweep: dict[str, Any] | None) -> list[str]:
    from cost_model.efficiency import FITTED, load_fitted

    fitted = load_fitted()
    clean = [r for r in rows if not r["run"].flags]
    loso_clean = [r["loso_error"] for r in clean if r["loso_error"] is not None]
    try:
        shown_path = str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        shown_path = path
    lines = [
        "# Cost model validation against published runs", "",
        f"Input: `{shown_path}` ({len(rows)} rows priced, {traces} distinct model shapes, {elapsed:.0f} s). "
        "Every row is priced with its own configuration and runtime options (`price_options`, "
        "benchmarks/data/README.md); error = predicted / reported tokens per second per GPU - 1 (for TFLOP/s-only "
        "sources the reported tokens/s is derived with the source's own FLOP formula).", "",
        "## Headline: out of sample", "",
        "Leave-one-source-out: for each source (one table of one publication), the global constants "
        f"(`{', '.join(FITTED)}`) are fitted on all other sources by `benchmarks/fit/fit_cost_model.py` and the left-out "
        "rows are priced with that fit. In-sample: the committed constants (`cost_model/fitted_constants.json`, "
        "fitted on every row). Flagged rows (float8 runs, power-capped GPUs of unknown peak) are priced but not in "
        "the fit's absolute term nor in these statistics.", "",
        "| predictions | rows | median abs error | p90 | max | mean signed |", "|---|---|---|---|---|---|",
        f"| leave-one-source-out (headline) {_stats(loso_clean)}",
        f"| in-sample {_stats([r['error'] for r in clean])}",
    ]
    if lopo:
        lopo_clean = [r["lopo_error"] for r in clean if r["lopo_error"] is not None]
        lines.append(f"| leave-one-publication-out (stricter) {_stats(lopo_clean)}")
    lines.append(f"| all rows incl. flagged, in-sample {_stats([r['error'] for r in rows])}")
    lines += ["", "Out of sample by left-out source:", "",
              "| source | rows | median abs error | p90 | max | mean signed | constants fitted without it |",
              "|---|---|---|---|---|---|---|"]
    by_source: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_source.setdefault(r["source"], []).append(r)
    for source, rs in sorted(by_source.items()):
        errs = [r["loso_error"] for r in rs if not r["run"].flags and r["loso_error"] is not None]
        fit = loso["fits"].get(source, {})
        lines.append(f"| {source} {_stats(errs)} {', '.join(f'{k} {v:g}' for k, v in fit.items())} |")
    lines += ["", f"Committed constants: {', '.join(f'{k} = {v:g}' for k, v in fitted['constants'].items())} "
              f"({fitted['script']}, {fitted['date']}; in-sample {fitted['in_sample']})."]
    lines += _ranking_section(rows, sweep)
    lines += ["", "## Every row", "",
              "| # | source | model | GPUs | tp/pp/dp/zero/mb/m | sched/v | recompute | runtime options | attn | "
              "reported tok/s/GPU | predicted | error | LOSO predicted | LOSO error | pred MFU | flags |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        run, e = r["run"], r["est"]
        c = run.config
        m = dict(e.config)["num_microbatches"]
        opts = ", ".join(f"{k}={v}" for k, v in sorted(run.options.changed().items()))
        loso_pred = f"{r['loso_predicted']:.0f}" if r["loso_predicted"] is not None else "-"
        loso_err = f"{r['loso_error']:+.1%}" if r["loso_error"] is not None else "-"
        lines.append(
            f"| {r['i']} | {r['source']} | {r['model']} | {run.cluster.num_devices} | "
            f"{c.tp}/{c.pp}/{c.dp}/{c.zero}/{c.micro_batch}/{m} | {c.schedule if c.pp > 1 else '-'}/{c.interleave} | "
            f"{c.recompute} | {opts} | {c.attention} | {r['reported']:.0f} | {r['predicted']:.0f} | "
            f"{r['error']:+.1%} | {loso_pred} | {loso_err} | {e.mfu:.1%} | {r['flags']} |")
    if skipped:
        lines += ["", "Skipped rows:"] + [f"- {s}" for s in skipped]
    return lines


def _ranking_section(rows: list[dict[str, Any]], sweep: dict[str, Any] | None) -> list[str]:
    lines = ["", "## Rankings: groups of one model on one cluster under 2+ configurations", "",
             "Spearman(predicted, reported throughput) and regret = 1 - reported throughput of the model's top pick / "
             "the best reported in the group (0 = the model picks the fastest). Rows of power-capped GPUs are included "
             "(their unknown peak is common to the group); float8 rows are not (priced as their bf16 twins).", "",
             "| source | model | GPUs | seq | runs | Spearman (LOSO) | regret (LOSO) | Spearman (in-sample) | "
             "regret (in-sample) | model's pick (LOSO) | measured best |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    ins = {g["group"]: g for g in ranking_groups(rows, "predicted")}
    out = {g["group"]: g for g in ranking_groups(rows, "loso_predicted")}
    for name in sorted(ins, key=lambda g: (g[0], g[2], g[1])):
        a, b = out.get(name), ins[name]
        model = next(r["model"] for r in rows if r["group"] == name)
        sp = lambda g: "-" if g is None or math.isnan(g["spearman"]) else f"{g['spearman']:.2f}"  # noqa: E731
        lines.append(f"| {name[0]} | {model} | {name[2]} | {name[3]} | {b['runs']} | {sp(a)} | "
                     f"{'-' if a is None else format(a['regret'], '.1%')} | {sp(b)} | {b['regret']:.1%} | "
                     f"{'-' if a is None else a['pick']} | {b['best']} |")
    for label, groups in (("out of sample (LOSO)", list(out.values())), ("in-sample", list(ins.values()))):
        multi = [g for g in groups if g["runs"] >= 3 and not math.isnan(g["spearman"])]
        if groups:
            lines.append(f"\n{label}: {len(groups)} groups; median regret {statistics.median(g['regret'] for g in groups):.1%}, "
                         f"max {max(g['regret'] for g in groups):.1%}; groups of 3+ runs: median Spearman "
                         + (f"{statistics.median(g['spearman'] for g in multi):.2f} over {len(multi)}" if multi else "-"))
    if sweep:
        lines += ["", "This machine (benchmarks/sweep_cpu.py; measured step times; predicted = what the product ranks "
                  "by: the intra-op ILP's price of the per-op program for pp = 1, the pipeline search's ILP stage costs "
                  "for pp > 1, with the "
                  "calibrated profile and with the built-in `cpu` profile; rows marked `price_profile for all` price "
                  "every configuration with `price_profile`):", "",
                  "| group | profile | runs | median abs error | Spearman | regret of the pick | pick | measured best |",
                  "|---|---|---|---|---|---|---|---|"]
        for g, per in sweep["groups"].items():
            runs = sum(1 for r in sweep["rows"] if f"{r['size']} x {r['world']}" == g
                       and not r["label"].endswith(" (repeat)"))  # sweep_cpu.REPEAT_SUFFIX: the noise estimate
            for key, f in per.items():
                name = key.removeprefix("predicted_").removesuffix("_s")
                name = name.replace("_analytic", " (price_profile for all)")
                lines.append(f"| {g} | {name} | {runs} | "
                             f"{f['median_abs_error']:.1%} | {f['spearman']:.2f} | {f['pick_regret']:.1%} | {f['pick']} | "
                             f"{f['measured_best']} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
