"""The published-configuration check on a small slice: the product's search
(solver/pipeline_search.py) is never worse than the template grid of
benchmarks/vs_hand_tuned.py nor than a hand-written configuration, all priced by the same
ILP stage costs (the full table: benchmarks/results/vs_hand_tuned.md)."""

from __future__ import annotations

import pytest

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.trace import trace_model
from solver.pipeline_search import search
from solver.search_config import SearchConfig

from benchmarks import vs_hand_tuned

SPEC = "llama:layers=4,hidden=256,heads=8,kv_heads=4,ffn=512,vocab=512,seq=256"


@pytest.fixture(scope="module")
def traces():
    """Traces shared by the memory limits (the search and the grid trace the same steps)."""
    return {}


@pytest.mark.parametrize("memory_gb", [0.04])  # memory binds: the best is a one-stage rc-selective plan
def test_search_never_worse_than_grid_or_hand(memory_gb, traces):
    source = resolve(SPEC)

    def trace_at(rows, recompute="none"):
        if (rows, recompute) not in traces:
            traces[(rows, recompute)] = trace_model(source, batch=rows, dtype="bfloat16", layers_traced=2,
                                                    recompute=recompute)
        return traces[(rows, recompute)]

    cluster = Cluster.parse("h100:1x4").with_memory_gb(memory_gb)
    batch = 16
    info = trace_at(1).model
    cache = vs_hand_tuned.GridCache(trace_at, cluster, batch, {}, None)
    result = search(trace_at, cluster, SearchConfig(global_batch=batch, model=SPEC, fingerprint="-", family="llama",
                                                    num_layers=info.num_layers))
    best = result.plan.predicted.step_time_s
    grid = vs_hand_tuned.grid(cache, cluster, batch, info)
    assert grid is not None and grid.fits
    assert best <= grid.step_time_s * (1 + vs_hand_tuned.TOL), (result.plan.config, grid)
    hand = vs_hand_tuned.price_template(ParallelConfig(tp=2, pp=2, dp=1, micro_batch=1, schedule="1f1b"), cache,
                                        cluster, batch, info.num_layers)
    assert hand is not None and best <= hand.step_time_s * (1 + vs_hand_tuned.TOL)
    # a plan beyond the grid names the choice; one inside it says nothing
    why = vs_hand_tuned.beyond_grid(result.plan, cache, cluster, batch, info.num_layers)
    assert why is None or any(w in why for w in ("per-op", "uneven", "interleave", "zbv", "stages differ"))
