"""`autopar calibrate` really measures: 2 gloo ranks, a loadable profile with sane rates."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autopar.cluster import Cluster, load_hardware
from cost_model.collectives import all_gather_time_s, all_reduce_time_s, mesh_axis_links, reduce_scatter_time_s

pytestmark = pytest.mark.dist


def test_calibrate_two_ranks_writes_a_usable_profile(tmp_path) -> None:
    out = tmp_path / "cpu2.json"
    run = subprocess.run([sys.executable, "-m", "autopar.cli", "calibrate", "--devices", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "reduce-scatter busBW" in run.stdout and "written to" in run.stdout
    data = json.loads(out.read_text())
    m = data["measurements"]
    assert m["devices"] == 2
    for key in ("all_reduce_bus_bytes_per_s", "all_gather_bus_bytes_per_s", "reduce_scatter_bus_bytes_per_s"):
        assert set(m[key]) == {str(2**21), str(2**23)} and all(v > 0 for v in m[key].values()), key
    hw = load_hardware(out)
    assert hw.name == "cpu" and hw.peak_flops("float32") > 1e8 and hw.intra_node_latency_s > 0
    scale = dict(hw.collective_bandwidth_scale)
    assert set(scale) == {"all_gather", "reduce_scatter"} and all(0 < v < 10 for v in scale.values())
    (link,) = mesh_axis_links(Cluster.parse("cpu:2", hardware=hw), (2,))
    big = 2**28
    # each kind is priced at its own measured busBW ratio to the all-reduce's
    ag_bw = all_gather_time_s(big, link) - link.ring_latency_s
    rs_bw = reduce_scatter_time_s(big, link) - link.ring_latency_s
    assert ag_bw / rs_bw == pytest.approx(scale["reduce_scatter"] / scale["all_gather"], rel=1e-6)
    assert all_reduce_time_s(big, link) > 0
