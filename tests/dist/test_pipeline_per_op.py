"""Per-op pipeline stages on real gloo ranks: the ILP's placements inside every stage.

World 4. Every pipeline here goes through `autopar.build.build_program` (pp > 1:
autopar/build/pipeline.py): the model is cut at its repeated layers and each stage compiled
by the per-op path on its (dp, tp) submesh. Hugging Face GPT-2 with tp 2 inside the
stages (which the rule tables never ran) and GPT-2 on 4 layers interleaved (the zoo's Llama
in ZeRO pipeline stages with full recomputation is tests/dist/test_train_numerics.py's); 3 AdamW steps each, losses equal the single-process
reference (rtol 1e-4, fp32) and parameters stay close (atol 1e-3). Price = run per rank:
the collectives the stage graphs run per step equal what the stages' ILP solutions priced.

The plan is the program for pipelines too: a pp2 x tp2 plan with its chunks' per-op
placements recorded (autopar.api.record_stage_placements), saved and loaded, runs in the
same spawn with chunk 0's placements edited to all-replicated: the ranks run exactly that
(no tp collective in chunk 0, where the file, as the stage ILP solved it, split parameters
over tp and priced tp collectives), so they replayed the file rather than solved; chunk 1
runs the Llama's pp2 x tp2 GPipe stage as solved. The same plan with an op renamed is refused by `autopar train`
before any rank starts; `autopar search` records a pipeline's chunk placements in the plan
file and `--emit` writes each chunk's per-rank forward/backward graphs.
"""

from __future__ import annotations

import pytest
import torch

from autopar.config import ParallelConfig as C
from autopar.build import train_worker
from autopar.runtime.jobs import TrainJob, reference_run
from autopar.runtime.launch import spawn
from tests.parallel import place_jobs

pytestmark = pytest.mark.dist

ZOO_LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=16"
CASES = {
    "hf-gpt2 pp2xtp2 1f1b": ("hf_factories:gpt2", C(pp=2, tp=2, schedule="1f1b")),
    "hf-gpt2-4 pp2xtp2 interleaved": ("hf_factories:gpt2_4layers",
                                      C(pp=2, tp=2, schedule="interleaved", interleave=2)),
}
BATCH = 8
REPLAYED = "zoo-llama pp2xtp2 gpipe, saved plan, chunk 0 edited to replicated"


def _jobs_worker(rank: int, jobs: tuple[TrainJob, ...]) -> list:
    return [train_worker(rank, job) for job in jobs]


@pytest.fixture(scope="module")
def pp2_plan(tmp_path_factory):
    """A pp2 x tp2 plan of the zoo Llama with both chunks' per-op placements recorded, saved
    to a file: the path."""
    from autopar.api import record_stage_placements
    from autopar.estimate import Estimate
    from autopar.models import resolve
    from autopar.plan import Plan, SearchInfo, fingerprint_source

    source, config = resolve(ZOO_LLAMA), C(pp=2, tp=2, schedule="gpipe")
    estimate = Estimate(step_time_s=1.0, tokens_per_s=1.0, tokens_per_s_per_device=1.0, model_tflops_per_device=0.0,
                        mfu=0.0, peak_memory_bytes=1, fits=True, memory_limit_bytes=2**30, time_breakdown=(),
                        memory_breakdown=(), config=())
    plan = Plan(model=ZOO_LLAMA, model_fingerprint=fingerprint_source(source), num_layers=2, seq=16,
                global_batch=BATCH, cluster="cpu:1x4", memory_limit_bytes=2**30, config=config, stage_layers=(1, 1),
                mesh_shape=(2, 1, 2), predicted=estimate,
                search=SearchInfo(cost_model="test", num_candidates=1, num_priced=1, num_pruned_memory=0,
                                  num_pruned_dominated=0, num_not_fitting=0))
    path = tmp_path_factory.mktemp("pp2") / "plan.json"
    record_stage_placements(plan).save(path)
    return path


def _replicated_chunk0(plan):
    """The plan with chunk 0's every op placed (R, R) and nothing priced for it."""
    from dataclasses import replace

    ops = tuple(replace(p, outputs=tuple("(R, R)" for _ in p.outputs), inputs=tuple("(R, R)" for _ in p.inputs))
                for p in plan.placements[0].placements)
    first = replace(plan.placements[0], placements=ops, collectives=())
    return replace(plan, placements=(first, *plan.placements[1:]))


@pytest.fixture(scope="module")
def runs(pp2_plan):
    from autopar.plan import Plan

    jobs = tuple(TrainJob(model=model, configs=(config,), steps=3, global_batch=BATCH, return_parameters=True)
                 for model, config in CASES.values())
    plan = _replicated_chunk0(Plan.load(pp2_plan))
    jobs += (TrainJob(model=ZOO_LLAMA, configs=(plan.config,), steps=3, global_batch=BATCH, return_parameters=True,
                      stage_layers=(plan.stage_layers,), plans=(plan.dumps(),)),)
    results = spawn(_jobs_worker, 4, (place_jobs(*jobs),))
    return {name: ([results[r][j][0] for r in range(4)], reference_run(job))
            for j, (name, job) in enumerate(zip((*CASES, REPLAYED), jobs))}


