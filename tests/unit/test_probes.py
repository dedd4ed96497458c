"""The two probes of what a step's time is made of on this machine
(benchmarks/probes/probe_cpu_accounting.py, benchmarks/probes/probe_funcol_overhead.py,
benchmarks/probes/probe_collective_replay.py): how they reduce what the ranks timed and read the
programs' graphs, and that bad input is refused before any rank starts.

Pure functions on hand-made per-rank timings: no process starts.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest


from benchmarks.probes import (probe_collective_replay, probe_cpu_accounting, probe_funcol_overhead,
                               probe_loss_report, probe_program_choice)


def test_cpu_accounting_sets_the_ranks_core_work_against_the_median_wall():
    # two ranks on one core: a step whose ranks each burn 40 ms of CPU cannot end before 80 ms
    per_rank = [
        {"dp2": {"wall": [0.090, 0.080, 0.100], "thread": [0.030, 0.031, 0.029], "process": [0.040, 0.041, 0.039]}},
        {"dp2": {"wall": [0.085, 0.095, 0.120], "thread": [0.032, 0.030, 0.034], "process": [0.042, 0.044, 0.043]}},
    ]
    (row,) = probe_cpu_accounting.summarize(per_rank, cores=1)
    assert row["label"] == "dp2"
    assert row["wall_s"] == pytest.approx(0.080)  # the sweep's estimator: fastest round of any rank
    assert row["wall_median_s"] == pytest.approx((0.090 + 0.095) / 2)  # medians per rank, then over ranks
    assert row["thread_cpu_s"] == pytest.approx((0.030 + 0.032) / 2)
    assert row["process_cpu_s"] == pytest.approx((0.040 + 0.043) / 2)
    assert row["core_bound_s"] == pytest.approx(2 * 0.0415 / 1)
    assert row["core_bound_over_wall"] == pytest.approx(0.083 / 0.0925)


def _gm(*ops: str) -> SimpleNamespace:
    return SimpleNamespace(graph=SimpleNamespace(nodes=[SimpleNamespace(op=o) for o in ops]))


def test_graph_ops_count_what_the_rank_runs_per_step():
    from autopar.config import ParallelConfig

    # one stage: the step graph once per microbatch (16 / (2 x 2) = 4), the sync graph once
    one = SimpleNamespace(program=SimpleNamespace(graphs=SimpleNamespace(
        step=_gm("placeholder", "call_function", "call_function", "output"), grad_sync=_gm("call_function"))))
    assert probe_cpu_accounting.graph_ops_per_step(one, ParallelConfig(dp=2, micro_batch=2)) == 4 * 2 + 1
    no_sync = SimpleNamespace(program=SimpleNamespace(graphs=SimpleNamespace(
        step=_gm("call_function"), grad_sync=None)))
    assert probe_cpu_accounting.graph_ops_per_step(no_sync, ParallelConfig(dp=4, micro_batch=4)) == 1
    # a pipeline: its chunks' sources, one op per `torch.ops.` call, once per microbatch (16 / 4)
    source = "x = torch.ops.aten.mm.default(a, b)\ny = torch.ops.aten.view.default(x, [4])\nz = x[0]\n"
    piped = SimpleNamespace(program=None, code={"stage0": source, "stage2": source})
    assert probe_cpu_accounting.graph_ops_per_step(piped, ParallelConfig(pp=2, micro_batch=4)) == 4 * 4


def test_cpu_accounting_refuses_an_unknown_configuration_before_any_rank_starts(capsys):
    with pytest.raises(SystemExit) as exc:
        probe_cpu_accounting.main(["--size", "S", "--world", "4", "--only", "dp4 mb4,dp9"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "dp9" in err and "dp4 mb4" in err  # what was wrong and what the group has


def test_funcol_probe_sets_each_path_beside_calibrates_raw_timing():
    def rank(raw: float, graph: float, api: float) -> dict:
        return {("all_gather", 2, 4096, "raw"): raw, ("all_gather", 2, 4096, "graph"): graph,
                ("all_gather", 2, 4096, "funcol"): api}

    per_rank = [rank(0.2e-3, 0.4e-3, 1.0e-3), rank(0.4e-3, 0.5e-3, 1.2e-3), rank(0.3e-3, 0.9e-3, 1.1e-3)]
    (row,) = probe_funcol_overhead.summarize(per_rank)
    assert (row["kind"], row["ranks"], row["bytes"]) == ("all_gather", 2, 4096)
    assert row["raw_s"] == pytest.approx(0.3e-3)  # medians over ranks, path by path
    assert row["graph_s"] == pytest.approx(0.5e-3)
    assert row["funcol_s"] == pytest.approx(1.1e-3)


def test_funcol_probe_refuses_a_world_without_a_collective(capsys):
    with pytest.raises(SystemExit) as exc:
        probe_funcol_overhead.main(["--devices", "1"])
    assert exc.value.code == 2
    assert "at least 2" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--warmup", "-1"]])
def test_cpu_accounting_refuses_no_timed_rounds(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        probe_cpu_accounting.main(argv)
    assert exc.value.code == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err


def test_funcol_probe_refuses_no_windows(capsys):
    with pytest.raises(SystemExit) as exc:
        probe_funcol_overhead.main(["--windows", "0"])
    assert exc.value.code == 2
    assert "--windows must be at least 1" in capsys.readouterr().err


def _collective(op: str, val, group: str, *extra) -> SimpleNamespace:
    import torch

    target = getattr(torch.ops._c10d_functional, op).default
    return SimpleNamespace(op="call_function", target=target,
                           args=(SimpleNamespace(meta={"val": val}), *extra, group))


def test_replay_census_lists_the_step_graphs_collectives_per_microbatch_then_the_syncs():
    import torch

    x, grads = torch.empty(4, 8), torch.empty(1024)
    wait = SimpleNamespace(op="call_function", target=torch.ops._c10d_functional.wait_tensor.default,
                           args=(SimpleNamespace(meta={}),))
    step = SimpleNamespace(graph=SimpleNamespace(nodes=[
        SimpleNamespace(op="placeholder", target="x", args=()),
        _collective("all_gather_into_tensor", x, "tp", 2), wait,
        SimpleNamespace(op="call_function", target=torch.ops.aten.mm.default, args=()),
        _collective("reduce_scatter_tensor", x, "tp", "sum", 2), wait]))
    sync = SimpleNamespace(graph=SimpleNamespace(nodes=[_collective("all_reduce_", grads, "dp", "sum"), wait]))
    got = probe_collective_replay.census(step, sync, microbatches=3)
    assert [(c["kind"], c["group"]) for c in got] == [("all_gather", "tp"), ("reduce_scatter", "tp")] * 3 + [
        ("all_reduce", "dp")]
    assert got[0]["bytes"] == 4 * 8 * 4 and got[0]["shape"] == (4, 8) and got[-1]["bytes"] == 4096
    assert probe_collective_replay.census(step, None, microbatches=1)[-1]["kind"] == "reduce_scatter"


def test_replay_census_refuses_a_collective_it_cannot_replay():
    import torch

    odd = SimpleNamespace(graph=SimpleNamespace(nodes=[_collective("all_to_all_single", torch.empty(4), "tp")]))
    with pytest.raises(ValueError, match="all_to_all_single"):
        probe_collective_replay.census(odd, None, microbatches=1)


def test_replay_prices_collectives_at_calibrates_measured_points():
    points = [(1000, 1.0), (3000, 2.0), (5000, 4.0)]
    assert probe_collective_replay.interpolate(points, 500) == 1.0  # below: the smallest point
    assert probe_collective_replay.interpolate(points, 2000) == pytest.approx(1.5)
    assert probe_collective_replay.interpolate(points, 7000) == pytest.approx(6.0)  # above: the last line
    measured = [["all_gather", 2, 1000, 1.0], ["all_gather", 2, 3000, 2.0], ["all_reduce", 2, 1000, 0.5],
                ["all_reduce", 2, 3000, 0.7]]
    # an all-gather's census bytes are its input: 2 ranks x 1000 gathered = 2000 -> 1.5 s
    counts = [("all_gather", 2, 1000, 2), ("all_reduce", 2, 3000, 1)]
    assert probe_collective_replay.table_price(counts, measured) == pytest.approx(2 * 1.5 + 0.7)
    assert probe_collective_replay.table_price([("reduce_scatter", 2, 1000, 1)], measured) is None


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--only", "pp4"]])
def test_replay_probe_refuses_bad_input_before_any_rank_starts(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        probe_collective_replay.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--rounds must be at least 1" in err or ("pp4" in err and "dp4 mb4" in err)


def test_replay_cpu_is_the_median_over_rounds_then_ranks():
    def rank(*step_thread: float) -> dict:
        return {"times": {"dp4 z1": {"step_thread": list(step_thread)}}}

    per_rank = [rank(0.010, 0.030, 0.020), rank(0.040, 0.050, 0.045), rank(0.001, 0.002, 0.090)]
    # per rank 0.020, 0.045, 0.002 -> 0.020
    assert probe_collective_replay.cpu_median(per_rank, "dp4 z1", "step_thread") == pytest.approx(0.020)


def test_replay_probe_refuses_a_json_path_it_could_not_write_before_any_rank_starts(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        probe_collective_replay.main(["--json", str(tmp_path / "missing" / "out.json")])
    assert exc.value.code == 2
    assert "does not exist" in capsys.readouterr().err


def test_program_choice_probe_compares_two_solves_under_the_built_in_profile():
    """The probe's ILP side: the built-in profile against itself moves no node; against a
    profile whose collectives are 30x slower the solve moves nodes, and the built-in prices
    the other's placements no cheaper than its own optimum (its own solve is optimal there)."""
    from dataclasses import replace

    from autopar.cluster import HARDWARE
    from benchmarks.sweep_cpu import SIZES, cases

    hw = HARDWARE["cpu"]
    tp4 = next(c for c in cases(4) if c.label == "tp4")
    (same,) = probe_program_choice.ilp_prices(SIZES["S"], tp4, hw)
    assert same["moved"] == 0 and "other_s" not in same
    slow = replace(hw, intra_node_latency_s=hw.intra_node_latency_s * 30)
    (moved,) = probe_program_choice.ilp_prices(SIZES["S"], tp4, slow)
    assert moved["nodes"] == same["nodes"] and moved["moved"] > 0
    assert moved["built_in_s"] == pytest.approx(same["built_in_s"])
    assert moved["other_s"] >= moved["built_in_s"] * (1 - 1e-6)


