"""ZeRO-3 runtimes (per-tensor vs per-layer collectives, prefetch window, recompute
re-gather) and the per-layer / per-op activation-checkpointing options of price_profile."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.trace import trace_model
from cost_model import AxisLink, all_gather_time_s, mesh_axis_links
from cost_model.efficiency import DEFAULT_EFFICIENCY

from benchmarks.baselines.analytic import price_profile, profile_graph  # the baseline
from benchmarks.baselines.analytic.zero3 import DEEPSPEED_2021, FSDP, zero3_layer_times, zero3_runtime

SPEC = "gpt:layers=8,hidden=512,heads=8,vocab=1024,seq=256"
CLUSTER = Cluster.parse("a100-80gb:2x8")


@pytest.fixture(scope="module")
def profile():
    return profile_graph(trace_model(resolve(SPEC), batch=1, dtype="bfloat16", layers_traced=2))


def _link(n: int) -> AxisLink:
    return AxisLink(size=n, bandwidth_bytes_per_s=192e9, latency_s=10e-6, tier="mixed", ring_hop_latency_s=6e-6)


def test_per_tensor_gathers_grow_with_the_ring_latency() -> None:
    params, tensors = 1.8e9, 12.0
    kwargs = dict(layer_params=params, param_tensors=tensors, forward_s=0.0, backward_s=0.0, weight_bytes=2)
    small = zero3_layer_times(DEEPSPEED_2021, link=_link(192), **kwargs)
    large = zero3_layer_times(DEEPSPEED_2021, link=_link(1536), **kwargs)
    # bandwidth term nearly equal; the difference is 12 collectives x (1536-192) ring steps + copies
    ring = tensors * (1536 - 192) * 6e-6
    copies = tensors * (1536 - 192) * DEFAULT_EFFICIENCY.memory_overhead_s
    assert large.gather_s - small.gather_s == pytest.approx(ring + copies, rel=0.02)
    # one collective per layer (FSDP) pays the ring latency once
    fsdp = zero3_layer_times(FSDP, link=_link(1536), **kwargs)
    assert fsdp.gather_s == pytest.approx(all_gather_time_s(2 * params, _link(1536)))
    assert fsdp.gather_s < large.gather_s / 3


def test_prefetch_window_bounds_what_hides() -> None:
    link = _link(64)
    kwargs = dict(param_tensors=1.0, link=link, forward_s=10.0, backward_s=10.0, weight_bytes=2)
    overlap = DEFAULT_EFFICIENCY.overlap_efficiency
    # FSDP prefetches the whole next layer: under ample compute, all of it overlaps, of
    # which the share overlap_efficiency is hidden (the rest is SM/HBM contention)
    full = zero3_layer_times(FSDP, layer_params=1e9, **kwargs)
    assert full.forward_exposed_s == pytest.approx((1 - overlap) * full.gather_s)
    # a 5e7-parameter window overlaps 5% of a 1e9-parameter layer's gather
    window = dataclasses.replace(FSDP, prefetch_params=5e7)
    t = zero3_layer_times(window, layer_params=1e9, **kwargs)
    assert t.forward_exposed_s == pytest.approx((1 - 0.05 * overlap) * t.gather_s)
    # and with no compute to hide behind, everything is exposed either way
    bare = zero3_layer_times(FSDP, layer_params=1e9, param_tensors=1.0, link=link, forward_s=0.0,
                             backward_s=0.0, weight_bytes=2)
    assert bare.forward_exposed_s == pytest.approx(bare.gather_s)
    assert DEFAULT_EFFICIENCY.overlap_efficiency < 1


def test_recompute_regather_adds_one_gather() -> None:
    kwargs = dict(layer_params=1e9, param_tensors=4.0, link=_link(64), forward_s=0.0, backward_s=0.0,
                  weight_bytes=2)
    plain = zero3_layer_times(dataclasses.replace(DEEPSPEED_2021, regather_for_recompute=False),
                              recompute_share=1.0, **kwargs)
    again = zero3_layer_times(DEEPSPEED_2021, recompute_share=1.0, **kwargs)
    assert again.backward_exposed_s - plain.backward_exposed_s == pytest.approx(again.gather_s)


def test_deepspeed_2021_is_slower_than_fsdp_at_scale(profile) -> None:
    cluster = Cluster.parse("a100-80gb:16x8")
    cfg = ParallelConfig(dp=128, zero=3, recompute="full")
    fsdp = price_profile(profile, cfg, cluster, global_batch=128)
    ds = price_profile(profile, cfg, cluster, global_batch=128, zero3="deepspeed-2021")
    assert ds.step_time_s > fsdp.step_time_s
    assert ds.peak_memory_bytes == fsdp.peak_memory_bytes
    with pytest.raises(ValueError, match="deepspeed-2021"):
        zero3_runtime("megatron")


def test_mixed_axis_ring_latency_counts_nvlink_and_nic_hops() -> None:
    cluster = Cluster.parse("a100-80gb:4x8")
    hw = cluster.hardware
    (dp,) = mesh_axis_links(cluster, (32,))
    assert dp.tier == "mixed"
    assert dp.ring_latency_s == pytest.approx((hw.inter_node_latency_s + 7 * hw.intra_node_latency_s) / 8)
    outer, _ = mesh_axis_links(cluster, (4, 8))
    assert outer.ring_latency_s == outer.latency_s == hw.inter_node_latency_s


def test_per_layer_checkpointing_sits_between_selective_and_full(profile) -> None:
    def est(recompute: str, **kw):
        return price_profile(profile, ParallelConfig(dp=16, recompute=recompute), CLUSTER, global_batch=16, **kw)

    none, sel, full = est("none"), est("selective"), est("full")
    every2 = est("full", checkpoint_every=2)
    assert sel.step_time_s < every2.step_time_s < full.step_time_s
    assert dict(every2.time_breakdown)["recompute_s"] == pytest.approx(dict(full.time_breakdown)["recompute_s"] / 2)
    assert full.peak_memory_bytes < every2.peak_memory_bytes < none.peak_memory_bytes
    assert est("full", checkpoint_every=1).step_time_s == full.step_time_s
    with pytest.raises(ValueError, match="checkpoint_every"):
        est("full", checkpoint_every=0)


def test_alternate_mm_policy_recomputes_every_second_gemm(profile) -> None:
    # a GPT layer runs 4 forward GEMMs (qkv, proj, fc1, fc2) in that order: 2nd and 4th re-run
    assert len(profile.layer.alternate_gemm_items) == 2 * 2  # two traced layers
    pointwise = price_profile(profile, ParallelConfig(dp=16, recompute="selective"), CLUSTER, global_batch=16)
    alt = price_profile(profile, ParallelConfig(dp=16, recompute="selective"), CLUSTER, global_batch=16,
                        selective_policy="alternate-mm")
    full = price_profile(profile, ParallelConfig(dp=16, recompute="full"), CLUSTER, global_batch=16)
    assert pointwise.step_time_s < alt.step_time_s < full.step_time_s
    with pytest.raises(ValueError, match="selective_policy"):
        price_profile(profile, ParallelConfig(dp=16, recompute="selective"), CLUSTER, global_batch=16,
                      selective_policy="every-op")
