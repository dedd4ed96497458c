"""Pipeline timelines (autopar/plots.py) against the closed-form bubble of SC'21, and the
explain plot written from a plan-shaped object."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from autopar.config import ParallelConfig
from autopar.plots import pipeline_timeline, plan_stage_times, plot_plan, stage_order


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(2, 1), (2, 4), (4, 8), (4, 3), (8, 8)])
def test_equal_stages_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule: str, pp: int, m: int) -> None:
    f, b = 1.0, 2.0
    t = pipeline_timeline(schedule, pp, m, [f] * pp, [b] * pp)
    assert len(t.boxes) == 2 * pp * m
    assert sum(1 for x in t.boxes if x.kind == "F") == pp * m
    assert t.makespan_s == pytest.approx((m + pp - 1) * (f + b))
    assert t.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 8, 2), (4, 4, 4)])
def test_interleaved_bubble_shrinks_by_v(pp: int, m: int, v: int) -> None:
    f, b = 1.0, 2.0
    t = pipeline_timeline("interleaved", pp, m, [f] * pp, [b] * pp, interleave=v)
    assert len(t.boxes) == 2 * pp * m * v
    # SC'21: bubble time (p - 1)(f + b) / v on top of m (f + b)
    assert t.makespan_s == pytest.approx(m * (f + b) + (pp - 1) * (f + b) / v)


def test_dependencies_hold_and_stages_never_overlap() -> None:
    t = pipeline_timeline("1f1b", 3, 5, [1.0, 1.5, 0.5], [2.0, 3.0, 1.0])
    end = {(x.kind, x.chunk, x.microbatch): x.end_s for x in t.boxes}
    for x in t.boxes:
        if x.kind == "F" and x.chunk > 0:
            assert x.start_s >= end[("F", x.chunk - 1, x.microbatch)] - 1e-12
        if x.kind == "B":
            dep = ("B", x.chunk + 1, x.microbatch) if x.chunk < 2 else ("F", x.chunk, x.microbatch)
            assert x.start_s >= end[dep] - 1e-12
    for s in range(3):
        mine = sorted((x for x in t.boxes if x.stage == s), key=lambda x: x.start_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(mine, mine[1:]))
    # the slowest stage is busy the whole steady state: makespan >= its total work
    assert t.makespan_s >= 5 * (1.5 + 3.0)


def test_1f1b_keeps_at_most_p_minus_s_microbatches_in_flight() -> None:
    pp, m = 4, 8
    for s in range(pp):
        in_flight = peak = 0
        for kind, _, _ in stage_order("1f1b", pp, s, m):
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == pp - s


def test_interleaved_needs_m_multiple_of_pp() -> None:
    with pytest.raises(ValueError, match="multiple of pp"):
        pipeline_timeline("interleaved", 4, 6, [1.0] * 4, [2.0] * 4, interleave=2)


def _plan(pp: int, m: int) -> SimpleNamespace:
    config = ParallelConfig(pp=pp, dp=1, micro_batch=1, schedule="1f1b" if pp > 1 else "1f1b")
    stages = tuple(SimpleNamespace(flops_per_microbatch=f) for f in ([2.0] + [1.0] * (pp - 1)))
    predicted = SimpleNamespace(
        time_breakdown=(("compute_s", 3.0 * m), ("recompute_s", 0.0), ("comm_pp_s", 0.0)),
        memory_breakdown=(("params_bytes", 1e9), ("activations_bytes", 3e9)),
    )
    return SimpleNamespace(config=config, num_microbatches=m, stages=stages, predicted=predicted, model="m",
                           cluster="cpu:1x4", memory_limit_bytes=8 * 2**30)


def test_plan_stage_times_scale_with_stage_flops() -> None:
    fwd, bwd = plan_stage_times(_plan(4, 8))
    assert fwd[0] == pytest.approx(1.0) and bwd[0] == pytest.approx(2.0)  # critical stage: 3 s / microbatch
    assert fwd[1] == pytest.approx(0.5) and bwd[1] == pytest.approx(1.0)


def test_plot_plan_writes_png(tmp_path) -> None:
    out = tmp_path / "plan.png"
    t = plot_plan(_plan(4, 8), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert t is not None and len(t.boxes) == 2 * 4 * 8
    assert plot_plan(_plan(1, 2), str(tmp_path / "nopp.png")) is None