def test_program_choice_probe_refuses_an_unreadable_profile_before_any_rank_starts(tmp_path, capsys):
    bad = tmp_path / "profile.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit) as exc:
        probe_program_choice.main(["--size", "S", "--world", "4", "--only", "tp4", "--other", str(bad)])
    assert exc.value.code == 2
    assert str(bad) in capsys.readouterr().err


def test_probe_microbatches_refuses_bad_configs_before_any_rank_starts(capsys, monkeypatch):
    """benchmarks/probes/probe_microbatches.py: a malformed entry, one that does not fill the world
    and one whose micro-batch does not divide the global batch each end with exit 2 and a
    message naming the entry; nothing is measured."""
    from benchmarks import sweep_cpu
    from benchmarks.probes import probe_microbatches

    monkeypatch.setattr(sweep_cpu, "measure", lambda *a, **k: pytest.fail("measured a refused configuration"))
    for bad, says in (("4:2", "dp:pp:micro_batch"), ("2:2:2", "dp x pp = 4"), ("4:2:3", "does not divide"),
                      ("4:0:1", "positive integers")):
        with pytest.raises(SystemExit) as err:
            probe_microbatches.main(["--world", "8", "--configs", f"2:4:2,{bad}"])
        assert err.value.code == 2
        msg = capsys.readouterr().err
        assert says in msg and repr(bad) in msg
    ap = __import__("argparse").ArgumentParser()
    got = probe_microbatches.parse_configs(ap, "2:4:1, 4:2:4", 8)
    assert [c.label for c in got] == ["dp2 pp4 mb1", "dp4 pp2 mb4"]
    assert [(c.config.dp, c.config.pp, c.config.micro_batch) for c in got] == [(2, 4, 1), (4, 2, 4)]


