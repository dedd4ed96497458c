"""Calibrated hardware profiles: JSON round-trip, loading, and measured -> fitted -> profile mapping."""

from __future__ import annotations

import json

import pytest

import dataclasses

from autopar.calibrate import CARRIED_FROM_BUILT_IN, KINDS, Calibration, combine, fit, to_hardware
from autopar.cluster import HARDWARE, Cluster, Hardware, load_hardware
from cost_model.collectives import all_gather_time_s, all_reduce_time_s, mesh_axis_links, reduce_scatter_time_s
from cost_model.compute import gemm_time_s

PEAK, K0, OVERHEAD = 10e9, 32.0, 20e-6
BW, ALPHA, L0 = 0.4e9, 1e-3, 2e-3
BUS = {"all_reduce": 0.4e9, "all_gather": 0.2e9, "reduce_scatter": 0.1e9}
OPTIMIZER_S, ACCUMULATE_S, PARAM_TENSOR_S = 25e-9, 4e-9, 30e-6
"""Per parameter and per gradient byte, one dedicated core (10 and 1.6 bytes of copy traffic at BW)."""


def _cal(devices: int = 4, cores: int = 2) -> Calibration:
    """Synthetic measurements that follow the model exactly (all ranks busy, `devices` on `cores`)."""
    s = max(1.0, devices / cores)

    def gemm(m: int, n: int, k: int) -> float:
        return s * (2 * m * n * k / PEAK * (k + K0) / k + OVERHEAD)

    def coll(kind: str, n: int, nbytes: int) -> float:  # gloo: a reduce-scatter is an all-reduce
        twice = kind in ("all_reduce", "reduce_scatter")
        steps = 2 * (n - 1) if twice else n - 1
        vol = (2 if twice else 1) * (n - 1) / n * nbytes
        return s * (L0 + steps * ALPHA + vol / BUS[kind])

    shapes = ((64, 64, 64), (256, 256, 256), (512, 512, 512), (1024, 256, 64), (1024, 1024, 32))
    return Calibration(
        devices=devices, cores=cores, gemm_s=tuple((m, n, k, gemm(m, n, k)) for m, n, k in shapes),
        copy_s=tuple((b, s * (b / BW + 3e-6)) for b in (2**13, 2**20, 2**25)), eager_op_s=s * 5e-6,
        view_op_s=s * 1e-6, dtensor_op_s=s * 50e-6, attention_flops_per_s=PEAK / s / 2,
        collective_s=tuple((kind, n, b, coll(kind, n, b)) for kind in KINDS for n in (2, devices)
                           for b in (2**12, 2**21, 2**23)),
        send_recv_s=tuple((b, s * (b / 2e9 + 1e-4)) for b in (2**12, 2**21)), reference_s=s * 0.05,
        optimizer_s=s * OPTIMIZER_S, accumulate_s=s * ACCUMULATE_S, param_tensor_s=s * PARAM_TENSOR_S,
    )


@pytest.mark.parametrize("name", sorted(HARDWARE))
def test_hardware_json_round_trip(name: str) -> None:
    hw = HARDWARE[name]
    assert Hardware.from_json(json.loads(json.dumps(hw.to_json()))) == hw


def test_fit_recovers_the_model_terms_per_dedicated_core() -> None:
    for devices in (2, 4, 8):  # 2 ranks on 2 cores: no sharing; 8: four ranks per core
        f = fit(_cal(devices), latency_exponent=1.0)  # _cal's latencies grow linearly with the sharing
        assert f.gemm_flops_per_s == pytest.approx(PEAK, rel=1e-6)
        assert f.gemm_k_ramp == pytest.approx(K0, rel=1e-4)
        assert f.gemm_overhead_s == pytest.approx(OVERHEAD, rel=1e-4)
        assert f.copy_bytes_per_s == pytest.approx(BW, rel=1e-6)
        assert f.hop_latency_s == pytest.approx(ALPHA, rel=1e-6) and f.base_latency_s == pytest.approx(L0, rel=1e-6)
        assert f.bus_bytes_per_s == pytest.approx(BUS, rel=1e-6)
        assert f.eager_op_s == pytest.approx(5e-6) and f.dtensor_op_overhead_s == pytest.approx(50e-6)


