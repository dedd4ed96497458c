"""The optimizer step's per-tensor epilogue is priced on the parameter tensors a rank holds:
every parameter of the model once (a graph traced on 2 of 4 layers weighs its layer
parameters x2), in one-stage plans (spmd_search.estimate) and in pipeline stage costs (the
pieces sum to the same count)."""

from __future__ import annotations

import dataclasses

import pytest

import cost_model
from autopar.cluster import HARDWARE, Cluster
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.placing import solve_config
from autopar.trace import trace_model
from solver.spmd_search import SpmdCandidate, _local_parameter_tensors, _local_parameters, estimate
from solver.stage_costs import split_solution

SPEC = "llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=16"
PER_TENSOR_S = 40e-6


def _cpu(per_tensor_s: float) -> object:
    eff = dict(HARDWARE["cpu"].efficiency or ())
    eff["optimizer_tensor_overhead_s"] = per_tensor_s
    return dataclasses.replace(HARDWARE["cpu"], efficiency=tuple(sorted(eff.items())))


@pytest.mark.parametrize("config", [ParallelConfig(dp=4, micro_batch=1), ParallelConfig(dp=2, tp=2, micro_batch=2)])
def test_every_parameter_tensor_pays_the_epilogue_once(config: ParallelConfig) -> None:
    source = resolve(SPEC)
    tensors = len(list(source.build().parameters()))
    graph = trace_model(source, batch=4, dtype="float32", layers_traced=2)
    with_overhead = Cluster.parse("cpu:4", hardware=_cpu(PER_TENSOR_S))
    without = Cluster.parse("cpu:4", hardware=_cpu(0.0))
    solution = solve_config(graph, config, without, num_microbatches=1)
    assert _local_parameter_tensors(graph, solution) == pytest.approx(tensors)
    cand = SpmdCandidate(mesh=(config.dp, config.tp), microbatch=4, num_microbatches=1)
    a = dict(estimate(graph, solution, cand, with_overhead, 4).time_breakdown)
    b = dict(estimate(graph, solution, cand, without, 4).time_breakdown)
    share = cost_model.core_share(with_overhead)
    assert a["optimizer_s"] - b["optimizer_s"] == pytest.approx(tensors * PER_TENSOR_S * share)
    assert b["optimizer_s"] == pytest.approx(
        cost_model.optimizer_time_s(_local_parameters(graph, solution), without.hardware) * share)
    # the pipeline search's pieces of the same solution hold the same tensors between them
    costs = [split_solution(graph, solution, c, microbatch=4, num_microbatches=1, zero=0)
             for c in (with_overhead, without)]
    layers = graph.model.num_layers

    def total(sc) -> float:
        pre, layer, post = sc.pieces
        return pre.time_s + layers * layer.time_s + post.time_s

    assert total(costs[0]) - total(costs[1]) == pytest.approx(tensors * PER_TENSOR_S * share)
