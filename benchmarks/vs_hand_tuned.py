"""autopar's best plan vs the published hand-tuned configuration and vs a plain grid.

For every distinct (model, cluster, global batch) of the development-set rows of
benchmarks/data/published_runs.csv (the sources of ../shared/validation/published_runs_dev.csv;
`--all-sources` for every row), three plans are priced by the SAME cost model
(cost_model.price_profile on the same traced graph):
- hand:    the published configuration (tp, pp, dp, ZeRO, micro-batch, recompute,
           interleave). Knobs a source leaves unstated (micro-batch, interleave chunks, recompute) are
           filled with their best value under the cost model, so the baseline is the
           strongest reading of the published config. Several rows of one group: the best.
- grid:    a plain grid over (tp, pp, dp, zero, micro-batch, schedule, recompute) with the
           cost model's default even stage split; written out here, independent of the solver.
- autopar: solver.search (non-uniform cuts, interleave chunks, pruning).
Ratios are predicted throughput: hand_step / autopar_step (>= 1.0 means autopar is at least
as fast) and grid_step / autopar_step. Rows whose published degrees do not multiply to
the GPU count, or whose tp/pp split is not given, are listed as skipped. Attention (fused or
math) comes from the row's explicit `price_options`. When the output file exists, its
autopar plans are read first: the table says, per group, whether the current cost model
picks a different plan than the one recorded there (the previous model's winner).

Run: .venv/bin/python benchmarks/vs_hand_tuned.py [--out benchmarks/results/vs_hand_tuned.md]
"""

from __future__ import annotations

import argparse
import csv
import itertools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cost_model  # noqa: E402
from autopar.cluster import GIB, Cluster  # noqa: E402
from autopar.config import ParallelConfig  # noqa: E402
from autopar.models import resolve  # noqa: E402
from autopar.plan import InfeasiblePlanError, describe_config  # noqa: E402
from autopar.trace import trace_model  # noqa: E402
from solver.search import SearchSpace, search  # noqa: E402