def _slowed(cal: Calibration, factor: float, *, burst: tuple[int, int, int] | None = None) -> Calibration:
    """`cal` measured on a machine `factor` times slower (its reference too), plus a burst of
    load (x5) that hit only the GEMM shape `burst`."""
    gemm = tuple((m, n, k, t * factor * (5.0 if (m, n, k) == burst else 1.0)) for m, n, k, t in cal.gemm_s)
    return dataclasses.replace(
        cal, gemm_s=gemm, copy_s=tuple((b, t * factor) for b, t in cal.copy_s), eager_op_s=cal.eager_op_s * factor,
        view_op_s=cal.view_op_s * factor, dtensor_op_s=cal.dtensor_op_s * factor,
        attention_flops_per_s=cal.attention_flops_per_s / factor,
        collective_s=tuple((*r[:3], r[3] * factor) for r in cal.collective_s),
        send_recv_s=tuple((b, t * factor) for b, t in cal.send_recv_s), reference_s=cal.reference_s * factor)


def test_combine_sets_runs_to_the_median_speed_and_ignores_one_burst() -> None:
    cal = _cal(4)
    runs = [_slowed(cal, 1.0), _slowed(cal, 1.5, burst=(512, 512, 512)), _slowed(cal, 2.0)]
    combined = combine(runs)
    assert combined.reference_s == pytest.approx(1.5 * cal.reference_s)  # the median run's, not the fastest
    for got, want in zip(combined.gemm_s, cal.gemm_s):  # the burst in one run is outvoted
        assert got[:3] == want[:3] and got[3] == pytest.approx(1.5 * want[3])
    assert combined.attention_flops_per_s == pytest.approx(cal.attention_flops_per_s / 1.5)
    assert fit(combined).gemm_overhead_s == pytest.approx(1.5 * OVERHEAD, rel=1e-4)
    assert fit(runs[1]).gemm_overhead_s != pytest.approx(OVERHEAD, rel=1e-2)  # one run alone is skewed
    with pytest.raises(ValueError, match="different device"):
        combine([cal, _cal(8)])


def test_calibrated_profile_file_round_trip(tmp_path) -> None:
    hw = to_hardware(_cal())
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"hardware": hw.to_json(), "measurements": _cal().to_json()}))
    loaded = load_hardware(path)
    assert loaded == hw
    assert Calibration.from_json(json.loads(path.read_text())["measurements"]) == _cal()
    cluster = Cluster.parse("cpu:4", hardware=loaded)
    assert cluster.hardware is loaded and cluster.num_devices == 4


@pytest.mark.parametrize("devices", [4, 8])
def test_profile_reproduces_measured_rates(monkeypatch, devices: int) -> None:
    """Priced at the N it was measured with, the profile gives back what was measured (and
    8 ranks what _cal's linear law says: the built-in's share law set to 1 here; other laws:
    test_share_law_prices_the_measured_rank_count_as_measured)."""
    built_in = HARDWARE["cpu"]
    eff = tuple(sorted({**dict(built_in.efficiency), "collective_latency_share_exponent": 1.0}.items()))
    monkeypatch.setitem(HARDWARE, "cpu", dataclasses.replace(built_in, efficiency=eff))
    cal = _cal(4)
    hw = to_hardware(cal)
    s = devices / 2
    # a GEMM as measured with `devices` ranks on 2 cores: the profile's per-core rates times
    # the sharing the cost model applies
    m, n, k = 512, 512, 512
    measured_4 = dict(((a, b, c), t) for a, b, c, t in cal.gemm_s)[(m, n, k)]
    single = gemm_time_s(1, m, n, k, 0.0, hw, "float32")
    assert 2 * single == pytest.approx(measured_4, rel=0.01)
    cluster = Cluster.parse(f"cpu:{devices}", hardware=hw)
    (link,) = mesh_axis_links(cluster, (devices,))
    big = 2**30
    # gloo's reduce-scatter is an all-reduce of the whole input: twice the ring's steps and volume
    for time_s, kind, vol in ((all_gather_time_s, "all_gather", 1), (reduce_scatter_time_s, "reduce_scatter", 2),
                              (all_reduce_time_s, "all_reduce", 2)):
        expected = s * (L0 + (vol * (devices - 1)) * ALPHA + vol * (devices - 1) / devices * big / BUS[kind])
        assert time_s(big, link) == pytest.approx(expected, rel=1e-4)
    assert dict(hw.collective_bandwidth_scale) == pytest.approx({"all_gather": 0.5, "reduce_scatter": 0.25})
    assert hw.cores_per_node == 2 and hw.reference_s == pytest.approx(0.05)


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


