"""The CPU sweep's measurement protocol (benchmarks/sweep_cpu.py): what is a step time, what
is the noise estimate, and that the repeated program stays out of the rankings.

Pure functions on hand-made rows: no process starts.
"""

from __future__ import annotations


import pytest


from benchmarks import sweep_cpu


def _row(label: str, times: list[float], predicted: float, size: str = "M", world: int = 4) -> dict:
    return {"size": size, "world": world, "label": label, "measured_s": min(times),
            "measured_times_s": times, "predicted_calibrated_s": predicted}


def test_every_world_times_its_first_configuration_twice():
    for world in (4, 8):
        got = sweep_cpu.cases(world)
        assert got[1].label == got[0].label + sweep_cpu.REPEAT_SUFFIX
        assert got[1].config == got[0].config


def test_noise_compares_the_two_identical_programs_under_both_estimators():
    rows = [_row("dp4 mb4", [0.20, 0.50, 0.21], 0.2),
            _row("dp4 mb4" + sweep_cpu.REPEAT_SUFFIX, [0.22, 0.90, 0.30], 0.2),
            _row("pp4", [0.4, 0.41, 0.5], 0.3)]
    (pair,) = sweep_cpu.noise(rows)
    assert pair["group"] == "M x 4" and pair["label"] == "dp4 mb4"
    assert pair["min_apart"] == pytest.approx(0.22 / 0.20 - 1)
    assert pair["median_apart"] == pytest.approx(0.30 / 0.21 - 1)


def test_the_repeat_is_not_ranked():
    rows = [_row("a", [1.0], 1.0), _row("a" + sweep_cpu.REPEAT_SUFFIX, [5.0], 0.1), _row("b", [2.0], 2.0),
            _row("c", [3.0], 3.0)]
    out = sweep_cpu.summarize(rows)
    fig = out["groups"]["M x 4"]["predicted_calibrated_s"]
    # with the repeat ranked, its low prediction would make it the pick and break the order
    assert fig["pick"] == "a" and fig["spearman"] == pytest.approx(1.0)
    assert out["noise"][0]["min_apart"] == pytest.approx(4.0)
    assert any(s.startswith("noise") for s in out["summary"])


def test_a_run_whose_identical_programs_differ_beyond_the_noise_bound_is_flagged():
    quiet = [_row("a", [1.00, 1.1], 1.0), _row("a" + sweep_cpu.REPEAT_SUFFIX, [1.02, 1.1], 1.0),
             _row("b", [2.0], 2.0)]
    loud = [_row("a", [1.00, 1.1], 1.0, size="S"), _row("a" + sweep_cpu.REPEAT_SUFFIX, [1.08], 1.0, size="S"),
            _row("b", [2.0], 2.0, size="S")]
    out = sweep_cpu.summarize(quiet + loud)
    assert out["noisy_groups"] == ["S x 4"]
    (line,) = [s for s in out["summary"] if s.startswith("NOISY RUN")]
    assert "S x 4 (8.0%)" in line and "M x 4" not in line
    assert sweep_cpu.summarize(quiet)["noisy_groups"] == []
    assert not any(s.startswith("NOISY RUN") for s in sweep_cpu.summarize(quiet)["summary"])


def test_load_factor_takes_the_fastest_reference_window():
    class Hw:
        reference_s = 0.02
        cores_per_node = 2

    # 4 ranks on 2 cores: per dedicated core the fastest window is 0.05 / 2
    assert sweep_cpu.load_factor(Hw(), 4, [0.09, 0.05, 0.3]) == pytest.approx(0.05 / 2 / 0.02)


def test_reference_reduced_as_calibrate_reduces_it():
    """The sweep's reference timings (one window per timed round, the fastest) are the
    estimator of `Calibration.reference_s`: same window length, same number of windows."""
    from autopar import calibrate_rank as calibrate

    assert sweep_cpu.REFERENCE_CALLS == calibrate.REFERENCE_CALLS
    assert sweep_cpu.TIMED_ROUNDS == calibrate.REFERENCE_WINDOWS


def test_merge_input_is_checked_before_measuring(tmp_path, capsys):
    """A bad --merge file is refused at once (exit 2, naming it), not after the measuring."""
    bad = tmp_path / "old.json"
    bad.write_text('{"groups": {}}')
    for path in (tmp_path / "missing.json", bad):
        with pytest.raises(SystemExit) as stop:
            sweep_cpu.main(["--merge", str(path), "--sizes", "S", "--worlds", "4",
                            "--json", str(tmp_path / "out.json")])
        assert stop.value.code == 2
        assert f"--merge {path}: not a sweep_cpu.py JSON" in capsys.readouterr().err


