"""Placements decided before any rank builds (autopar/placing.py, autopar/plan.py ProgramPlacements).

No process group. The placements solved for a configuration, recorded per node key and read
back on a trace like each rank's, are exactly the ILP's choices for every node (so a rank
builds the program the solver chose); they travel to the ranks as JSON and back unchanged;
a plan's own are read without solving; a plan that records none is refused with what to do;
and the rule for syncing gradients every microbatch agrees with the solver's.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from autopar.build.one_stage import trace_microbatch
from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.placing import priced_per_step, program_placements, solution_choices, solve_config
from autopar.plan import PlanFileError, ProgramPlacements

MODEL = "gpt-tiny"


def _model_and_batch() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    source = resolve(MODEL)
    torch.manual_seed(0)
    return source.build(), source.example_inputs(8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("config", [ParallelConfig(dp=2, tp=2), ParallelConfig(dp=4, zero=2)])
def test_solved_placements_are_the_ilps_choices_on_the_ranks_trace(config):
    model, batch = _model_and_batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    placed = program_placements(model, config, batch, model_name=MODEL, fused_kernels=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # a copy was traced
    assert placed.origin == "solved" and placed.config == config and placed.placements

    _, graph = trace_microbatch(copy.deepcopy(model), config, batch)  # as a rank traces its step
    m = 8 // (config.dp * config.micro_batch)
    solution = solve_config(graph, config, Cluster.parse(f"cpu:1x{config.num_devices}"), num_microbatches=m)
    assert placed.choices_for(graph) == solution_choices(graph, solution)
    priced = priced_per_step(solution, m, ("dp", "tp"))
    assert {(k, a): (c, b) for k, a, c, b in placed.collectives} == priced
    assert placed.grads_each_microbatch == solution.grads_each_microbatch == (config.zero == 2)

    assert ProgramPlacements.loads(placed.dumps()) == placed


def test_a_plans_placements_are_read_not_solved(monkeypatch):
    from autopar.api import search_plan
    from solver import forced

    model, batch = _model_and_batch()
    plan = search_plan(model, "cpu:2", example_inputs=batch)
    assert plan.config.pp == 1 and plan.placements

    def refuse(*args, **kwargs):
        raise AssertionError("a plan's placements were solved again")

    monkeypatch.setattr(forced, "solve_one_stage", refuse)
    placed = program_placements(model, plan.config, batch, plan=plan)
    assert placed.origin == "plan" and placed.placements == plan.placements
    assert placed.collectives == plan.intra_op_info.collectives

    with pytest.raises(PlanFileError, match="records no per-op placements"):
        ProgramPlacements.of_plan(type(plan).from_json({**plan.to_json(), "placements": []}))


def test_program_placements_refuse_what_no_rank_can_build():
    config = ParallelConfig(pp=2, dp=1)
    with pytest.raises(PlanFileError, match=r"was given per-op placements for chunks \[\], but its config \(pp 2, "
                                            r"interleave 1\) has chunks \[0, 1\]"):
        ProgramPlacements(model=MODEL, config=config, origin="solved")
    with pytest.raises(PlanFileError, match=r"was given per-op placements for chunks \[\], .* has chunks \[0\]"):
        ProgramPlacements(model=MODEL, config=ParallelConfig(dp=2), origin="solved")
    with pytest.raises(PlanFileError, match="origin"):
        ProgramPlacements(model=MODEL, config=config, origin="guessed")


def test_each_microbatch_sync_rule_agrees_with_the_solver():
    from solver.forced import zero_2_syncs

    for zero, dp, tp in itertools.product((0, 1, 2, 3), (1, 2, 4), (1, 2)):
        config = ParallelConfig(zero=zero, dp=dp, tp=tp)
        assert config.syncs_each_microbatch == zero_2_syncs(config), config


def test_a_jobs_builds_that_trace_the_same_step_trace_it_once(monkeypatch):
    """TraceMemo (autopar/build/one_stage.py): the ZeRO stages of one dp degree trace one
    step; another microbatch, recomputation or compiled twin is traced only where the step
    differs; after the job's last build the memo holds nothing."""
    from autopar.build import one_stage

    calls = []
    real = one_stage.trace_step
    monkeypatch.setattr(one_stage, "trace_step", lambda *a, **k: calls.append(k["recompute"]) or real(*a, **k))
    _, batch = _model_and_batch()
    configs = [ParallelConfig(dp=4), ParallelConfig(dp=4, zero=3), ParallelConfig(dp=4, compiled=True),
               ParallelConfig(dp=2, tp=2), ParallelConfig(dp=2, tp=2, recompute="full")]
    memo = one_stage.TraceMemo(builds_left=len(configs))
    graphs = []
    for config in configs:
        memo.builds_left -= 1  # as autopar.build.build_program counts the job's builds
        model, _ = _model_and_batch()
        graphs.append(trace_microbatch(model, config, batch, memo=memo)[1])
    assert calls == ["none", "none", "full"]  # dp 4 (3 builds: one trace), dp 2 x tp 2, its recompute
    assert graphs[1] == graphs[0] and graphs[2].compiled and not graphs[0].compiled
    assert memo.traced is None and memo.graph is None  # nothing outlives the last build
    fresh = trace_microbatch(_model_and_batch()[0], configs[1], batch)[1]
    assert fresh.nodes == graphs[1].nodes  # what a trace of its own gives
