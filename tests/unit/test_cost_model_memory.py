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


@pytest.mark.parametrize("cfg", [ParallelConfig(dp=2, tp=2), ParallelConfig(dp=4, zero=3)], ids=["dp2xtp2", "zero3"])
def test_raw_gradients_are_priced_in_the_placement_the_backward_leaves_them(cfg) -> None:
    """The raw gradients a step accumulates over its microbatches are as the backward leaves
    them (codegen accumulates each gradient node's output placement): a pending sum over dp
    is whole on every rank, though ZeRO-3 computes with dp-sharded weights, and a
    tensor-parallel weight's gradient from sequence-split activations is whole over tp.
    The ILP charges each at that placement (its gradient node's memory, in the peak rows),
    and the memory breakdown reports that sum, more than the weights' compute placements
    would give."""
    from autopar.ir import Role
    from autopar.placement import shard_factor
    from solver.forced import solve_one_stage
    from solver.spmd_search import memory_breakdown

    graph = trace_model(resolve("llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,vocab=64,seq=16"), batch=4,
                        dtype="float32")
    sol = solve_one_stage(graph, cfg, Cluster.parse("cpu:4"), num_microbatches=2)
    aliases = {alias for alias, _ in graph.tied_params}
    at_gradient = at_weight = charged = 0.0
    for param, grad in graph.param_grads:
        g = sol.choice(grad)
        at_gradient += g.weight * 4 * graph[grad].output.numel / shard_factor(g.outputs[0], sol.mesh_shape)
        charged += g.weight * g.memory_bytes
        if param not in aliases:
            p = sol.choice(param)
            at_weight += p.weight * 4 * graph[param].output.numel / shard_factor(p.outputs[0], sol.mesh_shape)
    assert all(sol.choice(p).memory_bytes > 0 for p, _ in graph.param_grads if p not in aliases)
    assert charged == pytest.approx(at_gradient)
    assert dict(memory_breakdown(graph, sol))["gradients_bytes"] == pytest.approx(at_gradient)
    assert at_gradient > 1.05 * at_weight
    # one microbatch: the step syncs each bucket in its backward and frees the raw ones, so
    # the gradients held are the synced ones, charged with their parameters (update placement)
    one = solve_one_stage(graph, cfg, Cluster.parse("cpu:4"), num_microbatches=1)
    assert all(one.choice(g).memory_bytes == 0 for _, g in graph.param_grads)
    synced = sum(one.choice(p).weight * 4 * graph[p].output.numel / shard_factor(
        one.choice(p).outputs[0] if one.choice(p).update is None else one.choice(p).update, one.mesh_shape)
        for p, _ in graph.param_grads if p not in aliases)
    assert dict(memory_breakdown(graph, one))["gradients_bytes"] == pytest.approx(synced)
