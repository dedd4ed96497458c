"""Hardware.comm_overlap: on the cpu profile (gloo blocks the calling thread) nothing hides
the data-parallel gradient sync or ZeRO-3 gathers; on GPUs the cost model's overlap applies."""

from dataclasses import replace

import pytest

import autopar  # noqa: F401  (import order: autopar before cost_model)
from autopar.cluster import HARDWARE, Cluster
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.trace import trace_model

from benchmarks.baselines import analytic  # the baseline


@pytest.fixture(scope="module")
def graph():
    return trace_model(resolve("llama-small"), batch=4, dtype="float32")


@pytest.mark.parametrize("zero", [0, 3])
def test_no_overlap_exposes_all_communication(graph, zero):
    hw = HARDWARE["h100"]
    overlapped = Cluster(hardware=hw, num_nodes=1, devices_per_node=4)
    blocking = Cluster(hardware=replace(hw, comm_overlap=0.0), num_nodes=1, devices_per_node=4)
    config = ParallelConfig(dp=4, zero=zero)
    fast = analytic.price(graph, config, overlapped, global_batch=8)
    slow = analytic.price(graph, config, blocking, global_batch=8)
    assert slow.step_time_s > fast.step_time_s
    # compute is the same; only the exposed communication grows
    tb_fast, tb_slow = dict(fast.time_breakdown), dict(slow.time_breakdown)
    assert tb_fast["compute_s"] == pytest.approx(tb_slow["compute_s"])
    key = "comm_dp_s" if zero == 0 else "comm_zero3_s"
    assert tb_slow[key] > tb_fast[key]


def test_cpu_profile_does_not_overlap_and_old_profiles_load():
    assert HARDWARE["cpu"].comm_overlap == 0.0 and HARDWARE["h100"].comm_overlap == 1.0
    data = HARDWARE["cpu"].to_json()
    del data["comm_overlap"]  # a profile written before the field existed
    assert type(HARDWARE["cpu"]).from_json(data).comm_overlap == 0.0


def test_zero2_pays_one_collective_pair_per_module(graph):
    """ZeRO-2 is FSDP2 (one all-gather and reduce-scatter per layer and the root): on a
    high-latency link it costs the latency of every module's collectives, where ZeRO-1's
    single flat collectives pay it once."""
    cpu = HARDWARE["cpu"]
    # one rank per core and no per-collective launch cost: only the ring steps' latency counts
    hw = replace(cpu, intra_node_latency_s=5e-3, inter_node_latency_s=5e-3, cores_per_node=0,
                 efficiency=tuple(sorted({**dict(cpu.efficiency), "collective_base_latency_s": 0.0}.items())))
    cluster = Cluster(hardware=hw, num_nodes=1, devices_per_node=4)
    z1 = dict(analytic.price(graph, ParallelConfig(dp=4, zero=1), cluster, global_batch=4).time_breakdown)
    z2 = dict(analytic.price(graph, ParallelConfig(dp=4, zero=2), cluster, global_batch=4).time_breakdown)
    layers = graph.model.num_layers
    # ring over 4 ranks: 3 hops per all-gather, 6 per reduce-scatter (gloo, the cpu profile's
    # backend, runs it as an all-reduce); (layers + 1) modules vs 1
    extra_latency = (3 + 6) * 5e-3 * layers
    assert z2["comm_dp_s"] - z1["comm_dp_s"] == pytest.approx(extra_latency, rel=0.25)
