"""Price every published run with the model that ranks plans, beside the analytic baseline.

    python benchmarks/validate_one_model.py [CSV] [--out results/one_model_validation.md]
        [--rows 10-15,22] [--json results/one_model_validation.json]

Every row of the published-runs CSV (benchmarks/data/published_runs.csv; the same rows and
configurations as benchmarks/validate_cost_model.py) is priced twice:
- **one model**: `autopar.price`, what `autopar price` and `autopar search` compute for the
  row's configuration (traced as the search traces it, the intra-op ILP under the
  configuration's rules, the stage DP with the row's cuts where it gives them). The
  published ZeRO stage is fixed (`--zero`), and the precision is bf16-mixed with the row's
  gradient-reduction dtype (`grad_reduce_bytes`: a plan choice, `--reduce-dtype`); a row
  run under torch.compile is priced compiled (`--compile`).
- **analytic**: `analytic.price_profile` (benchmarks/baselines/analytic/) with the row's runtime options, the baseline the
  constants were fitted on (benchmarks/fit/fit_cost_model.py).

Both use the committed constants of cost_model/efficiency.py, fitted on every row: the op
costs and the overlapped gradient sync by the one model (benchmarks/fit/fit_one_model.py),
the baseline's own terms by it (benchmarks/fit/fit_cost_model.py); so neither column is out
of sample here (the one model's errors left out by publication and by source are
fit_one_model.py's).
What the table measures is how far the model that ranks plans is from the
published throughput with today's constants, and where it departs from the baseline. The
runtime options a row gives (`zero3`, `dtensor_tp`, ...), and its
unfused attention or tensor parallelism without sequence parallelism, describe a
published stack; the one model prices what autopar would run, so it ignores them: the
report measures, per such fact, what ignoring it costs on the rows that carry it.

Reported: median and p90 |error| of tokens/s per GPU overall and per publication; Spearman
and top-pick regret per group of one model on one cluster under several configurations;
the 10 worst rows, each with the time term where the two models differ most.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.bench_stats import percentile, spearman  # noqa: E402
from benchmarks.lib.published_runs import DATA_CSV, ROOT, load_runs, price_run, profiles_for  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "one_model_validation.md"


def price_one_model(run: Any) -> Any:
    """The row's configuration priced by `autopar.price` (its Plan), under the row's
    published runtime where it is one autopar does not run (`foreign_runtime`)."""
    import autopar

    config = replace(run.config, attention="flash", sequence_parallel=True, precision="bf16-mixed",
                     reduce_dtype=reduce_dtype(run), compiled=run.options.compiled)
    cluster = run.cluster
    if not run.options.overlap_grad_reduce:
        cluster = replace(cluster, hardware=replace(cluster.hardware, comm_overlap=0.0))
    plan = autopar.price(run.spec, cluster, config, global_batch=run.global_batch,
                         stage_layers=run.stage_layers if config.pp > 1 else None)
    extra = foreign_zero3_s(run)
    return plan if extra == 0.0 else replace(plan, predicted=with_extra_time(plan.predicted, "zero3_runtime_s", extra))


def foreign_zero3_s(run: Any) -> float:
    """Seconds per step a published ZeRO-3 runtime other than FSDP's adds to the step autopar
    would run: the analytic runtime model's step under the row's `zero3` runtime minus its step
    under FSDP's (benchmarks/baselines/analytic/zero3.py, facts about the runtimes, no fitted
    number of their own), at the row's constants (`run.cluster`'s). 0 under FSDP's runtime,
    which autopar's own ZeRO-3 program is (a layer's weights gathered in one collective, the
    next layer's ahead, gradients reduce-scattered one bucket per layer beside the backward).

    DeepSpeed ZeRO-3 as released in 2021 (Megatron-LM SC'21 Table 2's baseline) gathers and
    reduces every parameter tensor with its own collective, prefetches at most 5e7 parameters
    ahead, gathers again for the activation recompute and blocks the backward on its gradient
    reduction (zero3.py DEEPSPEED_2021): at 1,536 ranks the per-tensor ring latencies alone
    outweigh a 175B layer's compute. The one model prices none of that (autopar runs none of
    it), so the difference is taken from the runtime model that does."""
    if run.options.zero3 == "fsdp" or run.config.zero < 3:
        return 0.0
    from benchmarks.lib.published_runs import price_run, profiles_for

    profiles = profiles_for([run])
    fsdp = replace(run, options=replace(run.options, zero3="fsdp"))
    return max(0.0, price_run(run, profiles).step_time_s - price_run(fsdp, profiles).step_time_s)


def with_extra_time(est: Any, term: str, seconds: float) -> Any:
    """`est` (an Estimate) with `seconds` more per step under `term`: throughput and FLOP
    rates scaled by the old step over the new, memory unchanged."""
    step = est.step_time_s + seconds
    k = est.step_time_s / step
    return replace(est, step_time_s=step, tokens_per_s=est.tokens_per_s * k,
                   tokens_per_s_per_device=est.tokens_per_s_per_device * k,
                   model_tflops_per_device=est.model_tflops_per_device * k, mfu=est.mfu * k,
                   hardware_tflops_per_device=est.hardware_tflops_per_device * k,
                   time_breakdown=(*est.time_breakdown, (term, seconds)))


def reduce_dtype(run: Any) -> str:
    """The row's gradient-reduction dtype as a precision policy names it: its published
    `grad_reduce_bytes` (4: float32, as Megatron-LM's bf16 path and torchtitan's FSDP default
    reduce; 2, the baseline's default: bfloat16). The one model prices the row under
    bf16-mixed with this reduction dtype, a plan choice autopar runs (autopar/precision.py)."""
    return "float32" if run.options.grad_reduce_bytes == 4 else "bfloat16"


PRICED_OPTIONS = frozenset({"grad_reduce_bytes", "compiled", "overlap_grad_reduce", "zero3"})
"""Runtime options the one model prices: as plan choices (`reduce_dtype`; `compiled`: the
per-rank graphs through Inductor, `--compile`), or as the published runtime's behaviour
(`overlap_grad_reduce` = False: the hardware's `comm_overlap` at 0, so no gradient sync
hides behind the backward; no row carries it with ZeRO-3, whose weight prefetch the same
factor scales; `zero3`: `foreign_zero3_s`). Not stack facts."""


def stack_facts(run: Any) -> list[str]:
    """What the row's published stack did that the one model does not price, as key=value:
    its runtime options (analytic/options.py) but those it prices (PRICED_OPTIONS), and the
    configuration fields the one model replaces by what autopar runs (fused attention,
    sequence parallelism with tp)."""
    out = [f"{k}={v}" for k, v in sorted(run.options.changed().items()) if k not in PRICED_OPTIONS]
    if run.config.attention != "flash":
        out.append(f"attention={run.config.attention}")
    if run.config.tp > 1 and not run.config.sequence_parallel:
        out.append("sequence_parallel=False")
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="?", default=str(DATA_CSV))
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--json", default=None)
    parser.add_argument("--rows", default=None, help="only these row indices (e.g. 10-15,22)")
    args = parser.parse_args(argv)
    runs, skipped = load_runs(args.csv, args.rows)
    profiles = profiles_for(runs, log=lambda m: print(m, file=sys.stderr))
    results: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for k, run in enumerate(runs, 1):
        analytic = price_run(run, profiles)
        entry: dict[str, Any] = {"row": run.index, "source": run.source_id, "publication": run.row["publication"],
                                 "model": run.row["model"], "gpus": run.cluster.num_devices, "config": run.label,
                                 "group": list(map(str, run.group)), "reported": run.reported_tokens_per_gpu,
                                 "analytic": analytic.tokens_per_s_per_device,
                                 "analytic_terms": dict(analytic.time_breakdown),
                                 "options": stack_facts(run)}
        t = time.perf_counter()
        try:
            plan = price_one_model(run)
        except (ValueError, RuntimeError) as exc:
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        else:
            est = plan.predicted
            entry.update(one=est.tokens_per_s_per_device, one_terms=dict(est.time_breakdown), fits=bool(est.fits),
                         step_one=est.step_time_s, step_analytic=analytic.step_time_s)
        entry["seconds"] = round(time.perf_counter() - t, 2)
        results.append(entry)
        print(f"[{k}/{len(runs)}] row {run.index} {run.row['model']} {run.label}: "
              + (f"one {entry['one'] / entry['reported'] - 1:+.1%}, analytic "
                 f"{entry['analytic'] / entry['reported'] - 1:+.1%}" if "one" in entry else entry["error"])
              + f" ({entry['seconds']} s)", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - t0
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True))
    Path(args.out).write_text(report(results, skipped, elapsed))
    print(f"wrote {args.out}")
    return 0


def _err(value: float, reported: float) -> float:
    return abs(value / reported - 1)


def _summary(rows: list[dict[str, Any]], key: str) -> str:
    errs = [_err(r[key], r["reported"]) for r in rows]
    return f"{statistics.median(errs):.1%} / {percentile(errs, 0.9):.1%}" if errs else "-"


def _signed(rows: list[dict[str, Any]], key: str) -> str:
    errs = [r[key] / r["reported"] - 1 for r in rows]
    return f"{statistics.median(errs):+.1%} / {statistics.median(abs(e) for e in errs):.1%}" if errs else "-"


def report(results: list[dict[str, Any]], skipped: list[str], elapsed: float) -> str:
    priced = [r for r in results if "one" in r]
    failed = [r for r in results if "one" not in r]
    lines = ["# The one model (what `autopar search` and `autopar price` compute) against published runs", "",
             "Generated by `.venv/bin/python benchmarks/validate_one_model.py`. Both columns use the committed "
             "constants of cost_model/efficiency.py, fitted on every row (the op costs and the overlapped gradient "
             "sync by the one model, the baseline's own terms by the analytic model), so neither is out "
             "of sample; the one model's own fit, left out by publication and by source, is in one_model_fit.md "
             "(benchmarks/fit/fit_one_model.py). Errors are |predicted / reported - 1| of tokens/s per GPU.", "",
             f"{len(priced)} rows priced by both, {len(failed)} not priced by the one model, {len(skipped)} rows "
             f"without a configuration; {elapsed:.0f} s.", "",
             "| rows | n | one model: median / p90 | analytic: median / p90 |", "|---|---|---|---|",
             f"| all | {len(priced)} | {_summary(priced, 'one')} | {_summary(priced, 'analytic')} |"]
    with_options = [r for r in priced if r["options"]]
    lines.append(f"| rows whose stack differs from autopar's (below) | {len(with_options)} | "
                 f"{_summary(with_options, 'one')} | {_summary(with_options, 'analytic')} |")
    pipes = [r for r in priced if " pp1 " not in r["config"]]
    lines.append(f"| pipelines (pp > 1) | {len(pipes)} | {_summary(pipes, 'one')} | {_summary(pipes, 'analytic')} |")
    for pub in sorted({r["publication"] for r in priced}):
        rows = [r for r in priced if r["publication"] == pub]
        lines.append(f"| {pub} | {len(rows)} | {_summary(rows, 'one')} | {_summary(rows, 'analytic')} |")
    lines += ["", "## What the one model leaves out, measured", "",
              "Each published stack fact the one model does not price (it prices what autopar runs), and the "
              "rows that carry it: the median signed error (predicted / reported - 1: positive is too fast) of "
              "each model, and the median |error|. The analytic baseline prices the fact; the gap between the "
              "two columns is what leaving it out costs on those rows. Rows carry several facts.", "",
              "| fact | rows | one model: signed / abs | analytic: signed / abs |", "|---|---|---|---|"]
    for fact in sorted({f for r in priced for f in r["options"]}) + [None]:
        rows = [r for r in priced if (fact in r["options"] if fact else not r["options"])]
        lines.append(f"| {fact or 'none (autopar-like stack)'} | {len(rows)} | {_signed(rows, 'one')} | "
                     f"{_signed(rows, 'analytic')} |")
    lines += ["", "## Rankings", "",
              "Groups of one model on one cluster at one sequence length under 2+ configurations: Spearman of "
              "predicted against measured throughput, and the regret of each model's top pick (1 - measured "
              "throughput of its pick / the measured best).", "",
              "| group | n | one: Spearman / regret | analytic: Spearman / regret |", "|---|---|---|---|"]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in priced:
        groups.setdefault(tuple(r["group"]), []).append(r)
    stats = {"one": ([], []), "analytic": ([], [])}
    for g, rows in sorted(groups.items()):
        if len(rows) < 2:
            continue
        cells = []
        best = max(r["reported"] for r in rows)
        for key in ("one", "analytic"):
            rho = spearman([r[key] for r in rows], [r["reported"] for r in rows])
            pick = max(rows, key=lambda r: r[key])
            regret = 1 - pick["reported"] / best
            stats[key][0].append(rho)
            stats[key][1].append(regret)
            cells.append(f"{rho:.2f} / {regret:.1%}")
        lines.append(f"| {g[0]} {g[1].split(':')[0]} {g[2]} GPUs seq {g[3]} | {len(rows)} | {cells[0]} | {cells[1]} |")
    for key in ("one", "analytic"):
        rhos, regrets = stats[key]
        if rhos:
            # a group whose predictions tie (Float8 runs priced as their bf16 twins) has no
            # Spearman (nan): the median and the worst are over the groups that have one
            ranked = [r for r in rhos if r == r]
            spear = (f"median Spearman {statistics.median(ranked):.2f} (worst {min(ranked):.2f}) over the "
                     f"{len(ranked)} groups whose predictions do not tie") if ranked else "no Spearman (predictions tie)"
            lines.append("")
            lines.append(f"{key}: {spear}; median regret {statistics.median(regrets):.1%} (worst "
                         f"{max(regrets):.1%}) over {len(rhos)} groups.")
    lines += ["", "## The 10 worst rows of the one model", "",
              "The term: the one model's largest time component, and the analytic step for comparison.", "",
              "| row | publication | model | GPUs | config | reported | one model | analytic | one model's largest term |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(priced, key=lambda r: -_err(r["one"], r["reported"]))[:10]:
        term, value = max(r["one_terms"].items(), key=lambda kv: kv[1])
        lines.append(f"| {r['row']} | {r['publication']} | {r['model']} | {r['gpus']} | {r['config']} | "
                     f"{r['reported']:,.0f} | {r['one']:,.0f} ({r['one'] / r['reported'] - 1:+.0%}) | "
                     f"{r['analytic']:,.0f} ({r['analytic'] / r['reported'] - 1:+.0%}) | "
                     f"{term.removesuffix('_s')} {value / r['step_one']:.0%} of {r['step_one']:.3g} s "
                     f"(analytic step {r['step_analytic']:.3g} s) |")
    if failed:
        lines += ["", "## Not priced by the one model", ""]
        lines += [f"- row {r['row']} {r['model']} {r['config']}: {r['error']}" for r in failed]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
