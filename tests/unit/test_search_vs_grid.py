"""Issue 14's published-configuration check on a small slice: the product's search
(solver/pipeline_search.py) is never worse than the template grid of
benchmarks/vs_hand_tuned.py nor than a hand-written configuration, all priced by the same
ILP stage costs (the full table: benchmarks/results/vs_hand_tuned.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.trace import trace_model
from solver.pipeline_search import _StageCostCache, search

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import vs_hand_tuned  # noqa: E402

SPEC = "llama:layers=8,hidden=256,heads=8,kv_heads=4,ffn=512,vocab=512,seq=256"


@pytest.mark.parametrize("memory_gb", [None, 0.03, pytest.param(0.04, marks=pytest.mark.xfail(strict=True, reason=(
    "known gap: one-stage plans are searched without recompute (the per-op program traces with "
    "config.recompute, but pipeline_search's one-stage candidates never ask for it), so the grid's "
    "pp1 dp4 z3 rc-selective beats the searched pipeline when memory binds")))])
def test_search_never_worse_than_grid_or_hand(memory_gb):
    source = resolve(SPEC)
    traces: dict[int, object] = {}

    def trace_at(rows):
        if rows not in traces:
            traces[rows] = trace_model(source, batch=rows, dtype="bfloat16", layers_traced=2)
        return traces[rows]

    cluster = Cluster.parse("h100:1x4").with_memory_gb(memory_gb)
    batch = 16
    info = trace_at(1).model
    cache = _StageCostCache(trace_at, cluster, batch, {}, None)
    result = search(trace_at, cluster, global_batch=batch, model=SPEC, fingerprint="-", family="llama",
                    num_layers=info.num_layers)
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