def test_reference_time_is_the_fastest_window_of_the_sweeps_shape() -> None:
    """`reference_s` and the sweep's reference timings are reduced alike: the fastest of
    REFERENCE_WINDOWS windows of REFERENCE_CALLS calls (one warm-up call first)."""
    from autopar import calibrate_rank as calibrate

    clock = {"t": 0.0}
    calls = []
    slow = {3}  # the fourth window runs each call 2x as fast; the others at 1 s per call

    def reference() -> None:
        calls.append(1)
        window = (len(calls) - 2) // calibrate.REFERENCE_CALLS
        clock["t"] += 0.5 if window in slow else 1.0

    real = calibrate.time.perf_counter
    calibrate.time.perf_counter = lambda: clock["t"]
    try:
        got = calibrate.reference_time(reference, lambda: None)
    finally:
        calibrate.time.perf_counter = real
    assert got == pytest.approx(0.5)
    assert len(calls) == 1 + calibrate.REFERENCE_WINDOWS * calibrate.REFERENCE_CALLS


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_profile_prices_the_measured_optimizer_step_and_accumulation(devices: int) -> None:
    """The optimizer step and the in-place gradient accumulation are priced at what calibrate
    timed (per element, per byte; x the job's sharing), through the cost model's own
    formulas, not at the default traffic (36 bytes per parameter, 3 per gradient byte)."""
    from cost_model import core_share, grad_accumulation_time_s, optimizer_time_s

    hw = to_hardware(_cal(4))
    eff = dict(hw.efficiency)
    assert eff["optimizer_bytes_per_param"] == pytest.approx(OPTIMIZER_S * BW)
    assert eff["accumulate_bytes_per_byte"] == pytest.approx(ACCUMULATE_S * BW)
    share = core_share(Cluster.parse(f"cpu:{devices}", hardware=hw))
    assert share == max(1.0, devices / 2)
    params, grad_bytes, m, tensors = 3e6, 12e6, 4, 39
    assert optimizer_time_s(params, hw) * share == pytest.approx(share * params * OPTIMIZER_S)
    # the per-tensor epilogue: what calibrate timed per parameter tensor, on top
    assert optimizer_time_s(params, hw, tensors=tensors) * share == \
        pytest.approx(share * (params * OPTIMIZER_S + tensors * PARAM_TENSOR_S))
    assert eff["optimizer_tensor_overhead_s"] == pytest.approx(PARAM_TENSOR_S)
    assert optimizer_time_s(params, HARDWARE["h100"], tensors=tensors) == optimizer_time_s(params, HARDWARE["h100"])
    assert grad_accumulation_time_s(grad_bytes / 4, m, 4, hw) * share == \
        pytest.approx(share * (m - 1) * grad_bytes * ACCUMULATE_S)
    # a calibration written before these were measured keeps the default traffic
    old = dataclasses.replace(_cal(4), optimizer_s=0.0, accumulate_s=0.0, param_tensor_s=0.0)
    kept = dict(to_hardware(old).efficiency)
    assert not {"optimizer_bytes_per_param", "accumulate_bytes_per_byte", "optimizer_tensor_overhead_s"} & set(kept)
    data = _cal(4).to_json()
    del data["optimizer_s"], data["accumulate_s"], data["param_tensor_s"]
    assert Calibration.from_json(data).optimizer_s == 0.0 and Calibration.from_json(data).param_tensor_s == 0.0


def test_combine_keeps_the_optimizer_and_accumulation_measurements() -> None:
    runs = [_cal(4), _cal(4), dataclasses.replace(_cal(4), optimizer_s=1.0, accumulate_s=1.0, param_tensor_s=1.0)]
    both = combine(runs)
    assert both.optimizer_s == pytest.approx(2 * OPTIMIZER_S) and both.accumulate_s == pytest.approx(2 * ACCUMULATE_S)
    assert both.param_tensor_s == pytest.approx(2 * PARAM_TENSOR_S)


