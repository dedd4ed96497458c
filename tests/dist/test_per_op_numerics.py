"""The per-op compiler on real gloo ranks: the ILP's placements, applied, train like one process.

World 4, meshes 2x2 and 1x4. Every model (the zoo's GPT, Hugging Face Llama and
DistilBERT built from configs, and a GPT whose 6 heads do not divide tp 4) trains 3 AdamW
steps under the forced configuration `--tp 4`, DistilBERT also under its searched plan
and the six-head GPT under `--dp 2 --tp 2` (solver/forced.py); losses equal the single-process
reference (rtol 1e-4) and parameters stay close (atol 1e-3). Price = run: on every rank
the collectives the program's graphs contain per step (kind, mesh axis, count, bytes)
equal what the plan or the ILP priced.
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from autopar.api import search_plans
from autopar.config import ParallelConfig as C
from autopar.plan import Plan
from autopar.build import train_worker
from autopar.runtime.jobs import TrainJob, reference_run
from autopar.runtime.launch import spawn
from tests.parallel import forkserver_context, place_jobs

pytestmark = pytest.mark.dist

MODELS = {
    "zoo-gpt": "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=16",
    "hf-llama": "hf_factories:llama",
    "hf-distilbert": "hf_factories:distilbert",
    "six-heads": "gpt:layers=2,hidden=96,heads=6,vocab=128,seq=16",
}
FORCED = {"dp2xtp2": C(dp=2, tp=2), "tp4": C(dp=1, tp=4)}
CONFIGS_OF = {
    model: (*(("dp2xtp2", "tp4") if model == "six-heads" else ("tp4",)),
            *(("searched",) if model == "hf-distilbert" else ()))
    for model in MODELS
}
"""Every model trains --tp 4 (everything sharded); --dp 2 --tp 2 runs on the heads that do
not divide tp. The searched plan replayed is DistilBERT's: on cpu:4 at this batch the zoo
GPT's and the six-head GPT's searches choose the same dp4 layout, so replaying theirs too
tested the same program three times. Elsewhere: tensor parallelism on the zoo's Llama (tests/dist/
test_train_numerics.py, test_mixed_precision.py) and on Hugging Face GPT-2 (in pipeline
stages, test_pipeline_per_op.py); 2-D meshes on the zoo's GPT (with sequence parallelism,
test_train_numerics.py) and on a Hugging Face Llama (test_mixed_precision.py); the zoo
Llama's and Hugging Face GPT-2's searched plans, through the CLI (test_search_plans_run.py
and `make demo`). Left out here to keep the suite inside 15 minutes."""
CASES = [(m, c) for m in MODELS for c in CONFIGS_OF[m]]
BATCH = 8
BIG_VOCAB = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=4096,seq=16"
"""Embedding and head are most of this model: under a tight memory budget the ILP shards
them and not the rest, a per-parameter choice no template (uniform ZeRO stage, family
TP rules) expresses."""


def _searched(model: str, memory_gb: float | None = None) -> str:
    return search_plans(model, "cpu:4", global_batch=BATCH, microbatch_choices=1, top=1, max_pp=1,
                        memory_gb=memory_gb).plan.dumps()


def _budget_plan() -> tuple[str, str]:
    free = Plan.loads(_searched(BIG_VOCAB))
    return _searched(BIG_VOCAB, 0.6 * free.predicted.peak_memory_bytes / 2**30), free.dumps()


def _search_all() -> tuple[dict[str, Plan], Plan, Plan]:
    """Every model's searched plan and the budget pair, in two processes: each search is
    single-threaded, so one process left the second core idle while the fixture's
    searches ran (62 of its 177 s in one measurement). Searches are deterministic across
    processes (tests/unit/test_search.py::test_plan_json_is_byte_identical_across_processes)."""
    with ProcessPoolExecutor(max_workers=2, mp_context=forkserver_context()) as pool:
        budget = pool.submit(_budget_plan)  # the longest chain first
        plans = {name: pool.submit(_searched, model) for name, model in MODELS.items()
                 if "searched" in CONFIGS_OF[name]}
        return ({name: Plan.loads(f.result()) for name, f in plans.items()},
                *(Plan.loads(text) for text in budget.result()))


def _jobs_worker(rank: int, jobs: tuple[TrainJob, ...]) -> list:
    return [train_worker(rank, job) for job in jobs]


@pytest.fixture(scope="module")
def runs():
    jobs = []
    # one stage: the searched plans of these models are one-stage ones anyway; pipelines of
    # the per-op program are tests/dist/test_pipeline_per_op.py's
    searched, budget, free = _search_all()
    for name, model in MODELS.items():
        forced = [FORCED[c] for c in CONFIGS_OF[name] if c in FORCED]
        plans = [searched[name]] if name in searched else []
        jobs.append(TrainJob(model=model, configs=(*forced, *(p.config for p in plans)),
                             plans=(*[None] * len(forced), *(p.dumps() for p in plans)),
                             steps=3, global_batch=BATCH, return_parameters=True))
    jobs.append(TrainJob(model=BIG_VOCAB, configs=(budget.config,), plans=(budget.dumps(),), steps=3,
                         global_batch=BATCH, return_parameters=True))
    results = spawn(_jobs_worker, 4, (place_jobs(*jobs),))
    out = {name: ([results[r][j] for r in range(4)], reference_run(job))
           for j, (name, job) in enumerate(zip(MODELS, jobs))}
    out["budget"] = ([results[r][-1] for r in range(4)], reference_run(jobs[-1]), budget, free)
    return out


@pytest.mark.parametrize("model, config", CASES)
def test_losses_and_parameters_match_the_reference(runs, model, config):
    per_rank, (ref_losses, ref_params) = runs[model]
    results = [r[CONFIGS_OF[model].index(config)] for r in per_rank]
    losses = results[0].losses
    assert all(r.losses == losses for r in results), "every rank reports the same global loss"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    params = {}
    for r in results:
        params.update(r.parameters)
    assert params and set(params) <= set(ref_params)  # tied aliases appear once, under the first name
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], atol=1e-3, rtol=0, msg=name)


@pytest.mark.parametrize("model, config", CASES)
def test_price_equals_run(runs, model, config):
    per_rank, _ = runs[model]
    for rank, r in enumerate(per_rank):
        result = r[CONFIGS_OF[model].index(config)]
        assert result.priced is not None
        assert result.collectives == result.priced, f"rank {rank}"


@pytest.mark.parametrize("model", MODELS)
def test_forced_tp4_shards_the_model(runs, model):
    """--tp 4 splits every matrix over the 4 ranks (the six-head GPT included: its heads do
    not divide 4, the ILP shards it another way): each rank holds well under half."""
    per_rank, _ = runs[model]
    tp4 = per_rank[0][CONFIGS_OF[model].index("tp4")]
    unique = {v.data_ptr(): v for v in runs[model][1][1].values()}  # tied weights once
    whole = sum(v.numel() * v.element_size() for v in unique.values())
    assert tp4.parameter_bytes < 0.5 * whole
    if "dp2xtp2" in CONFIGS_OF[model]:
        dp2tp2 = per_rank[0][CONFIGS_OF[model].index("dp2xtp2")]
        assert tp4.parameter_bytes < dp2tp2.parameter_bytes
    assert ("all_reduce", "tp") in tp4.collectives or ("all_gather", "tp") in tp4.collectives


def test_memory_budget_plan_no_template_expresses_runs(runs):
    """Under 60% of the unconstrained plan's memory the ILP shards some parameters over an
    axis and keeps others replicated over it (per-parameter ZeRO): it fits, runs, and
    trains like one process."""
    per_rank, (ref_losses, ref_params), plan, free = runs["budget"]
    assert plan.predicted.peak_memory_bytes <= plan.memory_limit_bytes < free.predicted.peak_memory_bytes
    params = dict(plan.intra_op_info.parameters)
    sharded = {name for name, pl in params.items() if "S(" in pl}
    whole = {name for name, pl in params.items() if "S(" not in pl}
    assert sharded and whole, params  # a mixed layout: neither data parallel nor a uniform ZeRO stage
    results = [r[0] for r in per_rank]
    torch.testing.assert_close(torch.tensor(results[0].losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    merged = {}
    for r in results:
        merged.update(r.parameters)
    for name, value in merged.items():
        torch.testing.assert_close(value, ref_params[name], atol=1e-3, rtol=0, msg=name)
    assert all(r.collectives == r.priced for r in results)