def test_load_slows_local_work_not_collectives():
    """`at_load`: the reference workload times local work only, so the load factor slows the
    profile's GEMMs, copies, per-op and optimizer overheads by exactly the factor and leaves
    gloo's latency and bandwidth as calibrated."""
    import cost_model
    from autopar.cluster import HARDWARE, Cluster

    hw = HARDWARE["cpu"]
    assert sweep_cpu.at_load(hw, 1.0) is hw
    slow = sweep_cpu.at_load(hw, 1.5)
    for op_class, flops, nbytes in (("gemm", 2 * 256 * 384 * 1024, 4 * (256 * 384 + 384 * 1024)),
                                    ("memory", 0.0, 1 << 20), ("attention", 1e8, 1 << 16)):
        before = cost_model.compute_time_s(flops, nbytes, hw, "float32", op_class=op_class)
        after = cost_model.compute_time_s(flops, nbytes, slow, "float32", op_class=op_class)
        assert after == pytest.approx(1.5 * before, rel=1e-9), op_class
    assert cost_model.optimizer_time_s(1e6, slow, tensors=40) == pytest.approx(
        1.5 * cost_model.optimizer_time_s(1e6, hw, tensors=40), rel=1e-9)
    for world in (4, 8):
        links = cost_model.mesh_axis_links(Cluster.parse(f"cpu:{world}", hardware=hw), (world,))
        slow_links = cost_model.mesh_axis_links(Cluster.parse(f"cpu:{world}", hardware=slow), (world,))
        for size in (4096, 8 << 20):
            assert cost_model.all_reduce_time_s(size, slow_links[0]) == cost_model.all_reduce_time_s(size, links[0])
    assert slow.reference_s == pytest.approx(1.5 * hw.reference_s)


def test_round_adjusted_estimator_separates_the_machine_from_one_program():
    """benchmarks/fit/sweep_estimators.py: rounds slowed for everyone (the machine: x1.0-1.6)
    and one program hit on its own in two of five rounds (x1.3). The round-adjusted reading
    keeps the programs' true ratio; the minimum and the median over rounds do not."""
    from benchmarks.fit import sweep_estimators

    machine = [1.0, 1.4, 1.2, 1.6, 1.1]
    own = {"a": [1.3, 1.0, 1.3, 1.0, 1.0], "b": [1.0] * 5, "c": [1.0] * 5}
    base = {"a": 0.10, "b": 0.10, "c": 0.40}
    rows = [{"label": k, "measured_times_s": [v * f * o for f, o in zip(machine, own[k])]} for k, v in base.items()]
    read = {name: dict(zip(base, fn(rows))) for name, fn in sweep_estimators.ESTIMATORS.items()}
    adjusted = read["round-adjusted median"]
    assert adjusted["a"] / adjusted["b"] == pytest.approx(1.0, rel=1e-9)
    assert adjusted["c"] / adjusted["b"] == pytest.approx(4.0, rel=1e-9)
    assert read["min"]["a"] / read["min"]["b"] == pytest.approx(1.1, rel=1e-9)
    assert read["median"]["a"] / read["median"]["b"] == pytest.approx(1.4 / 1.2, rel=1e-9)
    # fastest half: the mean of the fastest 3 of 5 rounds (b: 1.0, 1.1, 1.2 of its base)
    assert read["fastest half"]["b"] == pytest.approx(0.10 * (1.0 + 1.1 + 1.2) / 3, rel=1e-9)


def test_reference_reading_per_block_of_calibrates_windows():
    """The load factor's reference time: calibrate's reading (the fastest of
    REFERENCE_WINDOWS windows) per block of that many rounds, the median over blocks, so a
    longer sweep does not read its reference faster than calibrate reads its own."""
    w = sweep_cpu.REFERENCE_WINDOWS
    one = [0.010 + 0.001 * k for k in range(w)]
    assert sweep_cpu.reference_reading(one) == 0.010
    two = one + [0.014 + 0.001 * k for k in range(w)]
    assert sweep_cpu.reference_reading(two) == pytest.approx(0.012)
    assert sweep_cpu.reference_reading([0.02, 0.011, 0.013]) == 0.011  # --quick: fewer than a block
    three = two + [0.009] * w
    assert sweep_cpu.reference_reading(three) == 0.010


def test_sweep_rounds_must_fill_reference_blocks(tmp_path):
    out = ["--json", str(tmp_path / "out.json")]
    with pytest.raises(SystemExit) as err:
        sweep_cpu.main(["--rounds", str(sweep_cpu.REFERENCE_WINDOWS + 1), "--sizes", "S", *out])
    assert err.value.code == 2
    with pytest.raises(SystemExit) as err:
        sweep_cpu.main(["--quick", "--rounds", str(2 * sweep_cpu.REFERENCE_WINDOWS), *out])
    assert err.value.code == 2


def test_measuring_sweep_needs_an_output_file(capsys, monkeypatch):
    """A run that would measure for minutes and write nothing is refused before any rank starts."""
    monkeypatch.setattr(sweep_cpu, "measure", lambda *a, **k: pytest.fail("measured without an output file"))
    with pytest.raises(SystemExit) as err:
        sweep_cpu.main(["--sizes", "S", "--worlds", "4", "--quick"])
    assert err.value.code == 2
    assert "neither was given" in capsys.readouterr().err


def test_sweep_estimators_names_a_missing_file(tmp_path, capsys):
    from benchmarks.fit import sweep_estimators

    with pytest.raises(SystemExit) as err:
        sweep_estimators.main([str(tmp_path / "nope.json")])
    assert err.value.code == 2
    assert "nope.json" in capsys.readouterr().err


