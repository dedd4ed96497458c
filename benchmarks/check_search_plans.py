"""Every plan the search returns runs: the full property grid, on this machine.

    .venv/bin/python benchmarks/check_search_plans.py [--worlds 2,4,8] [--models zoo-gpt,...]
        [--top 5] [--steps 2] [--out benchmarks/results/search_plans_run]

For every model (the zoo's GPT and Llama; Hugging Face GPT-2, Llama, DistilBERT, Mixtral and
Qwen2-MoE built from configs, tests/hf_factories.py) and every cluster `cpu:N` (N in --worlds), the search
(`autopar.api.search_plans`, what `autopar search` runs) returns its top plans;
each plan trains --steps steps on N real gloo ranks (`autopar.build.train_worker`,
what `autopar train --plan` runs; all plans of one world in one set of ranks), and its
losses are compared with the single-process reference (`reference_run`, rtol 1e-4), and the
collectives its program ran with those its plan priced (price = run). The suite runs a
slice of this grid (tests/dist/test_search_plans_run.py: cpu:4, two models); the whole grid
takes tens of minutes on 2 cores, so it is a script that prints and writes a table.

Exit status 1 when any plan fails to build, diverges from the reference or runs
collectives other than those priced.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {
    "zoo-gpt": "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=16",
    "zoo-llama": "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=16",
    "hf-gpt2": "tests.hf_factories:gpt2",
    "hf-llama": "tests.hf_factories:llama",
    "hf-distilbert": "tests.hf_factories:distilbert",
    "hf-mixtral": "tests.hf_factories:mixtral",
    "hf-qwen2-moe": "tests.hf_factories:qwen2_moe",
}
GLOBAL_BATCH = 8
"""The Hugging Face factories' batch (tests/hf_factories.py BATCH); zoo models use the same."""
RTOL = 1e-4


def _jobs_worker(rank: int, jobs: tuple[Any, ...]) -> list[Any]:
    """One set of ranks trains every job; a job that raises is reported, not fatal."""
    import torch.distributed as dist

    from autopar.build import train_worker

    out = []
    for job in jobs:
        try:
            out.append(("ok", train_worker(rank, job)))
        except Exception:  # reported per plan in the table; the other plans still run
            out.append(("error", traceback.format_exc(limit=6)))
            dist.barrier()
    return out


def _search(model: str, world: int, top: int) -> list[Any]:
    from autopar.api import search_plans

    return list(search_plans(model, f"cpu:{world}", global_batch=GLOBAL_BATCH, top=top).plans)


def check_world(world: int, models: dict[str, str], top: int, steps: int) -> list[dict[str, Any]]:
    import torch

    from autopar.explain import describe_config
    from autopar.runtime.jobs import TrainJob, reference_run
    from autopar.runtime.launch import spawn

    rows, jobs = [], []
    for name, spec in models.items():
        t0 = time.perf_counter()
        plans = _search(spec, world, top)
        search_s = time.perf_counter() - t0
        for i, plan in enumerate(plans):
            rows.append({"world": world, "model": name, "rank_in_search": i + 1,
                         "plan": describe_config(plan.config, plan.stage_layers, GLOBAL_BATCH),
                         "search_s": round(search_s, 2)})
            jobs.append(TrainJob(model=spec, configs=(plan.config,), plans=(plan.dumps(),), steps=steps,
                                 global_batch=GLOBAL_BATCH, stage_layers=(plan.stage_layers,)))
    from autopar.placing import place_job

    # each searched plan's placements (read from it, or solved for it), decided before the ranks start
    per_rank = spawn(_jobs_worker, world, (tuple(map(place_job, jobs)),), timeout_s=3600.0)
    references: dict[str, list[float]] = {}
    for row, job, j in zip(rows, jobs, range(len(jobs))):
        if job.model not in references:
            references[job.model] = reference_run(job)[0]
        status = [per_rank[r][j] for r in range(world)]
        errors = [s[1] for s in status if s[0] == "error"]
        if errors:
            row.update(ok=False, error=errors[0].strip().splitlines()[-1])
            continue
        results = [s[1][0] for s in status]
        losses = list(results[0].losses)
        ref = references[job.model]
        match = all(r.losses == results[0].losses for r in results) and torch.allclose(
            torch.tensor(losses, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64), rtol=RTOL, atol=0.0)
        priced = results[0].priced
        price_run = None if priced is None else all(r.collectives == r.priced for r in results)
        row.update(ok=bool(match) and price_run is not False, losses=losses, reference=ref, match=bool(match),
                   price_equals_run=price_run)
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| cluster | model | # | plan | search s | losses match (rtol 1e-4) | price = run | result |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pr = {None: "n/a (pipeline)", True: "yes", False: "NO"}[r.get("price_equals_run")]
        result = "ok" if r["ok"] else f"FAIL: {r.get('error', 'mismatch')}"
        lines.append(f"| cpu:{r['world']} | {r['model']} | {r['rank_in_search']} | {r['plan']} | {r['search_s']} | "
                     f"{'yes' if r.get('match') else 'no'} | {pr} | {result} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4,8")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "search_plans_run"))
    args = p.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    models = {m: MODELS[m] for m in args.models.split(",")}
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for world in (int(w) for w in args.worlds.split(",")):
        rows += check_world(world, models, args.top, args.steps)
        print(_table([r for r in rows if r["world"] == world]), flush=True)
    elapsed = time.perf_counter() - start
    failed = [r for r in rows if not r["ok"]]
    summary = (f"{len(rows)} plans ({len(models)} models x clusters cpu:{args.worlds.replace(',', ', cpu:')}, "
               f"top {args.top}), {len(rows) - len(failed)} train {args.steps} steps matching the reference; "
               f"{len(failed)} fail; {elapsed:.0f} s")
    print(summary)
    doc = (f"# Every searched plan runs (property grid)\n\nGenerated by `python benchmarks/"
           f"check_search_plans.py --worlds {args.worlds} --top {args.top} --steps {args.steps}` "
           f"(see the script's docstring for what is compared).\n\n{summary}\n\n{_table(rows)}\n")
    Path(args.out + ".md").write_text(doc)
    Path(args.out + ".json").write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
