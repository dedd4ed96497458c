"""The inter-op DP (solver/stage_dp.py) equals brute force over every cut x per-stage
option assignment on small cases, under the same stage costs (DESIGN.md oracle)."""

from __future__ import annotations

import itertools
import random

import pytest

from solver.stage_dp import Schedule, StageOption, solve_pipeline, stage_memory_bytes, stage_time_s, step_time_s


def _compositions(total, parts):
    for bars in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *bars, total)
        yield tuple(edges[i + 1] - edges[i] for i in range(parts))


def brute_force(L, p, m, options, schedule, budget, share=1.0):
    """Every composition of L into p stages x every option per stage, priced directly."""
    if not schedule.allows(p, m):
        return None
    best = None
    for cuts in _compositions(L, p):
        if any(n % schedule.chunks for n in cuts):
            continue
        for assign in itertools.product(range(len(options)), repeat=p):
            if any(stage_memory_bytes(options[i], n, k, p, m, schedule) > budget
                   for k, (n, i) in enumerate(zip(cuts, assign))):
                continue
            times = [stage_time_s(options[i], n, k, p, schedule) for k, (n, i) in enumerate(zip(cuts, assign))]
            t = step_time_s(times, m, schedule, share)
            if best is None or t < best[0]:
                best = (t, cuts, assign)
    return best


def _random_options(rng, count):
    out = []
    for i in range(count):
        out.append(StageOption(
            key=i, pre_s=rng.uniform(0, 3), layer_s=rng.uniform(0.5, 2), post_s=rng.uniform(0, 4),
            p2p_s=rng.uniform(0, 0.3), pre_state_bytes=rng.uniform(0, 5), layer_state_bytes=rng.uniform(1, 4),
            post_state_bytes=rng.uniform(0, 5), pre_act_bytes=rng.uniform(0, 1), layer_act_bytes=rng.uniform(0, 2),
            post_act_bytes=rng.uniform(0, 1), temp_bytes=rng.uniform(0, 2), call_s=rng.uniform(0, 0.2)))
    return out


SCHEDULES = [Schedule(name="gpipe"), Schedule(name="1f1b"), Schedule(name="interleaved", chunks=2),
             Schedule(name="zbv", chunks=2)]


SHARES = [1.0, 1.5, 4.0]
"""Ranks per core: 1 on GPUs; above 1 the step is max(T / share, m sum / p) (stage_dp.py)."""