@pytest.mark.parametrize("case", [*CASES, REPLAYED])
def test_losses_and_parameters_match_the_reference(runs, case):
    per_rank, (ref_losses, ref_params) = runs[case]
    losses = per_rank[0].losses
    assert all(r.losses == losses for r in per_rank), "every rank reports the same global loss"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    merged: dict[str, torch.Tensor] = {}
    for r in per_rank:
        merged.update(r.parameters)
    assert set(merged) <= set(ref_params)
    for missing in set(ref_params) - set(merged):  # only tied aliases, returned under their first name
        assert any(torch.equal(ref_params[missing], ref_params[name]) for name in merged), missing
    for name, value in merged.items():
        torch.testing.assert_close(value, ref_params[name], atol=1e-3, rtol=0, msg=name)


@pytest.mark.parametrize("case", [*CASES, REPLAYED])
def test_price_equals_run(runs, case):
    per_rank, _ = runs[case]
    for rank, r in enumerate(per_rank):
        assert r.priced is not None and (r.collectives or case == REPLAYED and rank < 2), f"rank {rank}"
        assert r.collectives == r.priced, f"rank {rank}"


@pytest.mark.parametrize("case", [c for c in CASES if "tp2" in c])
def test_tp_splits_the_stages(runs, case):
    """tp 2 inside a stage: each rank holds well under its stage's whole parameters and
    the stage graphs communicate over tp."""
    per_rank, (_, ref_params) = runs[case]
    for r in per_rank:
        held = sum(v.numel() * v.element_size() for v in r.parameters.values())
        if held:
            assert r.parameter_bytes < 0.75 * held
        assert any(axis == "tp" for _, axis in r.collectives)


def test_saved_stage_placements_are_what_runs(runs, pp2_plan):
    """Ranks 0-1 hold chunk 0, whose placements the file sets to replicated: no collective
    and whole parameters there (replayed, not solved: the stage ILP shards under tp 2);
    ranks 2-3 run chunk 1 as recorded, over tp."""
    per_rank, (_, ref_params) = runs[REPLAYED]
    for r in per_rank[:2]:
        assert r.collectives == {} and r.priced == {}
    assert per_rank[0].parameter_bytes == per_rank[1].parameter_bytes
    assert per_rank[0].parameter_bytes == sum(v.numel() * v.element_size() for v in per_rank[0].parameters.values())
    for r in per_rank[2:]:
        assert any(axis == "tp" for _, axis in r.collectives)
    # the file's chunk 0 before the edit, as the stage ILP solved it: parameters split over
    # tp and tp collectives priced (what the ranks would have run without the edit)
    from autopar.plan import Plan

    solved = Plan.load(pp2_plan).placements[0]
    assert any(p.op == "placeholder" and "S(" in p.outputs[0].split(",")[-1] for p in solved.placements)
    assert any(axis == "tp" for _, axis, _, _ in solved.collectives), solved.collectives


def test_mismatched_stage_placements_refused_before_any_rank_starts(pp2_plan, tmp_path, capsys, no_ranks_started):
    import json

    from autopar import cli

    data = json.loads(pp2_plan.read_text())
    data["placements"][1]["placements"][-1][1] = "aten.weird_op.default"  # [key, op, outputs, inputs]
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(data))
    capsys.readouterr()
    assert cli.main(["train", ZOO_LLAMA, "--devices", "4", "--plan", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "autopar train: error: plan " in err and "does not match this model's pipeline chunk 1" in err, err
    assert "aten.weird_op.default in the plan" in err, err


def test_search_records_stage_placements_and_emits_each_chunk(tmp_path, capsys):
    """`autopar search --min-pp 2 --out --emit` under a tight memory budget (a pp2 x dp2
    ZeRO-2 plan under bf16-mixed here: ZeRO-3 would hold the raw gradients whole over the
    microbatches, ZeRO-2 accumulates their shards): the plan file carries each chunk's
    placements and the emitted source is each chunk's per-rank forward/backward graphs."""
    from autopar import cli
    from autopar.plan import Plan

    model = "llama:layers=4,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=256,seq=16"
    out, emitted = tmp_path / "plan.json", tmp_path / "emit"
    assert cli.main(["search", model, "--cluster", "a100-80gb:4x1", "--global-batch", "8", "--memory-gb", "0.014",
                     "--min-pp", "2", "--top", "1", "--out", str(out), "--emit", str(emitted)]) == 0
    capsys.readouterr()
    plan = Plan.load(out)
    chunks = plan.config.pp * plan.config.interleave
    assert plan.config.pp > 1, f"--min-pp 2 ranks pipelines only, got {plan.config}"
    assert [s.chunk for s in plan.placements] == list(range(chunks))
    assert all(s.placements and s.collectives for s in plan.placements)
    assert "replayed at build" in plan.explain()
    assert sorted(p.name for p in emitted.iterdir()) == [f"stage{k}.py" for k in range(chunks)]
    for k in range(chunks):
        code = (emitted / f"stage{k}.py").read_text()
        assert f"per-rank program of pipeline chunk {k}, placements: the plan's stage placements" in code
        assert "# forward:" in code and "# backward:" in code and "# grad_sync:" in code
        assert "_c10d_functional." in code and "wait_tensor" in code