def test_loss_report_probe_sets_each_variant_against_the_usual_step_round_by_round():
    per_rank = [
        {"back_to_back": {1: 0.002, 1024: 0.019}, "steps": {"usual": [0.090, 0.080, 0.100], "skipped": [0.088, 0.081, 0.095],
                                                            "twice": [0.093, 0.084, 0.104], "four times": [0.1, 0.09, 0.11]}},
        {"back_to_back": {1: 0.004, 1024: 0.017}, "steps": {"usual": [9.0], "skipped": [9.0], "twice": [9.0],
                                                            "four times": [9.0]}},
    ]
    got = probe_loss_report.summarize(per_rank)
    assert got["back_to_back_s"] == {1: pytest.approx(0.003), 1024: pytest.approx(0.018)}
    skipped = got["in_place"]["skipped"]  # rank 0's rounds: every rank's step ends on one barrier
    assert skipped["min_s"] == pytest.approx(0.081) and skipped["median_s"] == pytest.approx(0.088)
    assert skipped["minus_usual_s"] == pytest.approx(-0.002)  # median of (-2, +1, -5) ms
    assert got["in_place"]["twice"]["minus_usual_s"] == pytest.approx(0.004)
    assert got["in_place"]["usual"]["minus_usual_s"] == 0.0


@pytest.mark.parametrize("argv", [["--devices", "3"], ["--devices", "1"], ["--rounds", "0"], ["--size", "XL"]])
def test_loss_report_probe_refuses_bad_input_before_any_rank_starts(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        probe_loss_report.main(argv)
    assert exc.value.code == 2
    assert "--" in capsys.readouterr().err