CSV = Path(__file__).resolve().parent / "data" / "published_runs.csv"
DEV_SOURCES = ("megatron-sc21-table1", "megatron-sc21-table2", "torchtitan-2024-08", "llm-foundry-a100-80gb")
"""The sources of the project's development set (../shared/validation/published_runs_dev.csv)."""
LLAMA_SPECS = {
    "Llama 3 8B": "llama3-8b", "Llama 3 70B": "llama3-70b", "Llama 3.1 405B": "llama3-405b",
    "Llama 2 13B": "llama:layers=40,hidden=5120,heads=40,kv_heads=40,ffn=13824,vocab=32000,seq=4096",
    "Llama 2 70B": "llama:layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=32000,seq=4096",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    model: str
    spec: str
    seq: int
    cluster: str
    memory_gb: float | None
    global_batch: int
    attention: str


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _job(row: dict[str, str]) -> Job:
    from published_runs import _hardware_name, parse_options

    gpus = int(row["gpus"])
    opts = parse_options(row["price_options"])
    hw = _hardware_name(row["gpu_type"])
    memory_gb = float(opts["memory_gb"]) if "memory_gb" in opts else None
    cluster = f"{hw}:{gpus // 8}x8" if gpus % 8 == 0 else f"{hw}:1x{gpus}"
    seq = int(row["seq_len"])
    if row["model"] in LLAMA_SPECS:
        spec = LLAMA_SPECS[row["model"]]
    else:  # GPT (Megatron) and MPT (llm-foundry): GPT blocks with the row's sizes
        spec = f"gpt:layers={row['layers']},hidden={row['hidden']},heads={row['heads']},vocab={row['vocab']},seq={seq}"
    attention = opts.get("attention", "flash")
    return Job(model=row["model"], spec=spec, seq=seq, cluster=cluster, memory_gb=memory_gb,
               global_batch=int(row["global_batch"]), attention=attention)


def _hand_configs(row: dict[str, str], job: Job, num_layers: int) -> list[ParallelConfig] | str:
    """The published config, unstated micro-batch / interleave chunks expanded; or why skipped."""
    if not row["tp"] or not row["pp"]:
        return "tp/pp split not stated"
    tp, pp, dp, gpus = int(row["tp"]), int(row["pp"]), int(row["dp"]), int(row["gpus"])
    if tp * pp * dp != gpus:
        return f"tp*pp*dp = {tp * pp * dp} != {gpus} GPUs in the source"
    zero = int(row["zero_stage"][0]) if row["zero_stage"] else 0
    rc_text = row["recompute"].lower()
    recomputes = (["full"] if rc_text.startswith("full") else ["selective"] if rc_text.startswith("selective")
                  else ["none"] if rc_text.startswith("none") else ["none", "selective", "full"])  # unstated
    per_rank = job.global_batch // dp
    mbs = [int(row["micro_batch"])] if row["micro_batch"] else _divisors(per_rank)
    configs = []
    for b in mbs:
        m = per_rank // b
        if row["interleave"].startswith("yes") and pp > 1:
            scheds = [("interleaved", v) for v in range(2, 9) if m % pp == 0 and num_layers % (pp * v) == 0]
        else:
            scheds = [("1f1b", 1)]
        configs += [ParallelConfig(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=b, schedule=s, interleave=v,
                                   recompute=rc, attention=job.attention)  # type: ignore[arg-type]
                    for s, v in scheds for rc in recomputes]
    return configs or "no valid schedule for the published degrees"


def _grid(graph: Any, cluster: Cluster, job: Job, price: Any) -> tuple[float, ParallelConfig] | None:
    info, n = graph.model, cluster.num_devices
    best: tuple[float, ParallelConfig] | None = None
    for tp in _divisors(cluster.devices_per_node):
        if info.heads % tp or (info.kv_heads % tp and tp % info.kv_heads):
            continue
        for pp in _divisors(n // tp):
            dp = n // (tp * pp)
            if pp > info.num_layers or job.global_batch % dp:
                continue
            for b in _divisors(job.global_batch // dp):
                m = job.global_batch // (dp * b)
                scheds = [("1f1b", 1)] if pp == 1 else [("gpipe", 1), ("1f1b", 1)] + (
                    [("interleaved", 2)] if m % pp == 0 and info.num_layers % (2 * pp) == 0 else [])
                for (s, v), zero, rc in itertools.product(scheds, range(4), ("none", "selective", "full")):
                    cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=b, schedule=s,  # type: ignore[arg-type]
                                         interleave=v, recompute=rc, attention=job.attention)  # type: ignore[arg-type]
                    est = price(cfg, None)
                    if est.fits and (best is None or est.step_time_s < best[0]):
                        best = (est.step_time_s, cfg)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "vs_hand_tuned.md"))
    parser.add_argument("--limit", type=int, default=None, help="only the first N groups (quick look)")
    parser.add_argument("--all-sources", action="store_true", help="every row, not only the development set's")
    args = parser.parse_args(argv)

    rows = [r for r in csv.DictReader(CSV.open()) if args.all_sources or r["source_id"] in DEV_SOURCES]
    previous = _previous_plans(Path(args.out))
    groups: dict[Job, list[dict[str, str]]] = {}
    for row in rows:
        groups.setdefault(_job(row), []).append(row)
    # smallest clusters first: a cut-short run still covers most groups
    jobs = sorted(groups, key=lambda j: Cluster.parse(j.cluster).num_devices)[: args.limit]
    graphs: dict[tuple[str, int], Any] = {}
    lines = ["| model | cluster | batch | hand-tuned (published) | autopar plan | autopar/hand | autopar/grid | "
             "search s | winner vs the previous model |", "|---|---|---|---|---|---|---|---|---|"]
    changed: list[str] = []
    skipped: list[str] = []
    ratios_hand: list[float] = []
    ratios_grid: list[float] = []
    start = time.perf_counter()
    for job in jobs:
        key = (job.spec, job.seq)
        if key not in graphs:
            graphs[key] = trace_model(resolve(job.spec).with_overrides(seq=job.seq), batch=1, dtype="bfloat16",
                                      layers_traced=2)
        graph = graphs[key]
        cluster = Cluster.parse(job.cluster).with_memory_gb(job.memory_gb)
        profile = cost_model.profile_graph(graph)

        def price(cfg: ParallelConfig, cuts: tuple[int, ...] | None, _c: Cluster = cluster, _p: Any = profile,
                  _b: int = job.global_batch) -> Any:
            return cost_model.price_profile(_p, cfg, _c, global_batch=_b, stage_layers=cuts)

        hand: tuple[float, ParallelConfig, Any] | None = None
        reasons = []
        for row in groups[job]:
            configs = _hand_configs(row, job, graph.model.num_layers)
            if isinstance(configs, str):
                reasons.append(configs)
                continue
            for cfg in configs:
                try:
                    cfg.check(global_batch=job.global_batch, num_devices=cluster.num_devices, heads=graph.model.heads,
                              kv_heads=graph.model.kv_heads, num_layers=graph.model.num_layers)
                except ValueError as exc:
                    reasons.append(str(exc))
                    continue
                est = price(cfg, None)
                if hand is None or (est.fits, -est.step_time_s) > (hand[2].fits, -hand[0]):
                    hand = (est.step_time_s, cfg, est)
        label = f"{job.model} on {job.cluster}, batch {job.global_batch} x seq {job.seq}"
        if hand is None:
            skipped.append(f"{label}: {'; '.join(dict.fromkeys(reasons))}")
            continue
        t0 = time.perf_counter()
        try:
            result = search(graph, cluster, global_batch=job.global_batch, price=price, model=job.spec,
                            fingerprint="-", cost_model_name="cost_model.price_profile",
                            space=SearchSpace(attention=job.attention))
        except InfeasiblePlanError as exc:
            skipped.append(f"{label}: autopar found no fitting plan ({exc})")
            continue
        search_s = time.perf_counter() - t0
        grid = _grid(graph, cluster, job, price)
        best = result.ranked[0]
        auto_step = best.estimate.step_time_s
        hand_cell = describe_config(hand[1], (), job.global_batch) + (
            "" if hand[2].fits else f" (does NOT fit: {hand[2].peak_memory_bytes / GIB:.0f} GiB)")
        ratio_hand = hand[0] / auto_step
        ratio_grid = grid[0] / auto_step if grid else float("nan")
        if hand[2].fits:
            ratios_hand.append(ratio_hand)
        ratios_grid.append(ratio_grid)
        plan_text = describe_config(best.config, best.stage_layers, job.global_batch)
        before = previous.get((job.model, job.cluster, f"{job.global_batch}x{job.seq}"))
        if before is None:
            verdict = "not in the previous table"
        elif before == plan_text:
            verdict = "same plan"
        else:
            verdict = f"CHANGED (was {before})"
            changed.append(f"{job.model} on {job.cluster}, batch {job.global_batch}x{job.seq}: {before} -> {plan_text}")
        lines.append(f"| {job.model} | {job.cluster} | {job.global_batch}x{job.seq} | {hand_cell}: {hand[0]:.3g} s | "
                     f"{plan_text}: {auto_step:.3g} s | "
                     f"{ratio_hand:.3f}{'' if hand[2].fits else ' (hand over memory)'} | {ratio_grid:.3f} | "
                     f"{search_s:.1f} | {verdict} |")
        print(lines[-1], flush=True)
        _write(args.out, lines + ["", f"(partial: {len(lines) - 2} of {len(jobs)} groups so far)"])
    total_s = time.perf_counter() - start
    summary = [
        "",
        f"{len(ratios_hand)} groups compared with a fitting hand config; autopar/hand predicted-throughput ratio: "
        f"min {min(ratios_hand):.3f}, median {sorted(ratios_hand)[len(ratios_hand) // 2]:.3f}, "
        f"max {max(ratios_hand):.3f}; rows below 1.0: {sum(r < 1 - 1e-9 for r in ratios_hand)}."
        if ratios_hand else "no group compared",
        f"autopar/grid ratio: min {min(ratios_grid):.3f}, max {max(ratios_grid):.3f}; rows below 1.0: "
        f"{sum(r < 1 - 1e-9 for r in ratios_grid)}." if ratios_grid else "",
        f"total wall time {total_s:.0f} s.",
        "",
        f"Groups where the current cost model picks a different plan than the previous table recorded: {len(changed)}"
        + (" (previous table not found)" if not previous else ""),
    ] + [f"- {c}" for c in changed]
    if skipped:
        summary += ["", "Skipped groups:"] + [f"- {s}" for s in skipped]
    _write(args.out, lines + summary)
    print("\n".join(summary))
    return 0 if ratios_hand and min(ratios_hand) >= 1 - 1e-9 and min(ratios_grid) >= 1 - 1e-9 else 1


def _previous_plans(path: Path) -> dict[tuple[str, str, str], str]:
    """(model, cluster, batch) -> the autopar plan text recorded in an earlier table."""
    if not path.exists():
        return {}
    plans = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[0] not in ("model", "---") and ":" in cells[4]:
            plans[(cells[0], cells[1], cells[2])] = cells[4].rsplit(":", 1)[0].strip()
    return plans


def _write(out: str, body: list[str]) -> None:
    header = [
        "# autopar vs published hand-tuned configurations (predicted, same cost model)",
        "",
        "Generated by `.venv/bin/python benchmarks/vs_hand_tuned.py`. Every plan below is priced by "
        "`cost_model.price_profile` on the same traced graph; the ratios are predicted throughput "
        "(step time of the baseline / step time of autopar's plan), not measured runs. Unstated "
        "published knobs (micro-batch, interleave chunks, recompute) take their best value under the cost model. "
        "MPT rows are modelled as GPT blocks of the same sizes (no ALiBi).",
        "",
    ]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("\n".join(header + body) + "\n", encoding="ascii")


if __name__ == "__main__":
    sys.exit(main())
