"""Step model: SC'21 bubble fraction, attention kinds, recompute, ZeRO. (The speed of a
call is a benchmark's, benchmarks/bench_search.py: not a timed test.)"""

from __future__ import annotations

import pytest

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.trace import trace_model

from benchmarks.baselines.analytic import price, price_profile, profile_graph  # the baseline

SPEC = "gpt:layers=8,hidden=512,heads=8,vocab=1024,seq=256"


@pytest.fixture(scope="module")
def graph():
    return trace_model(resolve(SPEC), batch=1, dtype="bfloat16", layers_traced=2)


@pytest.fixture(scope="module")
def profile(graph):
    return profile_graph(graph)


CLUSTER = Cluster.parse("a100-80gb:2x8")


def _parts(est):
    return dict(est.time_breakdown)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_bubble_is_sc21_fraction(profile, schedule, v) -> None:
    p, dp, gb = 4, 4, 64
    est = price_profile(profile, ParallelConfig(pp=p, dp=dp, schedule=schedule, interleave=v), CLUSTER,
                        global_batch=gb)
    t = _parts(est)
    m = gb // dp
    busy = sum(t[k] for k in ("compute_s", "recompute_s", "comm_tp_s", "comm_pp_s", "comm_zero3_s"))
    # uniform stages give exactly (p-1)/(v m); here the last stage also runs the head and
    # is the critical one, so the others idle slightly longer per microbatch: a bit less
    sc21 = (p - 1) / (v * m)
    assert 0.85 * sc21 <= t["bubble_s"] / busy <= sc21


def test_math_attention_costs_time_and_memory(profile) -> None:
    flash = price_profile(profile, ParallelConfig(dp=16), CLUSTER, global_batch=16)
    math = price_profile(profile, ParallelConfig(dp=16, attention="math"), CLUSTER, global_batch=16)
    assert math.step_time_s > flash.step_time_s
    s, a, db = 256, 8, 2
    extra = dict(math.memory_breakdown)["activations_bytes"] - dict(flash.memory_breakdown)["activations_bytes"]
    assert extra == pytest.approx(8 * a * s * s * db, rel=0.01)  # softmax probs, 8 layers


def test_recompute_trades_time_for_memory(profile) -> None:
    ests = {r: price_profile(profile, ParallelConfig(dp=16, recompute=r), CLUSTER, global_batch=16)
            for r in ("none", "selective", "full")}
    assert ests["none"].step_time_s < ests["selective"].step_time_s < ests["full"].step_time_s
    assert ests["none"].peak_memory_bytes > ests["selective"].peak_memory_bytes > ests["full"].peak_memory_bytes
    assert _parts(ests["full"])["recompute_s"] == pytest.approx(_parts(ests["full"])["compute_s"] / 3, rel=0.1)


def test_tensor_parallel_adds_comm_and_divides_compute(profile) -> None:
    one = price_profile(profile, ParallelConfig(dp=16), CLUSTER, global_batch=16)
    four = price_profile(profile, ParallelConfig(tp=4, dp=4), CLUSTER, global_batch=16)
    assert _parts(four)["comm_tp_s"] > 0 == _parts(one)["comm_tp_s"]
    # each device does 1/4 of the work of 4x the sequences: never less than tp=1's time
    # (same FLOPs per device), more here because the quarter-size kernels pay fixed overheads
    assert _parts(four)["compute_s"] >= _parts(one)["compute_s"]


def test_graph_batch_scaling_is_linear(graph, profile) -> None:
    g4 = trace_model(resolve(SPEC), batch=4, dtype="bfloat16", layers_traced=2)
    cfg = ParallelConfig(dp=4, micro_batch=2, tp=4)
    a = price(g4, cfg, CLUSTER, global_batch=32)
    b = price_profile(profile, cfg, CLUSTER, global_batch=32)
    assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-3)
    # the gradient workspace scales its largest backward tensor linearly (may be a weight grad)
    assert a.peak_memory_bytes == pytest.approx(b.peak_memory_bytes, rel=5e-3)


def test_non_uniform_stage_layers(profile) -> None:
    cfg = ParallelConfig(pp=2, dp=8)
    even = price_profile(profile, cfg, CLUSTER, global_batch=64)
    skew = price_profile(profile, cfg, CLUSTER, global_batch=64, stage_layers=(6, 2))
    assert skew.step_time_s > even.step_time_s
    with pytest.raises(ValueError, match="stage_layers"):
        price_profile(profile, cfg, CLUSTER, global_batch=64, stage_layers=(7, 2))


def test_default_stage_layers_is_one_split_that_sums_to_the_layers(profile) -> None:
    """The even split the cost model prices is the one codegen's pipeline chunks run (one
    home: autopar/config.py), and it sums to L when pp does not divide L."""
    from autopar.config import default_stage_layers
    from autopar.capabilities import split_layers

    assert default_stage_layers(10, 4) == (3, 3, 2, 2) and default_stage_layers(8, 4) == (2, 2, 2, 2)
    for layers, stages in ((7, 3), (5, 5), (9, 2), (0, 1)):
        assert sum(default_stage_layers(layers, stages)) == layers
    assert tuple(len(r) for r in split_layers(10, 4)) == default_stage_layers(10, 4)
    cfg = ParallelConfig(pp=2, dp=8)  # no stage_layers: priced as the default split
    assert price_profile(profile, cfg, CLUSTER, global_batch=64).step_time_s == price_profile(
        profile, cfg, CLUSTER, global_batch=64,
        stage_layers=default_stage_layers(profile.num_layers, 2)).step_time_s


