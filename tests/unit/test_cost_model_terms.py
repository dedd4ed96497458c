"""Second-order cost terms: GEMM shape, per-GPU kernel fractions, runtime options, NCCL
latencies, core sharing; each against its closed form or the direction it must push."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

import autopar  # noqa: F401  (import order: autopar before cost_model)
from autopar.cluster import HARDWARE, Cluster
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.trace import trace_model
from cost_model import mesh_axis_links
from cost_model.compute import compute_time_s, gemm_shape_efficiency, gemm_time_s
from cost_model.efficiency import DEFAULT_EFFICIENCY, efficiency_for

from benchmarks.baselines.analytic import RuntimeOptions, price_profile, profile_graph  # the baseline

SPEC = "llama:layers=4,hidden=512,heads=8,kv_heads=8,ffn=1024,vocab=1024,seq=256"


@pytest.fixture(scope="module")
def profile():
    return profile_graph(trace_model(resolve(SPEC), batch=1, dtype="bfloat16", layers_traced=2))


def test_gemm_shape_factor_closed_form() -> None:
    hw, eff = HARDWARE["a100-80gb"], DEFAULT_EFFICIENCY
    t, k0 = eff.gemm_tile, eff.gemm_k_ramp
    # 108 SMs, 109 tiles of 128x128: the second wave runs one tile
    m, n, k = 109 * t, t, 4096
    assert gemm_shape_efficiency(1, m, n, k, hw, eff) == pytest.approx(109 / 216 * k / (k + k0))
    # a big square GEMM is near the K-ramp alone; a thin one (few tiles) splits K over the SMs
    big = gemm_shape_efficiency(1, 8192, 8192, 8192, hw, eff)
    assert big == pytest.approx(8192 / (8192 + k0), rel=0.01)
    thin = gemm_shape_efficiency(1, 128, 128, 8192, hw, eff)
    assert thin < big
    # time per FLOP: same output tiles (same waves), the thin-K GEMM (small reduction) is slower
    per_flop_fat = gemm_time_s(1, 4096 * 16, 4096, 4096, 0.0, hw, "bfloat16") / 4096
    per_flop_thin_k = gemm_time_s(1, 4096 * 16, 4096, 256, 0.0, hw, "bfloat16") / 256
    assert per_flop_thin_k > per_flop_fat * (1 + 0.5 * k0 / (256 + k0))


def test_matmul_and_attention_fractions_are_per_gpu() -> None:
    a100, h100 = HARDWARE["a100-80gb"], HARDWARE["h100"]
    flops = 1e15
    gemm = {hw.name: flops / (compute_time_s(flops, 0.0, hw, "bfloat16", op_class="gemm")
                              - DEFAULT_EFFICIENCY.gemm_overhead_s) for hw in (a100, h100)}
    assert gemm["a100-80gb"] == pytest.approx(312e12 * 0.869 * DEFAULT_EFFICIENCY.gemm_efficiency)
    assert gemm["h100"] == pytest.approx(989e12 * 0.803 * DEFAULT_EFFICIENCY.gemm_efficiency)
    attn = {hw.name: flops / (compute_time_s(flops, 0.0, hw, "bfloat16", op_class="attention")
                              - DEFAULT_EFFICIENCY.gemm_overhead_s) for hw in (a100, h100)}
    # FlashAttention-2 reaches 73% of A100 peak but 35% of H100's: H100 attention gains less
    assert attn["h100"] / attn["a100-80gb"] == pytest.approx(989 * 0.35 / (312 * 0.73))


def test_nccl_latency_terms() -> None:
    cluster = Cluster.parse("h100:64x8")
    (dp,) = mesh_axis_links(cluster, (512,))
    assert dp.base_latency_s == DEFAULT_EFFICIENCY.collective_base_latency_s == 6.6e-6
    # ring steps across a 512-rank mixed axis: 1 network hop (14 us) in 8, NVLink (3.4 us) otherwise
    assert dp.ring_latency_s == pytest.approx((14e-6 + 7 * 3.4e-6) / 8)


def test_runtime_options_change_what_they_should(profile) -> None:
    cluster = Cluster.parse("a100-80gb:4x8")

    def est(config: ParallelConfig, **options):
        return price_profile(profile, config, cluster, global_batch=64, options=RuntimeOptions(**options))

    def part(e, key):
        return dict(e.time_breakdown)[key]

    z3 = ParallelConfig(dp=32, zero=3, recompute="full", micro_batch=2)
    assert part(est(z3, grad_reduce_bytes=4), "comm_zero3_s") > part(est(z3), "comm_zero3_s")
    dp = ParallelConfig(dp=32, micro_batch=2)
    blocking, overlapped = est(dp, overlap_grad_reduce=False), est(dp)
    assert part(blocking, "comm_dp_s") > part(overlapped, "comm_dp_s")
    # 1 MiB buckets: many collectives, each paying the latencies
    assert part(est(dp, overlap_grad_reduce=False, dp_bucket_bytes=2**20), "comm_dp_s") > part(blocking, "comm_dp_s")
    tp = ParallelConfig(tp=8, dp=4, micro_batch=2)
    # async TP hides async_tp_overlap of the layers' collectives (not the vocab-parallel edges)
    vanilla = part(est(tp), "comm_tp_s")
    assert (1 - DEFAULT_EFFICIENCY.async_tp_overlap) * vanilla < part(est(tp, async_tp=True), "comm_tp_s") < vanilla
    assert part(est(dp, compiled=True), "compute_s") < part(est(dp), "compute_s")
    with pytest.raises(ValueError, match="grad_reduce_bytes"):
        RuntimeOptions(grad_reduce_bytes=3)
    with pytest.raises(ValueError, match="unknown runtime options"):
        RuntimeOptions.from_pairs({"fused_adam": "1"})
    assert RuntimeOptions.from_pairs({"compiled": "1", "checkpoint_every": "2"}) == RuntimeOptions(
        compiled=True, checkpoint_every=2)


def test_micro_batch_trade_off_appears_in_the_gemms(profile) -> None:
    """Smaller micro-batches give thinner weight-gradient GEMMs (K = tokens): more time per FLOP."""
    cluster = Cluster.parse("a100-80gb:1x8")
    small = price_profile(profile, ParallelConfig(dp=8, micro_batch=1), cluster, global_batch=64)
    large = price_profile(profile, ParallelConfig(dp=8, micro_batch=8), cluster, global_batch=64)
    assert dict(small.time_breakdown)["compute_s"] > dict(large.time_breakdown)["compute_s"]


def test_core_sharing_and_hardware_overrides(profile) -> None:
    cpu = replace(HARDWARE["cpu"], cores_per_node=2, efficiency=(("gemm_efficiency", 1.0), ("view_overhead_s", 0.0),
                                                                  ("dtensor_op_overhead_s", 0.0)))
    assert efficiency_for(cpu).gemm_efficiency == 1.0 and efficiency_for(HARDWARE["h100"]) == DEFAULT_EFFICIENCY
    two = Cluster(hardware=cpu, num_nodes=1, devices_per_node=2)
    eight = Cluster(hardware=cpu, num_nodes=1, devices_per_node=8)
    a = dict(price_profile(profile, ParallelConfig(dp=2), two, global_batch=8).time_breakdown)
    b = dict(price_profile(profile, ParallelConfig(dp=8), eight, global_batch=8).time_breakdown)
    # a quarter of the work per rank, four ranks per core: the same compute time
    assert b["compute_s"] == pytest.approx(a["compute_s"], rel=0.05)
    (link2,), (link8,) = mesh_axis_links(two, (2,)), mesh_axis_links(eight, (8,))
    assert link8.latency_s == pytest.approx(4 * link2.latency_s)
    assert link8.bandwidth_bytes_per_s == pytest.approx(link2.bandwidth_bytes_per_s / 4)
    # a pipeline's bubble is not idle time when the ranks share cores: the step is every
    # rank's work over the cores (no bubble term) whenever that is the longer
    pipe = dict(price_profile(profile, ParallelConfig(pp=4, dp=2, micro_batch=1), eight, global_batch=8).time_breakdown)
    assert pipe["bubble_s"] == 0.0
    # with dedicated compute the bubble is back
    gpu = Cluster.parse("a100-80gb:1x8")
    assert dict(price_profile(profile, ParallelConfig(pp=4, dp=2, micro_batch=1), gpu,
                              global_batch=8).time_breakdown)["bubble_s"] > 0


def test_a_pipelines_chunk_calls_pay_their_host_time_on_shared_cores_only(profile) -> None:
    """`pipeline_call_host_s` h: `pipeline_call_time_s` is h x ranks per core on the cpu
    profile, 0 on GPUs (no override) and 0 with the field off; price_profile charges every
    stage v h per microbatch when pp > 1 (each stage's time grows, so the step does), and
    nothing to a one-stage program."""
    from cost_model import pipeline_call_time_s

    def cpu(h: float):
        eff = {**dict(HARDWARE["cpu"].efficiency), "pipeline_call_host_s": h}
        return replace(HARDWARE["cpu"], cores_per_node=2, efficiency=tuple(sorted(eff.items())))

    def cluster(hw, n):
        return Cluster(hardware=hw, num_nodes=1, devices_per_node=n)

    h = 4e-4
    assert pipeline_call_time_s(cluster(cpu(h), 8)) == pytest.approx(4 * h)
    assert pipeline_call_time_s(cluster(cpu(h), 2)) == pytest.approx(h)
    assert pipeline_call_time_s(cluster(cpu(0.0), 8)) == 0.0
    assert pipeline_call_time_s(Cluster.parse("h100:1x8")) == 0.0
    pipe, one = ParallelConfig(pp=4, dp=2, micro_batch=1), ParallelConfig(dp=8, micro_batch=1)

    def step(hw, config):
        return price_profile(profile, config, cluster(hw, 8), global_batch=8).step_time_s

    # m = 4 microbatches per dp rank; shared cores: the step is every rank's work over the
    # cores, m sum_k t_k / p, and each of the p stages' t_k grows by share h
    assert step(cpu(h), pipe) - step(cpu(0.0), pipe) == pytest.approx(4 * 4 * h, rel=1e-6)
    assert step(cpu(h), one) == pytest.approx(step(cpu(0.0), one))


def test_collective_latency_grows_by_the_share_law_and_bandwidth_linearly() -> None:
    """`collective_latency_share_exponent` g: with s ranks per core a collective's latency
    terms are the per-core ones x s ** g (1: linear), its bandwidth the per-core one / s;
    a rank per core (s = 1) and GPUs are untouched."""
    def cpu(g: float):
        eff = {"collective_base_latency_s": 2e-4, "collective_latency_share_exponent": g, "nvlink_bus_efficiency": 1.0}
        return replace(HARDWARE["cpu"], cores_per_node=2, efficiency=tuple(sorted(eff.items())))

    for g in (1.0, 0.8, 0.5):
        hw = cpu(g)
        for n in (2, 4, 8):
            (link,) = mesh_axis_links(Cluster.parse(f"cpu:{n}", hardware=hw), (n,))
            s = max(1.0, n / 2)
            assert link.latency_s == pytest.approx(hw.intra_node_latency_s * s ** g)
            assert link.base_latency_s == pytest.approx(2e-4 * s ** g)
            assert link.bandwidth_bytes_per_s == pytest.approx(hw.intra_node_bandwidth_bytes_per_s / s)
    # below 1 the 8-rank latency is less than linear: 2 ** 0.8 = 1.74x the 4-rank one, not 2x
    (four,), (eight,) = (mesh_axis_links(Cluster.parse(f"cpu:{n}", hardware=cpu(0.8)), (n,)) for n in (4, 8))
    assert eight.latency_s / four.latency_s == pytest.approx(2 ** 0.8)
    gpu = replace(HARDWARE["h100"], efficiency=(("collective_latency_share_exponent", 0.5),))
    assert mesh_axis_links(Cluster.parse("h100:1x8", hardware=gpu), (8,))[0].latency_s == pytest.approx(
        mesh_axis_links(Cluster.parse("h100:1x8"), (8,))[0].latency_s)


def test_dtensor_and_view_overheads_apply_to_tp_and_eager(profile) -> None:
    base = replace(HARDWARE["cpu"], cores_per_node=0)
    dt = replace(base, efficiency=tuple(sorted({**dict(base.efficiency), "dtensor_op_overhead_s": 1e-3}.items())))
    cluster = lambda hw: Cluster(hardware=hw, num_nodes=1, devices_per_node=4)  # noqa: E731
    tp = ParallelConfig(tp=2, dp=2)
    plain = price_profile(profile, tp, cluster(base), global_batch=8,
                          options=RuntimeOptions(dtensor_tp=False)).step_time_s
    with_dt = price_profile(profile, tp, cluster(dt), global_batch=8).step_time_s
    no_dt = price_profile(profile, tp, cluster(dt), global_batch=8,
                          options=RuntimeOptions(dtensor_tp=False)).step_time_s
    assert with_dt > plain and no_dt == pytest.approx(plain)
    # data parallelism runs no DTensor ops
    dp = ParallelConfig(dp=4)
    assert price_profile(profile, dp, cluster(dt), global_batch=8).step_time_s == pytest.approx(
        price_profile(profile, dp, cluster(base), global_batch=8).step_time_s)
    assert sum(profile.layer.view_ops) > 0 and not math.isnan(with_dt)


def test_gradient_accumulation_term(profile) -> None:
    """(m - 1) microbatches add into the step's gradients: 3 * element bytes per local
    gradient element per extra microbatch; the replica under zero 0-1, the shard under zero 3."""
    from cost_model.compute import grad_accumulation_time_s

    hw = HARDWARE["a100-80gb"]
    rate = hw.memory_bandwidth_bytes_per_s * efficiency_for(hw).memory_efficiency
    assert grad_accumulation_time_s(1e9, 1, 2, hw) == 0.0
    assert grad_accumulation_time_s(1e9, 5, 2, hw) == pytest.approx(4 * 1e9 * 3 * 2 / rate)
    cluster = Cluster.parse("a100-80gb:1x8")

    def accum(**kw) -> float:
        est = price_profile(profile, ParallelConfig(dp=8, micro_batch=1, **kw), cluster, global_batch=32)
        return dict(est.time_breakdown)["grad_accum_s"]

    # 4 microbatches per rank: 3 extra passes; zero 3 accumulates an eighth of the gradients
    assert accum() > 0
    assert accum(zero=3) == pytest.approx(accum() / 8)
    single = price_profile(profile, ParallelConfig(dp=8, micro_batch=4), cluster, global_batch=32)
    assert dict(single.time_breakdown)["grad_accum_s"] == 0.0


def test_stage_collectives_wait_only_where_other_stages_share_the_cores() -> None:
    """`stage_collective_wait_s` is added to a collective inside one pipeline stage whose
    node's cores other stages' ranks share (a stage cluster keeps the node's ranks); never in
    a one-stage program (its groups reach the same collective at once), never with a core
    per rank, never on GPUs."""
    wait = 1e-3
    eff = lambda hw: tuple(sorted({**dict(hw.efficiency), "stage_collective_wait_s": wait}.items()))  # noqa: E731
    cpu = replace(HARDWARE["cpu"], cores_per_node=2, efficiency=eff(HARDWARE["cpu"]))
    plain = replace(cpu, efficiency=tuple((k, v) for k, v in cpu.efficiency if k != "stage_collective_wait_s"))

    def extra(hw, spec, mesh, stage=None):
        def bases(h):
            cluster = Cluster.parse(spec, hardware=h)
            cluster = cluster.stage(stage) if stage else cluster
            return [link.base_latency_s for link in mesh_axis_links(cluster, mesh)]
        return [a - b for a, b in zip(bases(hw), bases(plain))]

    # tp2 inside a 2-stage pipeline on 4 ranks: the stage's cluster has 2 devices, the node 4
    assert Cluster.parse("cpu:4").stage(2).node_ranks == 4
    assert extra(cpu, "cpu:4", (2,), stage=2) == pytest.approx([wait])
    # dp2 x tp2 stages of a pipeline on 8 ranks, and a stage's whole dp4 group on 8 ranks
    assert extra(cpu, "cpu:8", (2, 2), stage=4) == pytest.approx([wait, wait])
    assert extra(cpu, "cpu:8", (4,), stage=4) == pytest.approx([wait])
    # one stage (dp2 x tp2 on 4 ranks, dp4): every group runs the same collective at once
    assert extra(cpu, "cpu:4", (2, 2)) == pytest.approx([0.0, 0.0])
    assert extra(cpu, "cpu:4", (4,)) == pytest.approx([0.0])
    # a core per rank (2 stages of 1 rank on 2 cores): no sharing, no wait
    assert extra(cpu, "cpu:2", (1,), stage=1) == pytest.approx([0.0])
    # GPUs: a device each, the field has no effect
    gpu = replace(HARDWARE["h100"], efficiency=eff(HARDWARE["h100"]))
    gpu_stage = Cluster.parse("h100:1x8", hardware=gpu).stage(4)
    assert [link.base_latency_s for link in mesh_axis_links(gpu_stage, (2, 2))] == \
        [link.base_latency_s for link in mesh_axis_links(Cluster.parse("h100:1x8").stage(4), (2, 2))]


def test_gemm_memory_efficiency_slows_only_a_gemms_bytes() -> None:
    """`gemm_memory_efficiency` divides the bandwidth a GEMM's bytes move at (both GEMM
    pricers: the ILP's `compute_time_s` and the analytic `gemm_time_s`), and nothing else:
    the FLOP term, memory-bound ops and GPU profiles (where it is 1) price as before."""
    built_in = HARDWARE["cpu"]

    def cpu(value: float):  # the profile's overrides win over an `efficiency` argument
        return replace(built_in, efficiency=tuple(sorted({**dict(built_in.efficiency),
                                                          "gemm_memory_efficiency": value}.items())))

    thin, one = cpu(0.25), cpu(1.0)
    flops, moved = 2 * 64 * 384 * 1024, 4 * (64 * 384 + 384 * 1024 + 64 * 1024)
    base = efficiency_for(one)
    bw = built_in.memory_bandwidth_bytes_per_s * base.memory_efficiency
    t_flops = compute_time_s(flops, 0.0, one, "float32", op_class="gemm") - base.gemm_overhead_s
    for hw, value in ((thin, 0.25), (one, 1.0)):
        assert efficiency_for(hw).gemm_memory_efficiency == value
        t = compute_time_s(flops, moved, hw, "float32", op_class="gemm")
        assert t == pytest.approx(t_flops + moved / (bw * value) + base.gemm_overhead_s, rel=1e-12)
    extra = moved / bw * (1 / 0.25 - 1)
    assert compute_time_s(flops, moved, thin, "float32", op_class="gemm") - \
        compute_time_s(flops, moved, one, "float32", op_class="gemm") == pytest.approx(extra, rel=1e-9)
    # the analytic GEMM pricer: the same extra for the same bytes
    assert gemm_time_s(1, 64, 1024, 384, moved, thin, "float32") - gemm_time_s(1, 64, 1024, 384, moved, one, "float32") \
        == pytest.approx(extra, rel=1e-9)
    # memory-bound ops and a FLOP-only GEMM do not see it
    assert compute_time_s(0.0, moved, thin, "float32") == compute_time_s(0.0, moved, one, "float32")
    assert compute_time_s(flops, 0.0, thin, "float32", op_class="gemm") == \
        compute_time_s(flops, 0.0, one, "float32", op_class="gemm")
    # the built-in cpu profile carries the fitted value; GPU profiles keep the fitted roofline
    assert 0.0 < efficiency_for(built_in).gemm_memory_efficiency < 1.0
    for name in ("a100-40gb", "a100-80gb", "h100", "h200", "b200"):
        assert efficiency_for(HARDWARE[name]).gemm_memory_efficiency == 1.0
    assert DEFAULT_EFFICIENCY.gemm_memory_efficiency == 1.0


def test_the_ilp_charges_every_view_its_host_time_on_the_cpu_profile_only() -> None:
    """A view moves no data, but the per-rank program calls it like any other op: the ILP's
    cost table charges it the profile's view_overhead_s x the ranks per core (as
    price_profile does per view op); a tuple index or an input slot is no op call; on a GPU
    the host runs ahead of the kernels and views cost nothing."""
    from cost_model.table import cost_table
    from solver.intra_op.space import enumerate_strategies

    graph = trace_model(resolve("llama:layers=1,hidden=64,heads=2,kv_heads=2,ffn=128,vocab=128,seq=16"), batch=2,
                        dtype="float32")
    space = enumerate_strategies(graph, (4,))
    views = [n for n in graph.nodes if n.is_view and n.op not in ("getitem", "placeholder", "constant")]
    free = [n for n in graph.nodes if n.op in ("getitem", "placeholder")]
    assert len(views) > 20 and free
    for name, share in (("cpu", 2.0), ("h100", 1.0)):  # cpu:4 on the built-in profile's 2 cores
        cluster = Cluster.parse(f"{name}:4")
        per_view = efficiency_for(cluster.hardware).view_overhead_s * share
        assert (per_view > 0) == (name == "cpu")
        table = cost_table(graph, space, cluster)
        for n in views:
            assert [c.compute_s for c in table.nodes[n.id]] == pytest.approx([per_view] * len(table.nodes[n.id]))
        for n in free:
            assert all(c.compute_s == 0.0 for c in table.nodes[n.id])
