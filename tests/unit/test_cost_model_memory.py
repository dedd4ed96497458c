"""Memory oracles: ZeRO closed forms, activations vs Korthikanti et al., 1F1B in-flight count."""

from __future__ import annotations

import pytest

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.trace import trace_model
from cost_model import STATE_BYTES_PER_PARAM, model_state_bytes, state_bytes_per_param

from benchmarks.baselines.analytic import price_profile, profile_graph  # the baseline
from benchmarks.baselines.analytic.memory import inflight_microbatches, segment_activation_bytes, stage_memory

B, S, H, A = 2, 128, 256, 4
SPEC = f"gpt:layers=4,hidden={H},heads={A},vocab=512,seq={S}"


@pytest.fixture(scope="module")
def profile():
    graph = trace_model(resolve(SPEC), batch=B, dtype="bfloat16", layers_traced=2)
    return profile_graph(graph)


@pytest.mark.parametrize("zero,per_param", [(0, lambda n: 16), (1, lambda n: 4 + 12 / n),
                                            (2, lambda n: 2 + 14 / n), (3, lambda n: 16 / n)])
def test_zero_model_state_closed_forms(zero, per_param) -> None:
    psi, n = 7.5e9, 64
    assert sum(model_state_bytes(psi, zero, n)) == pytest.approx(per_param(n) * psi)
    if zero == 0:  # the ZeRO paper's worked example: 7.5B params, N_d = 64 -> 120 GB
        assert sum(model_state_bytes(psi, zero, n)) == pytest.approx(120e9)
    # the per-parameter form the solver reads (its one home: cost_model/memory.py)
    assert state_bytes_per_param(zero, n) == pytest.approx(per_param(n))
    assert state_bytes_per_param(zero, 1) == STATE_BYTES_PER_PARAM == 16


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_priced_model_state_equals_closed_form(profile, zero) -> None:
    # params + grads + optimizer of the priced estimate (activations are reported apart)
    cluster = Cluster.parse("a100-80gb:1x8")
    cfg = ParallelConfig(dp=8, zero=zero)
    est = price_profile(profile, cfg, cluster, global_batch=8)
    mem = dict(est.memory_breakdown)
    state = mem["params_bytes"] + mem["grads_bytes"] + mem["optimizer_bytes"]
    per_param = {0: 16, 1: 4 + 12 / 8, 2: 2 + 14 / 8, 3: 16 / 8}[zero]
    assert state == pytest.approx(per_param * profile.num_parameters, rel=1e-6, abs=4)


def _korthikanti_no_dropout(t: int, sp: bool, math_attention: bool) -> float:
    """Korthikanti et al. Table 2 per layer, minus the two sbh dropout masks (attention
    output and MLP output) and, for math attention, minus the as^2b mask and the 2as^2b
    dropout output: our models have no dropout. Flash keeps no s x s scores at all."""
    sbh = S * B * H
    scores = 2 * A * S / H / t if math_attention else 0.0
    if sp:
        return sbh * (32 / t + scores)
    return sbh * (8 + 24 / t + scores)


@pytest.mark.parametrize("t,sp,attention", [(1, False, "flash"), (1, False, "math"), (4, False, "flash"),
                                            (4, True, "flash"), (2, True, "math")])
def test_gpt_layer_activations_match_korthikanti(profile, t, sp, attention) -> None:
    cfg = ParallelConfig(tp=t, attention=attention, sequence_parallel=sp)
    ours = segment_activation_bytes(profile.layer, cfg, ratio=1.0, dtype_bytes=2)
    expected = _korthikanti_no_dropout(t, sp, attention == "math")
    assert ours == pytest.approx(expected, rel=0.10)


def test_recompute_reduces_activations(profile) -> None:
    none = segment_activation_bytes(profile.layer, ParallelConfig(), 1.0, 2)
    selective = segment_activation_bytes(profile.layer, ParallelConfig(recompute="selective"), 1.0, 2)
    full = segment_activation_bytes(profile.layer, ParallelConfig(recompute="full"), 1.0, 2)
    assert full == pytest.approx(2 * S * B * H)  # the layer input only (Korthikanti: 2sbh)
    assert full < selective < none


def test_activations_scale_linearly_with_micro_batch(profile) -> None:
    one = stage_memory(profile, ParallelConfig(micro_batch=1), stage=0, layers=4, num_microbatches=1)
    four = stage_memory(profile, ParallelConfig(micro_batch=4), stage=0, layers=4, num_microbatches=1)
    assert four.activations_bytes == pytest.approx(4 * one.activations_bytes)


def test_first_1f1b_stage_holds_p_microbatches(profile) -> None:
    p, m = 4, 16
    per_layer = segment_activation_bytes(profile.layer, ParallelConfig(), 1.0, 2)
    pre = segment_activation_bytes(profile.pre, ParallelConfig(), 1.0, 2)
    for schedule, expect in (("1f1b", p), ("gpipe", m)):
        cfg = ParallelConfig(pp=p, schedule=schedule, micro_batch=B)
        assert inflight_microbatches(cfg, 0, m) == expect
        mem = stage_memory(profile, cfg, stage=0, layers=1, num_microbatches=m)
        assert mem.activations_bytes == pytest.approx(expect * (per_layer + pre))
    cfg = ParallelConfig(pp=p, schedule="1f1b")
    assert [inflight_microbatches(cfg, i, m) for i in range(p)] == [4, 3, 2, 1]
    inter = ParallelConfig(pp=p, schedule="interleaved", interleave=2)
    assert inflight_microbatches(inter, 0, m) == pytest.approx(p * (1 + (p - 1) / (p * 2)))