def test_least_squares_is_the_constrained_optimum_not_a_clipped_one() -> None:
    """gloo's latency rows (2-rank groups far faster per ring step than 4-rank ones) pull an
    unconstrained per-call latency below 0. The fit must then re-solve the per-step latency
    with the per-call term held at 0 (the least squares line through the origin), not keep
    the unconstrained slope and clip the intercept (clipping left per-step latencies 20-55% too
    high in three real calibrations)."""
    import itertools

    import numpy as np

    from autopar.calibrate import _least_squares

    # t = L0 + steps * alpha: 2-rank rows (2 steps) at 0.2 ms, 4-rank rows (6 steps) at 4 ms
    rows = [[1.0, 2.0], [1.0, 2.0], [1.0, 6.0], [1.0, 6.0]]
    ys = [0.2e-3, 0.25e-3, 4.0e-3, 4.2e-3]
    a, y = np.array(rows), np.array(ys)
    unconstrained = np.linalg.lstsq(a, y, rcond=None)[0]
    assert unconstrained[0] < 0  # the case: a negative per-call latency
    base, alpha = _least_squares(rows, ys)
    assert base == 0.0
    assert alpha == pytest.approx(float(a[:, 1] @ y / (a[:, 1] @ a[:, 1])), rel=1e-9)
    assert alpha < unconstrained[1]  # the clipped fit kept this too-steep slope

    # random problems: the result is feasible and no better feasible point exists among the
    # free-set solutions (brute force with numpy), and KKT holds: zero gradient on the free
    # coefficients, a non-negative one on those held at 0
    rng = np.random.default_rng(0)
    for _ in range(50):
        a = rng.uniform(0.0, 1.0, size=(9, 4))
        y = a @ rng.normal(size=4) + rng.normal(scale=0.1, size=9)
        x = np.array(_least_squares(a.tolist(), y.tolist()))
        assert (x >= 0).all()
        best = float((y ** 2).sum())  # all coefficients 0
        for k in range(1, 5):
            for f in itertools.combinations(range(4), k):
                sub = np.linalg.lstsq(a[:, list(f)], y, rcond=None)[0]
                if (sub >= 0).all():
                    best = min(best, float(((a[:, list(f)] @ sub - y) ** 2).sum()))
        assert float(((a @ x - y) ** 2).sum()) == pytest.approx(best, rel=1e-7, abs=1e-12)
        grad = a.T @ (a @ x - y)
        assert np.allclose(grad[x > 0], 0.0, atol=1e-8) and (grad[x == 0] >= -1e-8).all()

    # a non-negative unconstrained solution is returned as is
    a = rng.uniform(0.5, 1.0, size=(6, 3))
    truth = np.array([1.0, 2.0, 3.0])
    assert _least_squares(a.tolist(), (a @ truth).tolist()) == pytest.approx(truth.tolist(), rel=1e-9)


@pytest.mark.parametrize("name,other", [("stage_collective_wait_s", 1.25e-3), ("gemm_memory_efficiency", 0.45),
                                        ("collective_latency_share_exponent", 0.7), ("pipeline_call_host_s", 3e-4)])
def test_calibrated_profile_carries_the_sweep_fitted_constants(monkeypatch, name: str, other: float) -> None:
    """calibrate measures none of `stage_collective_wait_s`, `gemm_memory_efficiency`,
    `collective_latency_share_exponent` and `pipeline_call_host_s`
    (benchmarks/fit/fit_cpu_constants.py fits them on the recorded sweeps): a calibrated profile
    takes the built-in's values."""
    assert name in CARRIED_FROM_BUILT_IN
    built_in = HARDWARE["cpu"]
    for value in (dict(built_in.efficiency)[name], other):
        eff = tuple(sorted({**dict(built_in.efficiency), name: value}.items()))
        monkeypatch.setitem(HARDWARE, "cpu", dataclasses.replace(built_in, efficiency=eff))
        assert dict(to_hardware(_cal(4)).efficiency)[name] == value


