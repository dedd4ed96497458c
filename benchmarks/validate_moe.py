"""Price the published mixture-of-experts runs with the one model, held out by construction.

    python benchmarks/validate_moe.py [--rows 0-5,9] [--group-tokens 512]
        [--out benchmarks/results/moe_validation.md] [--json benchmarks/results/moe_validation.json]

Every row of benchmarks/data/published_moe_runs.csv (sources and columns:
benchmarks/data/README.md) is priced by `autopar.price`, the path `autopar price` takes:
its `moe:` spec, cluster and configuration (benchmarks/lib/published_moe_runs.py) traced,
solved by the intra-op ILP under the configuration, cut into stages by the stage DP, at
the committed constants (cost_model/fitted_constants.json, cost_model/efficiency.py).

Out of sample: those constants were fitted on dense-model rows only (published_runs.csv,
benchmarks/fit/fit_one_model.py), so every MoE row and every MoE publication is held out;
the errors here are what leave-one-publication-out would report for them.

Expert parallelism is not a flag of `autopar price`: the experts' [E, d, f] weights are
placed by the ILP like any tensor. Each row reports the published EP degree beside the
ways the plan stores the routed experts split on E (`ep_priced`, from the plan's parameter
placement of the first expert weight). Storage is not compute: in the configurations
benchmarks/probes/probe_expert_placement.py solves, the expert matmuls take the weights
gathered to Replicate and split the token slots over dp whether the weights are stored
Shard(0) on E or FSDP-style (equal objectives), so no row is priced as the token
all-to-all of the measured systems' expert parallelism. Each row also gives the share of the experts' FLOPs that the
traced dense GShard dispatch adds, 2 g / (3 f) for groups of g tokens and experts of inner
size f (autopar/models/moe.py), which the index-based dispatch of the measured systems does
not pay.

Reported: per row predicted vs measured tokens/s per GPU; median and p90 |error| overall
and per publication, headline rows (bf16 on a GPU with a profile) apart from flagged ones.
A row that fails to price, or that takes longer than --row-limit-s, is listed with the reason.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autopar.plan import Plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.bench_stats import percentile, row_filter  # noqa: E402
from benchmarks.lib.published_moe_runs import (  # noqa: E402
    DEFAULT_GROUP_TOKENS, MOE_CSV, MoERun, experts_degree, load_moe_runs)

RESULTS = Path(__file__).resolve().parent / "results"


class RowTimeout(Exception):
    """A row's pricing ran past --row-limit-s."""


def _alarm(signum: int, frame: Any) -> None:
    raise RowTimeout


def price_row(run: MoERun, limit_s: int) -> dict[str, Any]:
    """One row priced by `autopar.price` (module docstring), with its reported figures."""
    import autopar
    from autopar.models.zoo import parse_spec

    cfg = parse_spec(run.spec)
    group = min(cfg.group_tokens or cfg.seq, cfg.seq)
    entry: dict[str, Any] = {
        "row": run.index, "publication": run.row["publication"], "source": run.row["source_id"],
        "model": run.row["model"], "gpus": run.cluster.num_devices, "hardware": run.cluster.hardware.name,
        "config": run.label, "ep_published": run.row["ep"], "reported": run.reported_tokens_per_gpu,
        "spec": run.spec, "priced_as": list(run.priced_as), "flags": list(run.flags),
        "dispatch_share": 2 * group / (3 * cfg.ffn_hidden)}
    t = time.perf_counter()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit_s)
    try:
        fixed = autopar.price(run.spec, run.cluster, run.config, global_batch=run.global_batch)
        chosen = autopar.price(run.spec, run.cluster, run.config, global_batch=run.global_batch, choose_zero=True)
    except RowTimeout:
        entry["error"] = f"not priced: over {limit_s} s on this machine"
    except (ValueError, RuntimeError) as exc:
        entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    else:
        entry.update(_priced(fixed, ""))
        entry.update(_priced(chosen, "chosen_"))
    finally:
        signal.alarm(0)
    entry["seconds"] = round(time.perf_counter() - t, 1)
    return entry


