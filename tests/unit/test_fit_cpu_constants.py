"""benchmarks/fit/fit_cpu_constants.py: how a value is chosen from priced runs, what the
committed fit holds, and its errors on bad input (exit 2). No pricing runs here (a full
fit takes ~30 min; `make bench --full` runs it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import autopar  # noqa: F401  (autopar before cost_model: import order)
from autopar.cluster import HARDWARE
from benchmarks.fit import fit_cpu_constants as fit

ROOT = Path(__file__).resolve().parents[2]


def _figures(spearman: list[float], error: float) -> dict:
    return {"groups": {f"g{i}": {"spearman": s, "pick_regret": 0.0} for i, s in enumerate(spearman)},
            "median_abs_error": error}


def test_choose_takes_the_best_mean_spearman_and_breaks_ties_by_error() -> None:
    table = {"a": {"1.000000": _figures([0.90, 0.90], 0.05), "0.500000": _figures([0.95, 0.93], 0.09),
                   "0.250000": _figures([0.95, 0.93], 0.07)},
             "b": {"1.000000": _figures([0.92, 0.90], 0.05), "0.500000": _figures([0.96, 0.94], 0.08),
                   "0.250000": _figures([0.96, 0.94], 0.06)}}
    assert fit.score(table, ["a"], "1.000000") == pytest.approx((0.90, -0.05))
    # 0.5 and 0.25 tie on Spearman over both runs: the smaller median error wins
    assert fit.choose(table, ["a", "b"]) == "0.250000"
    # a run alone is scored on its own figures
    table["a"]["1.000000"] = _figures([0.99, 0.99], 0.05)
    assert fit.choose(table, ["a"]) == "1.000000"
    assert fit.choose(table, ["b"]) == "0.250000"


def test_the_score_counts_the_per_size_pooled_spearman_beside_the_groups() -> None:
    """The sweep's ranking target is per model size (4 and 8 processes ranked together): a value that
    orders each group alike but the pooled sizes better scores higher."""
    grouped = _figures([0.95, 0.95], 0.05)
    table = {"a": {"1.000000": {**grouped, "sizes": {"S": 0.85}}, "0.500000": {**grouped, "sizes": {"S": 0.95}}}}
    assert fit.score(table, ["a"], "1.000000") == pytest.approx(((0.95 + 0.95 + 0.85) / 3, -0.05))
    assert fit.choose(table, ["a"]) == "0.500000"


def test_every_constant_has_a_grid_that_holds_its_neutral_value_and_the_built_in_value() -> None:
    shipped = dict(HARDWARE["cpu"].efficiency)
    assert set(fit.GRIDS) == set(fit.NEUTRAL)
    for name, grid in fit.GRIDS.items():
        assert fit.NEUTRAL[name] in grid
        assert shipped[name] in grid, f"the built-in {name} = {shipped[name]} is not a value the fit tries"


def test_the_committed_fit_is_the_built_in_profile() -> None:
    """results/fit_cpu_constants.json chose exactly what autopar/cpu_profile.json ships, on
    the measurements it ships (a re-measured built-in profile needs the fit run again), and
    every run of the fit was priced at every value of the grid."""
    result = json.loads((ROOT / "benchmarks" / "results" / "fit_cpu_constants.json").read_text())
    shipped = dict(HARDWARE["cpu"].efficiency)
    assert result["chosen"] == {name: shipped[name] for name in fit.GRIDS}
    for name, one in result["constants"].items():
        assert one.get("profile") == fit.profile_digest(), (
            f"{name} was fitted on other built-in measurements: run benchmarks/fit/fit_cpu_constants.py --write")
        assert set(one["table"]) == set(fit.RUNS)
        for run in fit.RUNS:
            assert set(one["table"][run]) == {fit._tag(v) for v in fit.GRIDS[name]}
        assert fit._tag(one["chosen"]) == fit.choose(one["table"], list(fit.RUNS))


@pytest.mark.parametrize("content", ["{}", "not json", '{"constants": {"x": 1}}'])
def test_reuse_of_a_file_that_is_not_its_output_exits_2(tmp_path, capsys, content: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(SystemExit) as exc:
        fit.main(["--reuse", str(bad), "--json", str(tmp_path / "o.json"), "--md", str(tmp_path / "o.md")])
    assert exc.value.code == 2
    assert "not an output of this script" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def test_missing_recorded_sweeps_exit_2(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(fit, "SWEEPS", tmp_path)
    with pytest.raises(SystemExit) as exc:
        fit.main(["--json", str(tmp_path / "o.json"), "--md", str(tmp_path / "o.md")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "recorded sweeps" in err and fit.RUNS[0] in err and "restore them from git" in err


def test_a_candidate_share_law_keeps_the_measured_rank_count_priced_as_measured() -> None:
    """Each candidate is priced on the built-in profile derived again from its kept
    measurements: unchanged with no candidate; a share-law exponent g re-normalises the
    latencies, so 4 ranks (as calibrated, 2 per core) keep their price and 8 ranks pay
    2 ** (g - 1) of the linear law's latency; the digest does not see the candidates."""
    from autopar.cluster import Cluster
    from cost_model.collectives import mesh_axis_links

    hw = HARDWARE["cpu"]
    assert fit.with_values(hw, {}) == hw

    def latency(h, n: int) -> float:
        return mesh_axis_links(Cluster.parse(f"cpu:{n}", hardware=h), (n,))[0].latency_s

    linear = fit.with_values(hw, {fit.LATENCY: 1.0})
    for g in (0.9, 0.6):
        cand = fit.with_values(hw, {fit.LATENCY: g})
        assert dict(cand.efficiency)[fit.LATENCY] == g
        assert latency(cand, 4) == pytest.approx(latency(linear, 4), rel=1e-12)
        assert latency(cand, 8) == pytest.approx(latency(linear, 8) * 2 ** (g - 1), rel=1e-12)
        assert cand.intra_node_bandwidth_bytes_per_s == linear.intra_node_bandwidth_bytes_per_s
    digest = fit.profile_digest()
    assert len(digest) == 16 and digest == fit.profile_digest()