@pytest.mark.parametrize("g", [1.0, 0.8, 0.5])
def test_share_law_prices_the_measured_rank_count_as_measured(monkeypatch, g: float) -> None:
    """The profile stores collective latencies per dedicated core by the share law it carries
    (measured / s ** g, s = ranks per core when measured; the cost model multiplies by the
    priced job's s ** g): whatever g, 4 ranks on 2 cores price as the 4-rank measurements
    say; 8 ranks pay the measured latency x 2 ** g, and bandwidth / 2 (linear)."""
    built_in = HARDWARE["cpu"]
    eff = tuple(sorted({**dict(built_in.efficiency), "collective_latency_share_exponent": g}.items()))
    monkeypatch.setitem(HARDWARE, "cpu", dataclasses.replace(built_in, efficiency=eff))
    cal = _cal(4)
    f, hw = fit(cal), to_hardware(cal)
    assert f.hop_latency_s == pytest.approx(2 * ALPHA / 2 ** g) and f.base_latency_s == pytest.approx(2 * L0 / 2 ** g)
    assert fit(cal, latency_exponent=1.0).hop_latency_s == pytest.approx(ALPHA)
    (four,), (eight,) = (mesh_axis_links(Cluster.parse(f"cpu:{n}", hardware=hw), (n,)) for n in (4, 8))
    small = 2**12
    measured_4 = dict(((k, n, b), t) for k, n, b, t in cal.collective_s)[("all_reduce", 4, small)]
    assert all_reduce_time_s(small, four) == pytest.approx(measured_4, rel=1e-6)
    latency_4 = 2 * (L0 + 6 * ALPHA)  # 4 ranks on 2 cores, as measured
    latency_8 = 2 * (L0 + 14 * ALPHA) * 2 ** g  # 14 ring steps at 4 ranks per core
    assert all_reduce_time_s(small, eight) == pytest.approx(latency_8 + 4 * 2 * 7 / 8 * small / BUS["all_reduce"])
    assert all_reduce_time_s(small, four) == pytest.approx(latency_4 + 2 * 2 * 3 / 4 * small / BUS["all_reduce"])


def test_cli_refit_derives_the_profile_from_kept_measurements(tmp_path, capsys) -> None:
    from autopar.cli import main

    cal = _cal(4)
    stale = dataclasses.replace(to_hardware(cal), intra_node_latency_s=1.0)  # what an older fit wrote
    src, out = tmp_path / "old.json", tmp_path / "new.json"
    src.write_text(json.dumps({"hardware": stale.to_json(), "measurements": cal.to_json()}))
    assert main(["calibrate", "--refit", str(src), "--out", str(out)]) == 0
    assert "nothing measured now" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert load_hardware(out) == to_hardware(cal) != stale
    assert Calibration.from_json(written["measurements"]) == cal
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(stale.to_json()))
    for bad, says in ((tmp_path / "missing.json", "cannot read it"), (bare, 'no "measurements" object')):
        assert main(["calibrate", "--refit", str(bad)]) == 2
        err = capsys.readouterr().err
        assert f"--refit {bad}" in err and says in err and "autopar calibrate --out" in err
    assert main(["calibrate", "--refit", str(src), "--repeats", "3"]) == 2
    assert "--repeats 3 does not apply" in capsys.readouterr().err
    assert main(["calibrate", "--refit", str(src), "--devices", "8"]) == 2
    assert "made on 4 ranks, not the --devices 8 given" in capsys.readouterr().err
    assert main(["calibrate", "--refit", str(src), "--devices", "4"]) == 0


def test_built_in_profile_is_what_the_fit_derives_from_its_kept_measurements() -> None:
    """autopar/cpu_profile.json keeps calibrate's measurements beside the profile: the shipped
    profile is exactly what this version's fits make of them (`autopar calibrate --refit`
    reproduces it), so a fit that changes cannot leave the built-in profile behind unnoticed."""
    from autopar.cluster import CPU_PROFILE_PATH

    kept = Calibration.from_json(json.loads(CPU_PROFILE_PATH.read_text())["measurements"])
    assert to_hardware(kept) == HARDWARE["cpu"]


def test_per_op_and_view_costs_come_from_the_runtimes_path_where_measured() -> None:
    """The profile's per-op and per-view host costs are the ones measured on the per-rank
    program's path (make_fx GraphModule, ATen op overloads under no_grad); a calibration
    written before that probe (0) keeps its eager and Tensor-method figures."""
    cal = _cal(4)  # 2 ranks per core: figures per dedicated core are half the measured ones
    old = fit(cal)
    assert old.eager_op_s == pytest.approx(5e-6) and old.view_op_s == pytest.approx(1e-6)
    new_cal = dataclasses.replace(cal, program_op_s=2 * 3e-6, program_view_s=2 * 1.5e-6)
    new = fit(new_cal)
    assert new.eager_op_s == pytest.approx(3e-6) and new.view_op_s == pytest.approx(1.5e-6)
    eff = dict(to_hardware(new_cal).efficiency)
    assert eff["view_overhead_s"] == pytest.approx(1.5e-6) and eff["memory_overhead_s"] >= 3e-6
    assert Calibration.from_json(new_cal.to_json()) == new_cal
    assert Calibration.from_json(cal.to_json()).program_view_s == 0.0
    assert combine([new_cal, new_cal, new_cal]).program_view_s == pytest.approx(new_cal.program_view_s)


