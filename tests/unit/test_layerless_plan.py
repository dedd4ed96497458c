"""Plans for models without a repeated layer stack: one stage holding everything.

A plain MLP of distinct layers, a small CNN and an embedding + linear head trace to 0
layers. The search used to build stage_layers [1] for them, which its own plan validation
refused ("sum to 1 but the model has 0 layers"); now the cost model, the solver and the
plan agree on [0] with pp = 1. Training them: tests/dist/test_layerless_models.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from autopar import cli
from autopar.api import search_plan
from autopar.plan import Plan, PlanFileError
from tests import factories


@pytest.mark.parametrize("factory", [factories.mlp, factories.cnn, factories.embedding_head],
                         ids=["mlp", "cnn", "embedding_head"])
def test_search_plans_one_stage_holding_everything(factory):
    model, batch = factory()
    plan = search_plan(model, "cpu:2", example_inputs=batch)
    assert plan.num_layers == 0 and plan.stage_layers == (0,) and plan.config.pp == 1
    assert plan.config.tp * plan.config.dp == 2  # one stage on a (dp, tp) mesh, per-op placements
    assert [(s.first_layer, s.num_layers, s.has_embedding, s.has_head) for s in plan.stages] == [(0, 0, True, True)]
    assert plan.placements and plan.intra_op_info is not None
    # every parameter has a placement in the plan (the one stage holds them all)
    named = {n for n, _ in plan.intra_op_info.parameters}
    assert named == {n for n, _ in model.named_parameters()}
    assert Plan.loads(plan.dumps()) == plan
    assert "one stage: the whole model (every module, no repeated layer stack)" in plan.explain()


def test_plan_validation_keeps_stages_and_layers_consistent():
    model, batch = factories.mlp()
    plan = search_plan(model, "cpu:2", example_inputs=batch)
    with pytest.raises(PlanFileError, match=r"stage_layers \[1\] sum to 1 but the model has 0 layers"):
        dataclasses.replace(plan, stage_layers=(1,), stages=())
    with pytest.raises(PlanFileError, match=r"or \[0\] with pp=1 for a model without a repeated layer stack"):
        dataclasses.replace(plan, num_layers=2, stage_layers=(0,), stages=())


def test_cli_search_of_a_layerless_factory(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cli.main(["search", "tests.factories:cnn", "--cluster", "cpu:2", "--global-batch", "8",
                     "--out", str(out), "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["plans"]
    assert ranked and all(p["stage_layers"] == [0] and p["config"]["pp"] == 1 for p in ranked)
    assert Plan.load(str(out)).stage_layers == (0,)


def test_a_plan_says_where_ranks_only_repeat_the_step():
    """A mesh axis on which a solution shards nothing: every rank of it runs the whole step,
    and the label says so (the degrees name devices, not parallelism). The search's axes
    have roles (the batch split over dp, matrices over tp), so its own plans rarely leave an
    axis idle; a placement solved without roles shows the case."""
    import dataclasses

    from autopar.api import search_plans
    from autopar.cluster import Cluster
    from autopar.trace import trace_step
    from solver.intra_op.ilp import solve_intra_op
    from solver.pipeline_plans import repeated_axes

    from autopar.placement import Replicate, Shard

    model, batch = factories.batchnorm_cnn()
    graph = trace_step(model, batch)[1]
    solved = solve_intra_op(graph, Cluster.parse("cpu:4"), (2, 2))

    def with_placements(axis0, axis1):
        def one(p):
            return None if p is None else (axis0, axis1)
        return dataclasses.replace(solved, choices=tuple(
            dataclasses.replace(c, outputs=tuple(map(one, c.outputs)), inputs=tuple(map(one, c.inputs)))
            for c in solved.choices))

    assert repeated_axes(with_placements(Replicate(), Replicate())) == ("dp", "tp")
    assert repeated_axes(with_placements(Replicate(), Shard(0))) == ("dp",)
    assert repeated_axes(with_placements(Shard(0), Shard(0))) == ()
    result = search_plans("tests.factories:mlp", "cpu:2", global_batch=8, top=5)
    best = dataclasses.replace(result.ranked[0], repeated_axes=("dp",))
    assert "only repeat the step" in best.label(8) and best.to_json(8)["repeated_axes"] == ["dp"]
    # the search's plans that split the batch over dp say nothing of the kind
    assert any(r.config.dp == 2 and not r.repeated_axes and "only repeat" not in r.label(8) for r in result.ranked)


def test_throughput_of_a_model_without_tokens_is_in_samples():
    """An image model has no token ids: `search` predicts, and `train` measures, samples per
    second by one definition (its 3 channels are not a sequence, its pixels not tokens)."""
    from autopar.api import search_plans
    from autopar.commands.train import _tokens_per_step
    from autopar.runtime.jobs import TrainJob

    plan = search_plans("tests.factories:tiny_vit", "cpu:4", global_batch=8, top=1).plan
    assert plan.seq == 1
    assert plan.predicted.tokens_per_s == pytest.approx(8 / plan.predicted.step_time_s)
    assert _tokens_per_step(TrainJob(model="tests.factories:tiny_vit", configs=())) == (8, "samples/s")
    # token ids: tokens
    assert _tokens_per_step(TrainJob(model="tests.factories:dict_batch", configs=())) == (8 * 16, "tokens/s")
