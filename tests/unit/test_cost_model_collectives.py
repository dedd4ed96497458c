"""Collectives and resharding: closed forms (nccl-tests conventions) and link tiers."""

from __future__ import annotations

import math

import pytest

from autopar.cluster import Cluster
from autopar.placement import Partial, Replicate, Shard
from cost_model import (
    AxisLink,
    all_gather_time_s,
    all_reduce_time_s,
    all_to_all_time_s,
    compute_time_s,
    mesh_axis_links,
    reduce_scatter_time_s,
    reshard_time_s,
    send_recv_time_s,
)
from cost_model.efficiency import DEFAULT_EFFICIENCY, NVLINK_BUS_EFFICIENCY

LINK = AxisLink(size=8, bandwidth_bytes_per_s=100e9, latency_s=1e-6, tier="intra")


def test_tiers_follow_the_mesh_layout() -> None:
    cluster = Cluster.parse("h100:4x8")
    hw = cluster.hardware
    nvlink = hw.intra_node_bandwidth_bytes_per_s * NVLINK_BUS_EFFICIENCY["h100"]
    nic = hw.inter_node_bandwidth_bytes_per_s * DEFAULT_EFFICIENCY.nic_bus_efficiency
    outer, inner = mesh_axis_links(cluster, (4, 8))
    assert (outer.tier, inner.tier) == ("inter", "intra")
    assert inner.bandwidth_bytes_per_s == pytest.approx(nvlink)
    assert outer.bandwidth_bytes_per_s == pytest.approx(nic)
    # (8, 4): the outer axis has stride 4, so 2 members share a node -> mixed, 2 NICs per node
    outer, inner = mesh_axis_links(cluster, (8, 4))
    assert (outer.tier, inner.tier) == ("mixed", "intra")
    assert outer.bandwidth_bytes_per_s == pytest.approx(min(nvlink, 2 * nic))
    assert outer.p2p_bandwidth == pytest.approx(nic)
    with pytest.raises(ValueError, match="32"):
        mesh_axis_links(cluster, (3, 8))


def test_collective_closed_forms() -> None:
    size = 1e9
    n, bw, a = LINK.size, LINK.bandwidth_bytes_per_s, LINK.latency_s
    assert all_reduce_time_s(size, LINK) == pytest.approx(2 * (n - 1) / n * size / bw + 2 * (n - 1) * a)
    assert all_gather_time_s(size, LINK) == pytest.approx((n - 1) / n * size / bw + (n - 1) * a)
    assert reduce_scatter_time_s(size, LINK) == pytest.approx(all_gather_time_s(size, LINK))
    assert all_to_all_time_s(size, LINK) == pytest.approx((n - 1) / n * size / bw + (n - 1) * a)
    assert send_recv_time_s(size, LINK) == pytest.approx(size / bw + a)
    one = AxisLink(size=1, bandwidth_bytes_per_s=1.0, latency_s=1.0, tier="intra")
    assert all_reduce_time_s(size, one) == 0.0 == all_gather_time_s(size, one)
    # across nodes the all-reduce latency term is tree-like: 2 ceil(log2 n) steps
    inter = AxisLink(size=1024, bandwidth_bytes_per_s=bw, latency_s=a, tier="inter")
    assert all_reduce_time_s(size, inter) == pytest.approx(2 * 1023 / 1024 * size / bw + 2 * 10 * a)


def test_reshard_matches_the_collective_it_needs() -> None:
    shape, db = (1024, 1024), 2
    size = math.prod(shape) * db
    links = (AxisLink(size=2, bandwidth_bytes_per_s=10e9, latency_s=5e-6, tier="inter"), LINK)
    assert reshard_time_s(shape, db, (Shard(0), Partial()), (Shard(0), Partial()), links) == 0.0
    assert reshard_time_s(shape, db, (Replicate(), Replicate()), (Replicate(), Shard(1)), links) == 0.0
    # P -> R on axis 1 while axis 0 shards the tensor in two: all-reduce of half the bytes
    t = reshard_time_s(shape, db, (Shard(0), Partial()), (Shard(0), Replicate()), links)
    assert t == pytest.approx(all_reduce_time_s(size / 2, LINK))
    t = reshard_time_s(shape, db, (Replicate(), Partial()), (Replicate(), Shard(0)), links)
    assert t == pytest.approx(reduce_scatter_time_s(size, LINK))
    t = reshard_time_s(shape, db, (Shard(1), Replicate()), (Replicate(), Replicate()), links)
    assert t == pytest.approx(all_gather_time_s(size, links[0]))
    t = reshard_time_s(shape, db, (Replicate(), Shard(0)), (Replicate(), Shard(1)), links)
    assert t == pytest.approx(all_to_all_time_s(size / 8, LINK))


