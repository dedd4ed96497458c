"""Stage cuts: the min-max cut equals brute force over all compositions; stage work sums to the graph."""

from __future__ import annotations

import itertools
import random

import pytest

from autopar.models import resolve
from autopar.trace import trace_model
from benchmarks.baselines.template.inter_op import balanced_cuts, cut_candidates, stage_work, uniform_cuts


def _compositions(total: int, parts: int):
    for bars in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *bars, total)
        yield tuple(edges[i + 1] - edges[i] for i in range(parts))


def _bottleneck(cuts, w, a, c):
    times = [n * w for n in cuts]
    times[0] += a
    times[-1] += c
    return max(times)


@pytest.mark.parametrize("seed", range(40))
def test_balanced_cut_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    layers, pp = rng.randint(2, 14), rng.randint(1, 6)
    pp = min(pp, layers)
    w = rng.uniform(0.5, 3.0)
    a, c = rng.choice([0.0, rng.uniform(0, 8)]), rng.choice([0.0, rng.uniform(0, 8)])
    cuts = balanced_cuts(layers, pp, w, a, c)
    assert len(cuts) == pp and sum(cuts) == layers and min(cuts) >= 1
    best = min(_bottleneck(x, w, a, c) for x in _compositions(layers, pp))
    assert _bottleneck(cuts, w, a, c) == pytest.approx(best, rel=1e-12)


def test_balanced_cut_lightens_end_stages_when_the_head_is_heavy() -> None:
    # head worth 3 layers on 4 stages of 20 layers total: the last stage gets 3 fewer-ish
    cuts = balanced_cuts(20, 4, 1.0, 0.0, 3.0)
    assert _bottleneck(cuts, 1.0, 0.0, 3.0) == 6.0
    assert cuts[-1] == 3


def test_uniform_cuts_give_remainder_to_middle_stages() -> None:
    assert uniform_cuts(10, 4) == (2, 3, 3, 2)
    assert uniform_cuts(8, 4) == (2, 2, 2, 2)
    with pytest.raises(ValueError, match="pp <= 3"):
        uniform_cuts(3, 4)


@pytest.fixture(scope="module")
def graph():
    return trace_model(resolve("llama-small"), batch=2, dtype="float32")


def test_stage_work_adds_up_to_the_traced_graph(graph) -> None:
    batch = 2
    work = stage_work(graph)
    total = work.num_layers * work.layer_flops + work.pre_flops + work.post_flops
    assert total * batch == pytest.approx(graph.flops_per_step, rel=1e-9)
    assert work.num_parameters == graph.model.num_parameters
    # analytic: the head is a (seq x hidden) @ (hidden x vocab) GEMM, fwd + 2 bwd, per sequence
    m = graph.model
    assert work.post_flops == pytest.approx(6 * m.seq * m.hidden * m.vocab, rel=1e-9)
    assert work.pre_params == m.vocab * m.hidden  # the embedding table


def test_cut_candidates_interleaved_needs_divisible_layers(graph) -> None:
    work = stage_work(graph)
    assert cut_candidates(work, 2, recompute="none", interleave=2) == ((2, 2),)
    assert cut_candidates(work, 2, recompute="none", interleave=3) == ()
    for cuts in cut_candidates(work, 3, recompute="full"):
        assert sum(cuts) == 4 and len(cuts) == 3
