"""`autopar calibrate` really measures: 3 gloo ranks, a loadable profile with sane rates."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autopar.cluster import HARDWARE, Cluster, load_hardware
from cost_model.collectives import (
    all_gather_time_s,
    all_reduce_time_s,
    collective_latency_s,
    mesh_axis_links,
    reduce_scatter_time_s,
)

pytestmark = [pytest.mark.dist, pytest.mark.alone]


def test_calibrate_writes_a_usable_profile_and_an_odd_world_finishes(tmp_path) -> None:
    """One real calibration on 3 ranks (one run: a calibration takes tens of seconds here).
    Ranks 0 and 1 form the one pair and rank 2 has none: it must still meet the world
    barriers of the reference timings taken before each of the pair's measurements (it used
    to run the world's collectives while the pair ran its own, and the calibration hung until
    its timeout). The profile loads, with sane rates, and records this machine's memory."""
    from autopar.calibrate import machine_memory_bytes

    out = tmp_path / "cpu3.json"
    run = subprocess.run([sys.executable, "-m", "autopar.cli", "calibrate", "--devices", "3", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "gloo: launch" in run.stdout and "written to" in run.stdout
    assert "stage collective wait" in run.stdout  # carried from the built-in profile, said so
    data = json.loads(out.read_text())
    m = data["measurements"]
    assert m["devices"] == 3 and m["cores"] >= 1 and m["reference_s"] > 0
    assert m["total_memory_bytes"] == machine_memory_bytes()
    sizes = {(row[0], row[1]) for row in m["collective_s"]}
    assert sizes == {(k, n) for k in ("all_reduce", "all_gather", "reduce_scatter") for n in (2, 3)}
    assert all(row[3] > 0 for row in m["collective_s"]) and all(t > 0 for _, t in m["send_recv_s"])
    hw = load_hardware(out)
    assert hw.name == "cpu" and hw.peak_flops("float32") > 1e8 and hw.intra_node_latency_s >= 0
    assert hw.memory_bytes == m["total_memory_bytes"] // 3
    assert hw.cores_per_node == m["cores"] and dict(hw.efficiency)["gemm_efficiency"] == 1.0
    assert dict(hw.efficiency)["stage_collective_wait_s"] == \
        dict(HARDWARE["cpu"].efficiency)["stage_collective_wait_s"] > 0
    # the step's per-tensor epilogue (DTensor gradient, fused AdamW dispatch, zero_grad) was timed
    assert m["param_tensor_s"] > 0
    assert dict(hw.efficiency)["optimizer_tensor_overhead_s"] == pytest.approx(m["param_tensor_s"] / max(1, 3 / m["cores"]))
    scale = dict(hw.collective_bandwidth_scale)
    assert set(scale) == {"all_gather", "reduce_scatter"} and all(0 < v < 100 for v in scale.values())
    (link,) = mesh_axis_links(Cluster.parse("cpu:2", hardware=hw), (2,))
    big = 2**28
    # each kind is priced at its own measured busBW ratio to the all-reduce's; gloo's
    # reduce-scatter moves an all-reduce's volume (twice an all-gather's)
    ag_bw = all_gather_time_s(big, link) - collective_latency_s("all_gather", link)
    rs_bw = reduce_scatter_time_s(big, link) - collective_latency_s("reduce_scatter", link)
    assert ag_bw / rs_bw == pytest.approx(scale["reduce_scatter"] / scale["all_gather"] / 2, rel=1e-6)
    assert all_reduce_time_s(big, link) > 0