def test_compute_roofline_classes() -> None:
    hw = Cluster.parse("a100-80gb:1x8").hardware
    big = compute_time_s(1e15, 1e6, hw, "bfloat16")
    small = compute_time_s(1e9, 1e6, hw, "bfloat16")
    assert big / 1e15 < small / 1e9  # large GEMMs are more efficient per FLOP
    assert 1e15 / big < 312e12  # never above peak
    mem = compute_time_s(0, 2e9, hw, "bfloat16")
    assert mem > 2e9 / hw.memory_bandwidth_bytes_per_s  # memory-bound below HBM peak
    causal = compute_time_s(1e14, 0, hw, "bfloat16", op_class="attention", causal=True)
    full = compute_time_s(1e14, 0, hw, "bfloat16", op_class="attention", causal=False)
    assert causal < full


def test_the_reported_loss_pays_a_scalar_all_reduce_per_partial_axis() -> None:
    """Price = run: the loss `compiled.step` returns is reduced on every mesh axis where it
    is Partial (one scalar all-reduce per axis), and a pipeline hands it to every rank."""
    from cost_model import loss_report_time_s
    from cost_model.collectives import LOSS_BYTES

    dp, tp = mesh_axis_links(Cluster.parse("cpu:8"), (4, 2))
    assert loss_report_time_s((Replicate(), Replicate()), (dp, tp)) == 0.0
    assert loss_report_time_s((Partial(), Replicate()), (dp, tp)) == pytest.approx(all_reduce_time_s(LOSS_BYTES, dp))
    both = loss_report_time_s((Partial(), Partial()), (dp, tp))
    assert both == pytest.approx(all_reduce_time_s(LOSS_BYTES, dp) + all_reduce_time_s(LOSS_BYTES, tp))
    world = mesh_axis_links(Cluster.parse("cpu:8"), (8,))[0]
    piped = loss_report_time_s((Partial(), Replicate()), (dp, tp), world)
    assert piped == pytest.approx(all_reduce_time_s(LOSS_BYTES, dp) + all_reduce_time_s(LOSS_BYTES, world))
    # latency-bound where ranks share cores: 8 ranks on 2 cores cost more than 4 (14 ring steps vs 6)
    assert all_reduce_time_s(LOSS_BYTES, world) > all_reduce_time_s(LOSS_BYTES, dp) > 0


def test_few_element_all_reduces_pay_gloos_sparse_ring_steps() -> None:
    """gloo's ring cuts an all-reduce into at least 2 n segments of at least one element and
    skips the empty ones: a one-element all-reduce pays the measured one-element step, one of
    2 n elements or more the ring's, and the price grows with the elements in between. No
    measurement (GPUs, older profiles): every size pays the ring's step."""
    from dataclasses import replace

    ring = AxisLink(size=8, bandwidth_bytes_per_s=1e9, latency_s=500e-6, tier="intra")
    sparse = replace(ring, scalar_hop_latency_s=100e-6)
    assert all_reduce_time_s(4, sparse) == pytest.approx(14 * 100e-6 + 14 / 8 * 4 / 1e9)
    assert all_reduce_time_s(4, ring) == pytest.approx(14 * 500e-6 + 14 / 8 * 4 / 1e9)
    prices = [all_reduce_time_s(4 * e, sparse) for e in range(1, 20)]
    assert prices == sorted(prices) and len(set(prices)) == len(prices)
    for e in (16, 17, 1024):  # 2 n = 16 elements fill every segment
        assert all_reduce_time_s(4 * e, sparse) == pytest.approx(all_reduce_time_s(4 * e, ring))
    # a measured step above the ring's never makes a small all-reduce dearer than the ring prices it
    assert all_reduce_time_s(4, replace(ring, scalar_hop_latency_s=1e-3)) == pytest.approx(all_reduce_time_s(4, ring))


def test_the_scalar_step_scales_with_core_sharing_like_the_rings() -> None:
    """The profile stores the one-element step per dedicated core; a mesh's links apply the
    share law of the ring's latency to it (ranks per core ** the exponent); GPU links and
    profiles without the measurement carry none."""
    from dataclasses import replace

    from autopar.cluster import HARDWARE

    cpu = HARDWARE["cpu"]
    eff = dict(cpu.efficiency)
    hw = replace(cpu, efficiency=tuple(sorted({**eff, "scalar_all_reduce_hop_s": 100e-6}.items())))
    g = eff.get("collective_latency_share_exponent", 1.0)
    for n in (2, 4, 8):
        (link,) = mesh_axis_links(Cluster.parse(f"cpu:{n}", hardware=hw), (n,))
        share = max(1.0, n / hw.cores_per_node)
        assert link.scalar_hop_latency_s == pytest.approx(100e-6 * share ** g)
        assert link.latency_s == pytest.approx(hw.intra_node_latency_s * share ** g)
    bare = replace(cpu, efficiency=tuple((k, v) for k, v in eff.items() if k != "scalar_all_reduce_hop_s"))
    assert mesh_axis_links(Cluster.parse("cpu:8", hardware=bare), (8,))[0].scalar_hop_latency_s == 0.0
    assert mesh_axis_links(Cluster.parse("h100:1x8"), (8,))[0].scalar_hop_latency_s == 0.0