def _priced(plan: Plan, prefix: str) -> dict[str, Any]:
    """A plan's prediction and the experts' placement, keys prefixed."""
    est = plan.predicted
    degree, placement = experts_degree(plan)
    values = dict(predicted=est.tokens_per_s_per_device, step_s=est.step_time_s, fits=bool(est.fits),
                  peak_gib=est.peak_memory_bytes / 2**30, terms=dict(est.time_breakdown), ep_priced=degree,
                  experts_placement=placement)
    return {prefix + k: v for k, v in values.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="?", default=str(MOE_CSV))
    parser.add_argument("--rows", default=None, help="only these row indices (e.g. 0-5,9)")
    parser.add_argument("--group-tokens", type=int, default=DEFAULT_GROUP_TOKENS,
                        help=f"routing-group size of the priced dispatch (default {DEFAULT_GROUP_TOKENS})")
    parser.add_argument("--row-limit-s", type=int, default=180, help="give up on a row after this many seconds")
    parser.add_argument("--out", default=str(RESULTS / "moe_validation.md"))
    parser.add_argument("--json", default=str(RESULTS / "moe_validation.json"))
    args = parser.parse_args(argv)
    if args.group_tokens <= 0:
        print(f"error: --group-tokens must be positive, got {args.group_tokens}", file=sys.stderr)
        return 2
    try:
        keep = row_filter(args.rows)
        runs = [r for r in load_moe_runs(args.csv, args.group_tokens) if keep is None or r.index in keep]
    except (OSError, ValueError) as exc:
        print(f"error: cannot read the MoE runs from {args.csv} (--rows {args.rows}): {exc}. Give the CSV of "
              "benchmarks/data/published_moe_runs.csv's columns and row indices like 0-5,9", file=sys.stderr)
        return 2
    results = []
    t0 = time.perf_counter()
    for k, run in enumerate(runs, 1):
        entry = price_row(run, args.row_limit_s)
        results.append(entry)
        print(f"[{k}/{len(runs)}] row {run.index} {run.row['model']} {run.label}: "
              + (f"{entry['reported']:,.0f} tokens/s/GPU reported; published zero {entry['predicted']:,.0f} "
                 f"(ep {entry['ep_priced']}), zero chosen {entry['chosen_predicted']:,.0f} (ep {entry['chosen_ep_priced']})"
                 if "predicted" in entry else entry["error"]) + f" ({entry['seconds']} s)",
              file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - t0
    Path(args.json).write_text(json.dumps({"group_tokens": args.group_tokens, "rows": results}, indent=1,
                                          sort_keys=True) + "\n")
    Path(args.out).write_text(report(results, args.group_tokens, elapsed))
    print(f"wrote {args.out} and {args.json}")
    return 0


def _err(r: dict[str, Any], key: str) -> float:
    return abs(r[key] / r["reported"] - 1)


def _summary(rows: list[dict[str, Any]], key: str) -> str:
    errs = [_err(r, key) for r in rows]
    if not errs:
        return "- | -"
    signed = statistics.median(r[key] / r["reported"] - 1 for r in rows)
    return f"{statistics.median(errs):.1%} / {percentile(errs, 0.9):.1%} | {signed:+.1%}"


def _cell(r: dict[str, Any], prefix: str) -> str:
    fits = "" if r[prefix + "fits"] else f", over memory ({r[prefix + 'peak_gib']:.0f} GiB)"
    term, value = max(r[prefix + "terms"].items(), key=lambda kv: kv[1])
    return (f"{r[prefix + 'predicted']:,.0f} ({r[prefix + 'predicted'] / r['reported'] - 1:+.0%}), EP "
            f"{r[prefix + 'ep_priced']}{fits}; {term.removesuffix('_s')} {value / r[prefix + 'step_s']:.0%}")


def report(results: list[dict[str, Any]], group_tokens: int, elapsed: float) -> str:
    priced = [r for r in results if "predicted" in r]
    headline = [r for r in priced if not r["flags"]]
    lines = ["# The one model against published mixture-of-experts runs", "",
             "Generated by `.venv/bin/python benchmarks/validate_moe.py`. Each row of "
             "benchmarks/data/published_moe_runs.csv priced by `autopar.price` (what `autopar price` computes for "
             "its `moe:` spec and configuration) at the committed constants, which were fitted on dense rows only: "
             "every row here is held out, so these are leave-one-publication-out errors. Error = |predicted / "
             "reported - 1| of tokens/s per GPU; signed = median of predicted / reported - 1 (negative: the model "
             f"is too slow). Routing groups of {group_tokens} tokens, capacity factor 1.0 for the dropless, "
             "force-balanced runs.", "",
             "Two pricings per row: **published ZeRO** fixes the row's ZeRO stage (`autopar price --zero Z`; "
             "under ZeRO 0-2 every weight's compute placement is replicated over dp, so experts can be split "
             "over tp only); **ZeRO chosen** lets the ILP place each parameter (`autopar price` without "
             "`--zero`), so experts can be split on E over dp too, as Megatron-Core and DeepEP carve expert "
             "parallelism out of the data-parallel ranks.", "",
             f"{len(priced)} of {len(results)} rows priced ({len(headline)} headline: bf16 on a profiled GPU); "
             f"{elapsed:.0f} s.", "",
             "| rows | n | published ZeRO: median / p90 abs error | signed | ZeRO chosen: median / p90 | signed |",
             "|---|---|---|---|---|---|"]
    groups = [("headline (bf16, profiled GPU)", headline), ("all priced, flagged included", priced)]
    groups += [(f"{pub} (headline)", [r for r in headline if r["publication"] == pub])
               for pub in sorted({r["publication"] for r in priced})]
    for name, rows in groups:
        lines.append(f"| {name} | {len(rows)} | {_summary(rows, 'predicted')} | {_summary(rows, 'chosen_predicted')} |")
    lines += ["", "## Per row", "",
              "Each pricing: predicted tokens/s per GPU (error), EP: the ways the plan stores the routed experts "
              "[E, d, f] split on E (storage, not compute: benchmarks/probes/probe_expert_placement.py finds the "
              "expert matmuls gathering the weights and splitting the token slots either way), memory where over "
              "the budget, and the largest term "
              "of the step. Dispatch: FLOPs the traced dense dispatch and combine add, as a share of the experts' "
              "FLOPs (2 g / (3 f)).", "",
              "| row | publication | model | GPUs | config | EP | reported | published ZeRO | ZeRO chosen | "
              "dispatch | priced as | flags |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in priced:
        lines.append(f"| {r['row']} | {r['publication']} | {r['model']} | {r['gpus']} {r['hardware']} | "
                     f"{r['config']} | {r['ep_published'] or '-'} | {r['reported']:,.0f} | {_cell(r, '')} | "
                     f"{_cell(r, 'chosen_')} | {r['dispatch_share']:.2f} | {'; '.join(r['priced_as']) or '-'} | "
                     f"{'; '.join(r['flags']) or '-'} |")
    failed = [r for r in results if "predicted" not in r]
    if failed:
        lines += ["", "## Not priced", ""]
        lines += [f"- row {r['row']} {r['model']} {r['config']}: {r['error']}" for r in failed]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
