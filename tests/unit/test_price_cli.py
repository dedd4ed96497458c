"""`autopar price`: bad flags exit 2 with a message; --json carries the DESIGN.md keys and
the communication by collective kind; a configuration that does not fit is priced and flagged."""

from __future__ import annotations

import json

import pytest

from autopar.cli import main

BASE = ["price", "gpt-tiny", "--cluster", "cpu:4", "--global-batch", "8"]


@pytest.mark.parametrize("extra,needle", [
    (["--tp", "3"], "does not divide"),                  # tp*pp does not divide 4 devices
    (["--tp", "2", "--dp", "3"], "devices"),             # dp*tp*pp != devices
    (["--cluster", "cpu:8", "--tp", "8"], "attention heads"),  # gpt-tiny has 4 heads
    (["--micro-batch", "3"], "not divisible"),           # 8 sequences, dp 4 * mb 3
    (["--interleave", "2"], "--pp > 1"),                 # interleaved needs pipelining
    (["--attention", "math"], "fused attention"),        # autopar runs (and prices) the fused kernel
    (["--plan", "p.json"], "drop MODEL, --cluster, --global-batch"),
])
def test_bad_flags_exit_2_with_a_message(capsys, extra, needle) -> None:
    assert main(BASE + extra) == 2
    err = capsys.readouterr().err
    assert "autopar price: error:" in err and needle in err


def test_json_has_the_contract_keys(capsys) -> None:
    assert main(BASE + ["--pp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("step_time_s", "tokens_per_s", "tokens_per_s_per_device", "model_tflops_per_device", "mfu",
                "peak_memory_bytes", "fits", "time_breakdown", "memory_breakdown", "config"):
        assert key in out
    cfg = out["config"]
    assert (cfg["tp"], cfg["pp"], cfg["dp"], cfg["zero"], cfg["micro_batch"]) == (1, 2, 2, 0, 1)
    assert (cfg["num_microbatches"], cfg["schedule"], cfg["interleave"], cfg["recompute"]) == (4, "1f1b", 1, "none")
    assert out["tokens_per_s"] == pytest.approx(8 * 32 / out["step_time_s"])
    assert sum(out["time_breakdown"].values()) == pytest.approx(out["step_time_s"])
    # the peak stage's memory by component: model state, activations in flight, temporaries
    assert set(out["memory_breakdown"]) == {"model_state_bytes", "activations_bytes", "temporaries_bytes"}
    assert sum(out["memory_breakdown"].values()) == pytest.approx(out["peak_memory_bytes"], abs=1)
    # communication by kind (solver/comm_time.py): the critical stage's inside its row, the sends the p2p row
    rows = out["communication"]
    assert {r["part_of"] for r in rows} == {"critical_stage_s", "p2p_s"}
    inside = sum(r["time_s"] for r in rows if r["part_of"] == "critical_stage_s")
    assert 0 < inside < out["time_breakdown"]["critical_stage_s"]
    assert [r["time_s"] for r in rows if r["part_of"] == "p2p_s"] == [out["time_breakdown"]["p2p_s"]]


def test_memory_breakdown_is_the_peak_by_component(capsys) -> None:
    """One stage: weights, gradients and optimizer state as the ILP charges them, and the
    activations live at the peak; under ZeRO-1 over dp4 in fp32 (the cpu profile's policy)
    the compute copy of each weight and its raw gradient stay whole (4 + 4 bytes an element),
    the master weight and AdamW's two moments are a quarter (1 + 2): weights 5, gradients 4,
    optimizer state 2 bytes an element, every weight of gpt-tiny dividing by 4."""
    assert main(BASE + ["--dp", "4", "--zero", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    mem = out["memory_breakdown"]
    assert set(mem) == {"weights_bytes", "gradients_bytes", "optimizer_state_bytes", "activations_bytes"}
    assert sum(mem.values()) == pytest.approx(out["peak_memory_bytes"], abs=1)
    assert mem["gradients_bytes"] == pytest.approx(0.8 * mem["weights_bytes"]) and mem["weights_bytes"] > 0
    assert mem["optimizer_state_bytes"] == pytest.approx(0.4 * mem["weights_bytes"])
    assert mem["activations_bytes"] > 0
    # ZeRO-1's collectives by kind over dp add up to the reshard row (solver/comm_time.py)
    rows = {(r["kind"], r["axis"]): r for r in out["communication"]}
    assert {("reduce_scatter", "dp"), ("all_gather", "dp")} <= set(rows)
    assert sum(r["time_s"] for r in rows.values()) == pytest.approx(out["time_breakdown"]["reshard_s"], rel=1e-12)


def test_config_that_does_not_fit_is_priced_and_flagged(capsys) -> None:
    assert main(BASE + ["--memory-gb", "0.0001", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["over_memory_bytes"] > 0 and out["step_time_s"] > 0

