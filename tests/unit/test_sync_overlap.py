"""The overlapped gradient sync in the one model (cost_model/table.py `exposed_sync_s`):
where the program syncs inside the step graph (one microbatch, or ZeRO-2's every
microbatch) the sync is charged as max(S_last, S - rho W), in the ILP's objective and in
the solution's price alike; elsewhere in full.

The built-in cpu profile hides nothing (comm_overlap 0, measured), so these solve on it
with comm_overlap 1: rho = grad_sync_overlap_efficiency."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import cost_model
from autopar.cluster import HARDWARE, Cluster
from autopar.config import ParallelConfig
from autopar.ir import Phase
from autopar.models import resolve
from autopar.placing import solve_config
from autopar.trace import trace_step
from solver.comm_time import OVERLAPPED, one_stage_communication
from solver.forced import price_solution

OVERLAPPING = Cluster.parse("cpu:4", hardware=replace(HARDWARE["cpu"], comm_overlap=1.0))
EXPOSED = Cluster.parse("cpu:4")


def _graph(config: ParallelConfig):
    source = resolve("llama:layers=3,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=16")
    torch.manual_seed(0)
    example = source.example_inputs(config.dp * config.micro_batch, generator=torch.Generator().manual_seed(1))
    return trace_step(source.build(), list(example))[1]


def test_exposed_sync_formula() -> None:
    assert cost_model.exposed_sync_s(1.0, 0.2, 3.0, 0.5) == pytest.approx(0.2)  # all but the last bucket hidden
    assert cost_model.exposed_sync_s(1.0, 0.2, 0.4, 0.5) == pytest.approx(0.8)  # the window hides 0.2
    assert cost_model.exposed_sync_s(1.0, 0.2, 3.0, 0.0) == 1.0  # no overlap: charged in full
    assert cost_model.grad_sync_overlap(EXPOSED) == 0.0
    assert cost_model.grad_sync_overlap(OVERLAPPING) == pytest.approx(
        cost_model.DEFAULT_EFFICIENCY.grad_sync_overlap_efficiency)


def test_one_microbatch_hides_the_sync_behind_the_backward() -> None:
    config = ParallelConfig(dp=4, zero=1, micro_batch=1)
    graph = _graph(config)
    own = solve_config(graph, config, OVERLAPPING, num_microbatches=1)
    cost = own.cost
    hidden = cost.sync_hidden_s
    assert hidden > 0
    assert cost.total_s == pytest.approx(cost.compute_s + cost.comm_s + cost.reshard_s - hidden, rel=1e-12)
    # hidden = min(S - S_last, rho W) <= rho x the backward's compute at the chosen placements
    backward = sum(c.weight * c.compute_s for c in own.choices if graph[c.node].phase is Phase.BACKWARD)
    assert hidden <= cost_model.grad_sync_overlap(OVERLAPPING) * backward * (1 + 1e-9)
    # the same placements where nothing overlaps: the same collectives, charged in full
    exposed = price_solution(graph, config, own, EXPOSED, num_microbatches=1)
    assert exposed.cost.sync_hidden_s == 0
    assert exposed.cost.reshard_s == pytest.approx(cost.reshard_s, rel=1e-12)
    assert exposed.cost.total_s == pytest.approx(cost.total_s + hidden, rel=1e-12)
    # the ILP minimises the overlapped price: the plan solved without overlap, priced with
    # it, is no cheaper
    other = solve_config(graph, config, EXPOSED, num_microbatches=1)
    assert cost.total_s <= price_solution(graph, config, other, OVERLAPPING, num_microbatches=1).cost.total_s \
        * (1 + 1e-9)
    # the per-kind table: the collectives' rows and the overlapped row add up to the
    # resharding the step waits for
    rows = one_stage_communication(own, 1)
    assert [r.time_s for r in rows if r.kind == OVERLAPPED] == [pytest.approx(-hidden)]
    assert sum(r.time_s for r in rows) == pytest.approx(cost.reshard_s - hidden, rel=1e-9)


@pytest.mark.parametrize("zero, overlapped", [(1, False), (2, True)])
def test_several_microbatches_overlap_only_under_zero_2(zero: int, overlapped: bool) -> None:
    """ZeRO 0, 1 and 3 sync once after the last microbatch (the grad_sync graph): exposed.
    ZeRO-2 reduce-scatters inside every microbatch's backward: overlapped."""
    config = ParallelConfig(dp=4, zero=zero, micro_batch=1)
    graph = _graph(config)
    solution = solve_config(graph, config, OVERLAPPING, num_microbatches=2)
    assert (solution.cost.sync_hidden_s > 0) is overlapped
    assert all(r.kind != OVERLAPPED for r in one_stage_communication(solution, 2)) is not overlapped