def test_one_element_all_reduces_are_fitted_and_carried_per_dedicated_core() -> None:
    """calibrate's one-element all-reduces (all N ranks and 2-rank groups) fit one step
    latency, t = L0 + 2 (n-1) alpha_scalar, stored per dedicated core by the share law; the
    profile carries it (`scalar_all_reduce_hop_s`) and prices the measured rank counts as
    measured. A calibration without them (an older calibrate's) carries none."""
    from autopar.calibrate import latency_share_exponent

    scalar_alpha = ALPHA / 5
    for devices in (4, 8):
        cal = _cal(devices)
        s_lat = cal.sharing ** latency_share_exponent()
        # _cal's collectives: launch L0 x the sharing; a one-element all-reduce pays it too
        rows = tuple((n, cal.sharing * L0 + 2 * (n - 1) * scalar_alpha * s_lat) for n in (2, devices))
        cal = dataclasses.replace(cal, scalar_all_reduce_s=rows)
        f = fit(cal)
        assert f.scalar_hop_latency_s == pytest.approx(scalar_alpha, rel=1e-6)
        hw = to_hardware(cal)
        assert dict(hw.efficiency)["scalar_all_reduce_hop_s"] == pytest.approx(scalar_alpha, rel=1e-6)
        (link,) = mesh_axis_links(Cluster.parse(f"cpu:{devices}", hardware=hw), (devices,))
        assert all_reduce_time_s(4, link) == pytest.approx(dict(rows)[devices], rel=1e-3)
        again = Calibration.from_json(json.loads(json.dumps(cal.to_json())))
        assert again.scalar_all_reduce_s == cal.scalar_all_reduce_s
        assert combine([cal, cal]).scalar_all_reduce_s == cal.scalar_all_reduce_s
    old = _cal(4)
    assert fit(old).scalar_hop_latency_s == 0.0
    assert "scalar_all_reduce_hop_s" not in dict(to_hardware(old).efficiency)


@pytest.mark.parametrize("pages", [1_000_003, 6_170_963, 123_456_789])
def test_profiles_from_kept_measurements_do_not_read_the_machine(monkeypatch, pages: int) -> None:
    """The built-in profile is a fixed file: on a machine with any other memory size the fit
    of its kept measurements, the constants fit's digest and its candidates are what they are
    here. Only a calibration that did not record its machine's memory reads this one."""
    import os

    from autopar.calibrate import machine_memory_bytes
    from autopar.cluster import CPU_PROFILE_PATH

    from benchmarks.fit import fit_cpu_constants

    digest_here = fit_cpu_constants.profile_digest()
    real = os.sysconf

    def fake_sysconf(name):
        return pages if name == "SC_PHYS_PAGES" else (4096 if name == "SC_PAGE_SIZE" else real(name))

    monkeypatch.setattr(os, "sysconf", fake_sysconf)
    assert machine_memory_bytes() == pages * 4096 != HARDWARE["cpu"].memory_bytes * 4
    kept = Calibration.from_json(json.loads(CPU_PROFILE_PATH.read_text())["measurements"])
    assert kept.total_memory_bytes == HARDWARE["cpu"].memory_bytes * kept.devices
    assert to_hardware(kept) == HARDWARE["cpu"]
    assert fit_cpu_constants.with_values(HARDWARE["cpu"], {}) == HARDWARE["cpu"]
    assert fit_cpu_constants.profile_digest() == digest_here
    # a calibration that did not record it: the memory of the machine deriving the profile
    unrecorded = dataclasses.replace(kept, total_memory_bytes=0)
    assert Calibration.from_json({k: v for k, v in kept.to_json().items() if k != "total_memory_bytes"}) == unrecorded
    assert to_hardware(unrecorded).memory_bytes == pages * 4096 // kept.devices
    # runs combined: the memory every run had
    assert combine([kept, dataclasses.replace(kept, total_memory_bytes=kept.total_memory_bytes + 4096),
                    unrecorded]).total_memory_bytes == kept.total_memory_bytes
