"""Parameter gathers travel in groups: which reshards qualify (`single_gather_axis`), how
the pricing shares one latency per group, and that the ILP's reported collectives count
one all-gather per (layer, phase) group of a ZeRO-3 plan.

The per-rank program issues the same groups (codegen/apply.py); tests/dist checks that the
collectives counted in the program equal the priced ones."""

from __future__ import annotations

import pytest

from autopar.buckets import gather_share
from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.placement import Partial, Replicate, Shard, single_gather_axis
from autopar.trace import trace_model

R = Replicate()


@pytest.mark.parametrize("src, dst, axis", [
    ((Shard(0), R), (R, R), 0),
    ((Shard(0), Shard(1)), (R, Shard(1)), 0),
    ((R, Shard(0)), (R, R), 1),
    ((Shard(0), Shard(0)), (R, Shard(0)), None),  # nested shards of one dim: not a plain gather
    ((Shard(0), R), (Shard(1), R), None),  # all-to-all
    ((Shard(0), Shard(1)), (R, R), None),  # two axes
    ((Partial(), R), (R, R), None),  # a reduction
    ((R, R), (R, R), None),
])
def test_single_gather_axis(src, dst, axis):
    assert single_gather_axis(src, dst) == axis


def test_share_of_one_latency():
    sizes = [10.0, 30.0, 60.0]
    assert sum(gather_share(b, sum(sizes)) for b in sizes) == pytest.approx(1.0)
    assert gather_share(5.0, 0.0) == 1.0


def test_zero3_plan_prices_one_gather_per_layer_and_phase():
    from autopar.placing import priced_per_step, solve_config

    source = resolve("llama-tiny")
    graph = trace_model(source, batch=4, dtype="float32", layers_traced=source.config.layers)
    solution = solve_config(graph, ParallelConfig(dp=4, zero=3), Cluster.parse("cpu:4"), num_microbatches=1)
    gathers = [c for c in solution.collectives if c.kind == "all_gather" and c.axis == 0]
    # every parameter is sharded over dp and gathered where it is used: at most one gather per
    # (layer or outside the stack) x (forward, backward), far fewer than the parameters
    groups = source.config.layers + 1
    assert 0 < len(gathers) <= 2 * groups
    params = sum(1 for n in graph.nodes if n.param_name)
    assert len(gathers) < params
    calls, nbytes = priced_per_step(solution, 1, ("dp",))[("all_gather", "dp")]
    assert calls == len(gathers) and nbytes == sum(c.bytes for c in gathers)