@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_dp_equals_brute_force(seed, schedule, share):
    rng = random.Random(seed)
    L = rng.randint(4, 8)
    p = rng.randint(2, min(4, L // schedule.chunks))
    m = rng.choice([p, 2 * p, 2 * p + 1, 8])
    options = _random_options(rng, rng.randint(1, 3))
    budget = rng.uniform(15, 60)
    oracle = brute_force(L, p, m, options, schedule, budget, share)
    got = solve_pipeline(L, p, m, options, schedule, budget, share=share)
    if oracle is None:
        assert got is None
        return
    assert got is not None, (L, p, m, budget)
    assert got.step_time_s == pytest.approx(oracle[0], rel=1e-12), (got, oracle)
    # the returned assignment is one the brute force prices at that time, within memory
    assert sum(got.stage_layers) == L and len(got.stage_layers) == p
    times = [stage_time_s(options[i], n, k, p, schedule) for k, (n, i) in enumerate(zip(got.stage_layers, got.options))]
    assert step_time_s(times, m, schedule, share) == pytest.approx(got.step_time_s, rel=1e-12)
    assert max(got.stage_memory_bytes) <= budget


@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_cutoff_returns_the_optimum_below_it_else_none(seed, schedule, share):
    """The search's pruning: with a cutoff the DP returns the exact optimum when it is below
    the cutoff and None otherwise (a cutoff just above, at and below the brute-force optimum)."""
    rng = random.Random(100 + seed)
    L = rng.randint(4, 8)
    p = rng.randint(2, min(4, L // schedule.chunks))
    m = rng.choice([p, 2 * p, 8])
    options = _random_options(rng, rng.randint(1, 3))
    oracle = brute_force(L, p, m, options, schedule, 60.0, share)
    if oracle is None:
        assert solve_pipeline(L, p, m, options, schedule, 60.0, cutoff_s=1e9, share=share) is None
        return
    above = solve_pipeline(L, p, m, options, schedule, 60.0, cutoff_s=oracle[0] * 1.001, share=share)
    assert above is not None and above.step_time_s == pytest.approx(oracle[0], rel=1e-12)
    assert solve_pipeline(L, p, m, options, schedule, 60.0, cutoff_s=oracle[0], share=share) is None
    assert solve_pipeline(L, p, m, options, schedule, 60.0, cutoff_s=oracle[0] * 0.5, share=share) is None


def test_stages_differ_in_option_when_faster():
    """Two options: a fast one whose memory fits only the later stages (fewer microbatches
    in flight under 1F1B), a slow lean one: the optimum mixes them."""
    fast = StageOption(key="fast", pre_s=0, layer_s=1.0, post_s=0, p2p_s=0, pre_state_bytes=0, layer_state_bytes=1,
                       post_state_bytes=0, pre_act_bytes=0, layer_act_bytes=2, post_act_bytes=0)
    lean = StageOption(key="lean", pre_s=0, layer_s=1.3, post_s=0, p2p_s=0, pre_state_bytes=0, layer_state_bytes=1,
                       post_state_bytes=0, pre_act_bytes=0, layer_act_bytes=0.5, post_act_bytes=0)
    sched = Schedule(name="1f1b")
    got = solve_pipeline(8, 2, 8, [fast, lean], sched, budget := 13.0)
    oracle = brute_force(8, 2, 8, [fast, lean], sched, budget)
    assert got.step_time_s == pytest.approx(oracle[0])
    assert len(set(got.options)) == 2, got  # stage 0 (2 in flight) lean, stage 1 fast


def test_infeasible_is_none_and_one_stage_is_accumulation():
    o = _random_options(random.Random(0), 1)
    assert solve_pipeline(4, 2, 4, o, Schedule(name="1f1b"), 1e-9) is None
    one = solve_pipeline(4, 1, 5, o, Schedule(name="1f1b"), 1e9)
    t = o[0].pre_s + 4 * o[0].layer_s + o[0].post_s
    assert one.step_time_s == pytest.approx(5 * t) and one.stage_layers == (4,)
    assert solve_pipeline(0, 1, 3, o, Schedule(name="1f1b"), 1e9).step_time_s == pytest.approx(
        3 * (o[0].pre_s + o[0].post_s))
    # one stage on shared cores: its (contended) work m t, whatever the share
    assert solve_pipeline(4, 1, 5, o, Schedule(name="1f1b"), 1e9, share=4.0).step_time_s == pytest.approx(5 * t)


def test_shared_cores_price_the_bubble_free():
    """Ranks sharing cores (share > 1, times priced contended): a rank idle in a bubble
    frees its core, so a balanced pipeline costs its total work over the stages, m sum / p,
    unless the schedule's critical path run uncontended (T / share) is longer."""
    o = StageOption(key=0, pre_s=0, layer_s=1.0, post_s=0, p2p_s=0, pre_state_bytes=0, layer_state_bytes=0,
                    post_state_bytes=0, pre_act_bytes=0, layer_act_bytes=0, post_act_bytes=0)
    sched = Schedule(name="1f1b")
    got = solve_pipeline(4, 4, 2, [o], sched, 1e9, share=4.0)
    assert got.step_time_s == pytest.approx(2 * 4 / 4) and got.bubble_s == 0.0  # T = 5 would be 5 / 4 < 2
    assert solve_pipeline(4, 4, 2, [o], sched, 1e9).step_time_s == pytest.approx(5.0)  # GPUs: 1 * 4 + 1 * 1
    assert solve_pipeline(4, 4, 2, [o], sched, 1e9, share=1.5).step_time_s == pytest.approx(5.0 / 1.5)


def test_shared_cores_price_the_cores_a_filling_pipeline_leaves_idle():
    """4 one-rank stages on 2 cores (share 2): while only the first stage runs its first
    forward (and only it its last backward) one core idles, S / 16 on top of the work
    m S / p (the L model's pp4 ran 1.5-5.8% slower than GPipe dp2 pp2 in six sweeps). 2 stages
    of 2 ranks fill the 2 cores from the start: nothing added. GPUs: nothing."""
    from solver.stage_dp import ramp_idle_s

    o = StageOption(key=0, pre_s=0, layer_s=1.0, post_s=0, p2p_s=0, pre_state_bytes=0, layer_state_bytes=0,
                    post_state_bytes=0, pre_act_bytes=0, layer_act_bytes=0, post_act_bytes=0)
    one_f1b = Schedule(name="1f1b")
    got = solve_pipeline(4, 4, 4, [o], one_f1b, 1e9, share=2.0)
    assert got.step_time_s == pytest.approx(4 * 4 / 4 + 4 / 16)  # T / share = 7 / 2 is shorter
    assert step_time_s([1.0] * 4, 4, one_f1b, 2.0) == pytest.approx(got.step_time_s)
    assert ramp_idle_s(4.0, 4, one_f1b, 2.0) == pytest.approx(0.5 * 4.0 / (4 * 2.0))
    assert ramp_idle_s(2.0, 2, Schedule(name="gpipe"), 2.0) == 0.0  # dp2 pp2 on 2 cores
    assert ramp_idle_s(4.0, 4, one_f1b, 4.0) == 0.0  # dp2 pp4 on 8 ranks over 2 cores
    assert ramp_idle_s(4.0, 4, one_f1b, 1.0) == 0.0  # GPUs
    # an interleaved rank fills and drains chunk by chunk: v times shorter slots
    assert ramp_idle_s(4.0, 4, Schedule(name="interleaved", chunks=2), 2.0) == pytest.approx(
        ramp_idle_s(4.0, 4, one_f1b, 2.0) / 2)
    # the same time the whole-step formula gives a pipeline of these stages on GPUs is untouched
    assert solve_pipeline(4, 4, 4, [o], one_f1b, 1e9).step_time_s == pytest.approx(7.0)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_every_stage_pays_its_chunk_calls_host_time(schedule):
    """`call_s` (cost_model.pipeline_call_time_s): every stage, first, middle and last alike,
    pays it once per chunk it runs per microbatch (the schedule calls each chunk's forward
    and backward once per microbatch); the DP's tables price it the same way."""
    import numpy as np

    from solver.stage_dp import option_tables

    kw = dict(key=0, pre_s=0.5, layer_s=1.0, post_s=2.0, p2p_s=0.1, pre_state_bytes=0, layer_state_bytes=0,
              post_state_bytes=0, pre_act_bytes=0, layer_act_bytes=0, post_act_bytes=0)
    plain, calls = StageOption(**kw), StageOption(**kw, call_s=0.3)
    p, n = 4, 2 * schedule.chunks
    for k in range(p):
        extra = stage_time_s(calls, n, k, p, schedule) - stage_time_s(plain, n, k, p, schedule)
        assert extra == pytest.approx(0.3 * schedule.chunks)
    m = 8
    diff = option_tables(4 * n, p, m, calls, schedule, 1e9) - option_tables(4 * n, p, m, plain, schedule, 1e9)
    finite = np.isfinite(diff)
    assert finite.any() and np.allclose(diff[finite], 0.3 * schedule.chunks)
