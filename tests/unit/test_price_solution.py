"""`solver.forced.price_solution`: a solution's own placements priced on another
hardware profile (what the CPU sweep's calibrated column charges for the program that ran,
benchmarks/sweep_cpu.py `predict_ilp`). Oracles: on the profile it was solved on, it
gives back the solve's own choices and cost; on another profile, the same placements as
the given solution and that profile's price of them, which no plan of the other profile's
own solve undercuts."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from autopar.cluster import HARDWARE, Cluster
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.placing import solve_config
from solver.forced import price_solution
from autopar.trace import trace_step


def _graph(config: ParallelConfig):
    source = resolve("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=16")
    torch.manual_seed(0)
    example = source.example_inputs(config.dp * config.micro_batch, generator=torch.Generator().manual_seed(1))
    return trace_step(source.build(), list(example))[1]


def _placements(solution):
    return {c.node: (c.outputs, c.inputs) for c in solution.choices}


@pytest.mark.parametrize("config", [ParallelConfig(dp=2, tp=2, micro_batch=2), ParallelConfig(tp=4, micro_batch=4)],
                         ids=["dp2-tp2", "tp4"])
def test_prices_the_given_placements(config: ParallelConfig) -> None:
    graph = _graph(config)
    builtin = Cluster.parse("cpu:4")
    ran = solve_config(graph, config, builtin, num_microbatches=2)
    same = price_solution(graph, config, ran, builtin, num_microbatches=2)
    assert _placements(same) == _placements(ran)
    assert same.cost.total_s == pytest.approx(ran.cost.total_s, rel=1e-9)
    # another profile: collectives 20x dearer, compute unchanged
    hw = HARDWARE["cpu"]
    dear = replace(hw, intra_node_latency_s=20 * hw.intra_node_latency_s,
                   intra_node_bandwidth_bytes_per_s=hw.intra_node_bandwidth_bytes_per_s / 20,
                   inter_node_bandwidth_bytes_per_s=hw.inter_node_bandwidth_bytes_per_s / 20)
    other = Cluster.parse("cpu:4", hardware=dear)
    priced = price_solution(graph, config, ran, other, num_microbatches=2)
    own = solve_config(graph, config, other, num_microbatches=2)
    assert _placements(priced) == _placements(ran)
    assert priced.cost.reshard_s > ran.cost.reshard_s  # the same collectives, dearer
    assert own.cost.total_s <= priced.cost.total_s * (1 + 1e-9)  # its own optimum is no worse


def test_a_solution_of_another_mesh_is_refused() -> None:
    graph = _graph(ParallelConfig(dp=4, micro_batch=1))
    ran = solve_config(graph, ParallelConfig(dp=4, micro_batch=1), Cluster.parse("cpu:4"), num_microbatches=1)
    with pytest.raises(ValueError, match="mesh"):
        price_solution(graph, ParallelConfig(dp=2, tp=2, micro_batch=2), ran, Cluster.parse("cpu:4"),
                       num_microbatches=1)
