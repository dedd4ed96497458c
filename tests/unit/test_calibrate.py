"""Calibrated hardware profiles: JSON round-trip, loading, and measured -> profile mapping."""

from __future__ import annotations

import json

import pytest

from autopar.calibrate import Calibration, to_hardware
from autopar.cluster import HARDWARE, Cluster, Hardware, load_hardware
from cost_model.collectives import all_gather_time_s, all_reduce_time_s, mesh_axis_links, reduce_scatter_time_s
from cost_model.compute import compute_time_s
from cost_model.efficiency import efficiency_for


def _cal(devices: int = 4) -> Calibration:
    return Calibration(
        devices=devices, gemm_flops_per_s=((128, 8e9), (256, 10e9)), copy_bandwidth_bytes_per_s=2e9,
        all_reduce_bus_bytes_per_s=((2**21, 0.2e9), (2**23, 0.4e9)),
        all_gather_bus_bytes_per_s=((2**21, 0.1e9), (2**23, 0.2e9)),
        reduce_scatter_bus_bytes_per_s=((2**21, 0.05e9), (2**23, 0.1e9)),
        send_recv_bytes_per_s=((2**21, 0.9e9),), all_reduce_small_s=6e-3, all_gather_small_s=3e-3,
        send_recv_small_s=4e-4, pair_all_reduce_small_s=2e-3, pair_all_gather_small_s=1e-3,
    )  # small collectives exactly 1 ms per ring step


@pytest.mark.parametrize("name", sorted(HARDWARE))
def test_hardware_json_round_trip(name: str) -> None:
    hw = HARDWARE[name]
    assert Hardware.from_json(json.loads(json.dumps(hw.to_json()))) == hw


def test_calibrated_profile_file_round_trip(tmp_path) -> None:
    hw = to_hardware(_cal())
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"hardware": hw.to_json(), "measurements": _cal().to_json()}))
    loaded = load_hardware(path)
    assert loaded == hw
    cluster = Cluster.parse("cpu:4", hardware=loaded)
    assert cluster.hardware is loaded and cluster.num_devices == 4


def test_profile_reproduces_measured_rates() -> None:
    """The cost model applied to the calibrated profile gives back what was measured."""
    hw = to_hardware(_cal())
    flops = 1e12  # large: the fixed per-GEMM overhead is negligible
    overhead = efficiency_for(hw).gemm_overhead_s
    assert flops / (compute_time_s(flops, 0.0, hw, "float32", op_class="gemm") - overhead) == \
        pytest.approx(10e9, rel=1e-6)
    cluster = Cluster.parse("cpu:4", hardware=hw)
    (link,) = mesh_axis_links(cluster, (4,))
    assert link.bandwidth_bytes_per_s == pytest.approx(0.3e9)  # median of the all-reduce bus bandwidths
    assert _cal().latency_s == pytest.approx(1e-3)
    small = all_reduce_time_s(4096, link)
    assert small == pytest.approx(6e-3, rel=0.01)  # latency-dominated: the measured small all-reduce
    # all-gather and reduce-scatter keep their own measured busBW (here 1/2 and 1/4 of the
    # all-reduce's): a large one costs its bandwidth term at that rate
    big = 2**30
    for time_s, busbw in ((all_gather_time_s, 0.15e9), (reduce_scatter_time_s, 0.075e9)):
        assert time_s(big, link) - 3 * link.ring_latency_s == pytest.approx(0.75 * big / busbw, rel=1e-6)
    assert dict(hw.collective_bandwidth_scale) == pytest.approx({"all_gather": 0.5, "reduce_scatter": 0.25})


def test_bad_profiles_are_user_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="missing keys"):
        Hardware.from_json({"name": "cpu"})
    data = to_hardware(_cal()).to_json()
    with pytest.raises(ValueError, match="unknown collective kinds"):
        Hardware.from_json({**data, "collective_bandwidth_scale": {"all_to_all": 0.5}})
    with pytest.raises(ValueError, match="cannot read"):
        load_hardware(tmp_path / "absent.json")
    with pytest.raises(ValueError, match="names hardware 'h100'"):
        Cluster.parse("h100:4", hardware=to_hardware(_cal()))