def test_round_order_gives_every_configuration_many_predecessors():
    """A step's time depends on the step before it. The round-robin order gave each
    configuration the same two predecessors in every round (a fixed bias per row); the random
    order, the default, gives it many, and is the same on every rank (a function of the
    round alone) so the ranks' collectives match."""
    n, rounds = 9, 22

    def predecessors(order: str) -> dict[int, set]:
        seen: dict[int, set] = {i: set() for i in range(n)}
        for k in range(rounds):
            got = sweep_cpu.round_order(n, k, order)
            assert sorted(got) == list(range(n))
            assert got == sweep_cpu.round_order(n, k, order)
            for prev, i in zip([None, *got], got):
                seen[i].add(prev)
        return seen

    rotate = predecessors("rotate")
    assert all(s - {None} == {(i - 1) % n, (i + 1) % n} for i, s in rotate.items())
    assert sweep_cpu.round_order(n, 2, "rotate")[0] == 2 and sweep_cpu.round_order(n, 3, "rotate")[-1] == 3
    shuffled = predecessors("random")
    assert min(len(s - {None}) for s in shuffled.values()) >= 4
    assert len({tuple(sweep_cpu.round_order(n, k)) for k in range(rounds)}) == rounds
    with pytest.raises(ValueError, match="rotate"):
        sweep_cpu.round_order(n, 0, "reverse")


def test_pick_resolution_hindsight_and_paired_rounds(tmp_path, capsys):
    """benchmarks/fit/pick_resolution.py: where the measured best moves between runs, the one
    configuration best on average (the hindsight ranker) still loses in the run it is not
    best in; paired per-round ratios read a constant ratio exactly."""
    import json

    from benchmarks.fit import pick_resolution

    assert pick_resolution.paired([1.1, 2.2, 3.3], [1.0, 2.0, 3.0]) == pytest.approx((0.1, 0.1, 0.1))
    a = [_row("a", [1.00, 1.01], 1.0), _row("b", [1.05, 1.06], 2.0), _row("c", [1.3, 1.3], 3.0)]
    b = [_row("a", [1.06, 1.07], 1.0), _row("b", [1.00, 1.02], 2.0), _row("c", [1.3, 1.3], 3.0)]
    c = [_row("a", [1.00, 1.00], 2.0), _row("b", [1.04, 1.04], 1.0), _row("c", [1.3, 1.3], 3.0)]
    got = pick_resolution.analyse({"r1": a, "r2": b, "r3": c}, "min")["M x 4"]
    assert got["hindsight"] == "a"
    assert got["hindsight_regret"] == pytest.approx([0.0, 0.06, 0.0])
    assert [r["pick"] for r in got["runs"]] == ["a", "a", "b"]
    assert [r["regret"] for r in got["runs"]] == pytest.approx([0.0, 0.06, 0.04])
    files = []
    for name, rows in (("r1", a), ("r2", b)):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps({"rows": rows}))
    assert pick_resolution.main([str(f) for f in files]) == 0
    out = capsys.readouterr().out
    assert "| M x 4 | a (0.0%), a (6.0%) |" in out and "1 / 1 of 2" in out
    with pytest.raises(SystemExit) as err:
        pick_resolution.main([str(tmp_path / "nope.json")])
    assert err.value.code == 2
    assert "nope.json" in capsys.readouterr().err


def test_pick_resolution_reads_both_pick_targets_per_run():
    """The per-run table counts the groups whose calibrated pick is within 3% of the best on
    the minimum, the groups where the built-in profile picks the same configuration, the
    built-in's own picks within 3%, and the twins' widest gap; a run meets the targets only
    when every group does both."""
    from benchmarks.fit import pick_resolution

    def row(label, times, cal, default, size="M", world=4):
        return {**_row(label, times, cal, size, world), "predicted_default_s": default}

    good = [row("a", [1.00, 1.02], 1.0, 1.0), row("a (repeat)", [1.01, 1.03], 1.0, 1.0),
            row("b", [1.02, 1.03], 2.0, 2.0),
            row("a", [2.00, 2.00], 1.0, 2.0, world=8), row("b", [2.05, 2.10], 2.0, 1.0, world=8)]
    lines = pick_resolution.targets_table({"r1": good})
    assert "| r1 | 2 of 2 | 0.0% (M x 4) | 1 of 2 | 2 of 2 | 2.5% (M x 8) | 1.0% (M x 4) | no |" in lines
    slow = [row("a", [1.05, 1.06], 1.0, 1.0), row("b", [1.00, 1.00], 2.0, 2.0)]
    lines = pick_resolution.targets_table({"r1": good[:3], "r2": slow})
    assert "| r1 | 1 of 1 | 0.0% (M x 4) | 1 of 1 | 1 of 1 | 0.0% (M x 4) | 1.0% (M x 4) | yes |" in lines
    assert "| r2 | 0 of 1 | 5.0% (M x 4) | 1 of 1 | 0 of 1 | 5.0% (M x 4) | 0.0% (-) | no |" in lines
    assert lines[-1] == "runs meeting both pick targets: 1 of 2"
