"""One cost model: `autopar price` of a searched plan's configuration, and `autopar price
--plan` of the saved plan, reproduce the search's predicted step time and peak memory for
each of its top-5 plans (within 1%), on a zoo and a Hugging Face model on cpu:4, and a zoo
model on h100:16x8.

The configuration is given as the search prints it (`Ranked.price_flags`: `--zero` only
where every parameter, or every stage, has that one ZeRO layout; a mixed plan is priced
with the layout left to the ILP, as searched)."""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.api import search_plans
from autopar.cli import main

CASES = [
    ("llama-small", "cpu:4", 8, None),
    ("tests.hf_factories:gpt2", "cpu:4", 8, None),
    ("llama3-8b", "h100:16x8", 512, 4096),
]


def _price(capsys, args: list[str]) -> dict:
    assert main(["price", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model,cluster,batch,seq", CASES, ids=[c[0].rsplit(":", 1)[-1] for c in CASES])
def test_price_reproduces_the_search(capsys, tmp_path, model, cluster, batch, seq) -> None:
    result = search_plans(model, cluster, global_batch=batch, seq=seq, top=5)
    assert len(result.plans) == len(result.ranked) == 5
    assert any(r.config.pp > 1 for r in result.ranked) or cluster == "h100:16x8"
    where = ["--cluster", cluster, "--global-batch", str(batch)] + (["--seq", str(seq)] if seq else [])
    for i, (ranked, plan) in enumerate(zip(result.ranked, result.plans)):
        want_t, want_m = ranked.estimate.step_time_s, ranked.estimate.peak_memory_bytes
        assert plan.predicted.step_time_s == pytest.approx(want_t, rel=1e-9)
        by_flags = _price(capsys, [model, *where, *ranked.price_flags()])
        path = tmp_path / f"plan{i}.json"
        plan.save(path)
        by_plan = _price(capsys, ["--plan", str(path)])
        for got in (by_flags, by_plan):
            assert got["step_time_s"] == pytest.approx(want_t, rel=0.01), (i, ranked.label(batch))
            assert got["peak_memory_bytes"] == pytest.approx(want_m, rel=0.01), (i, ranked.label(batch))
            assert got["fits"] is True
            assert got["stage_layers"] == list(ranked.stage_layers)
            # communication by kind (solver/comm_time.py): a one-stage plan's closes on its reshard row
            if ranked.config.pp == 1:
                assert sum(r["time_s"] for r in got["communication"]) == pytest.approx(
                    got["time_breakdown"]["reshard_s"], rel=1e-9)
        assert [(r["kind"], r["axis"]) for r in by_plan["communication"]] == \
            [(r["kind"], r["axis"]) for r in by_flags["communication"]]
        assert by_plan["plan_step_time_s"] == pytest.approx(want_t, rel=1e-9)
    best = result.ranked[0]
    by_api = autopar.price(model, cluster, best.config, global_batch=batch, seq=seq, choose_zero=best.zero_mixed)
    assert by_api.predicted.step_time_s == pytest.approx(best.estimate.step_time_s, rel=0.01)


def test_a_plan_of_another_model_is_refused(capsys, tmp_path) -> None:
    plan = search_plans("llama-small", "cpu:4", global_batch=8, top=1).plan
    edited = json.loads(plan.dumps())
    edited["model_fingerprint"] = "0" * 64
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(edited))
    assert main(["price", "--plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert "another version of 'llama-small'" in err and "search it again" in err


def test_a_zero_2_candidate_is_labelled_and_priced_as_searched(capsys) -> None:
    """The one-stage search's ZeRO-2 alternative (solver/spmd_search.py solve_candidate, tried
    where memory pushed the ILP to ZeRO-3 weights): its solution syncs every microbatch, its
    label says zero 2, and `autopar price` with the flags the search prints reproduces it."""
    from autopar.api import LAYERS_TRACED
    from autopar.cluster import Cluster
    from autopar.models import resolve
    from autopar.trace import trace_model
    from solver.results import Ranked
    from solver.spmd_search import SpmdCandidate, solve_candidate, zero_is_uniform

    spec = "llama-small"
    cluster = Cluster.parse("cpu:4")

    def trace_at(rows: int, recompute: str = "none"):
        dtype = autopar.ParallelConfig().policy(cluster.hardware.name).compute  # the search's
        return trace_model(resolve(spec), batch=rows, dtype=dtype, layers_traced=LAYERS_TRACED, recompute=recompute)

    cand = SpmdCandidate(mesh=(4, 1), microbatch=4, num_microbatches=2)
    solved = solve_candidate(trace_at, cand, cluster, 8, graphs={}, time_limit_s=None, zero=2)
    assert solved is not None and solved.solution.grads_each_microbatch
    assert dict(solved.estimate.config)["zero"] == 2
    ranked = Ranked(config=autopar.ParallelConfig(dp=4, micro_batch=1, zero=2), stage_layers=(4,),
                    estimate=solved.estimate, bubble_fraction=0.0,
                    zero_mixed=not zero_is_uniform(solved.graph, solved.solution,
                                                   autopar.ParallelConfig(dp=4, micro_batch=1, zero=2)))
    assert ranked.price_flags()[-2:] == ("--zero", "2")
    got = _price(capsys, [spec, "--cluster", "cpu:4", "--global-batch", "8", *ranked.price_flags()])
    assert got["step_time_s"] == pytest.approx(solved.estimate.step_time_s, rel=0.01)
    assert got["peak_memory_bytes"] == pytest.approx(solved.estimate.peak_memory_bytes, rel=0.01)
