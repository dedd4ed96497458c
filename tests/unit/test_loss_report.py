"""Price = run for the reported loss: the one-stage program reduces its loss over every
mesh axis where the ILP left it Partial (autopar/runtime/spmd.py `global_loss`), and the
step's price (solver/spmd_search.py `estimate`) carries exactly that, once per step."""

from __future__ import annotations

import pytest
import torch

import cost_model
from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.placement import Partial
from autopar.placing import solve_config
from autopar.trace import trace_step
from cost_model.collectives import LOSS_BYTES
from solver.spmd_search import SpmdCandidate, estimate

SPEC = "llama:layers=2,hidden=64,heads=4,kv_heads=4,ffn=128,vocab=128,seq=16"


@pytest.mark.parametrize("dp,tp", [(4, 1), (2, 2), (1, 4)])
def test_one_stage_step_pays_its_loss_reduction(dp: int, tp: int) -> None:
    source = resolve(SPEC)
    torch.manual_seed(0)
    rows = dp * 2
    graph = trace_step(source.build(), source.example_inputs(rows, generator=torch.Generator().manual_seed(1)))[1]
    cluster = Cluster.parse("cpu:4")
    config = ParallelConfig(dp=dp, tp=tp, micro_batch=2)
    solution = solve_config(graph, config, cluster, num_microbatches=2)
    est = estimate(graph, solution, SpmdCandidate(mesh=(dp, tp), microbatch=rows, num_microbatches=2), cluster,
                   2 * rows)
    terms = dict(est.time_breakdown)
    placements = solution.choice(graph.loss).outputs[0]
    links = cost_model.mesh_axis_links(cluster, solution.mesh_shape)
    want = sum(cost_model.all_reduce_time_s(LOSS_BYTES, link) for p, link in zip(placements, links)
               if isinstance(p, Partial))
    assert terms["loss_report_s"] == pytest.approx(want)
    if dp > 1:  # the batch is split over dp: each rank holds its share of the mean
        assert isinstance(placements[0], Partial) and want > 0
    assert est.step_time_s == pytest.approx(2 * solution.cost.total_s + terms["optimizer_s"] + terms["grad_accum_s"]
                                            + terms["loss_report_s"])
