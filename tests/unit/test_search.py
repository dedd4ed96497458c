"""The product's search from the CLI and the API (solver/pipeline_search.py): infeasible
requests exit 2 with the smallest need, pipeline-degree bounds, the JSON contract with
explain, and byte-identical plans across processes. The template grid baseline is tested in
test_template_search.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from autopar.cli import main
from autopar.models import resolve
from autopar.plan import Plan


def test_cli_infeasible_exits_2_with_message(capsys) -> None:
    code = main(["search", "gpt-tiny", "--cluster", "cpu:2", "--global-batch", "2", "--memory-gb", "0.00001",
                 "--json"])
    err = capsys.readouterr().err
    assert code == 2
    assert "No plan fits" in err and "the smallest needs" in err


def test_cli_pipeline_degree_bounds(capsys) -> None:
    """--max-pp 1 ranks one-stage plans only; a --max-pp below --min-pp is refused (exit 2)."""
    assert main(["search", "gpt-tiny", "--cluster", "cpu:2", "--global-batch", "4", "--max-pp", "1", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and all(p["config"]["pp"] == 1 for p in plans)
    assert main(["search", "gpt-tiny", "--cluster", "cpu:2", "--global-batch", "4", "--min-pp", "2",
                 "--max-pp", "1"]) == 2
    err = capsys.readouterr().err
    assert "--max-pp 1 is below --min-pp 2" in err


def test_cli_search_json_and_explain(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    code = main(["search", "llama-small", "--cluster", "h100:1x4", "--global-batch", "8", "--json", "--top", "3",
                 "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0
    data = json.loads(captured.out)
    assert set(data) == {"plans", "search_time_s", "phases"}
    assert 1 <= len(data["plans"]) <= 3
    keys = {"step_time_s", "tokens_per_s", "tokens_per_s_per_device", "model_tflops_per_device", "mfu",
            "peak_memory_bytes", "fits", "time_breakdown", "memory_breakdown", "config"}
    for p in data["plans"]:
        assert keys <= set(p)
        assert {"tp", "pp", "dp", "zero", "micro_batch", "num_microbatches", "schedule", "interleave",
                "recompute"} <= set(p["config"])
    times = [p["step_time_s"] for p in data["plans"]]
    assert times == sorted(times)
    assert {"fingerprint", "solve"} <= set(data["phases"])
    plan = Plan.load(out)
    assert plan.predicted.step_time_s == times[0]
    assert plan.model_fingerprint == __import__("autopar.plan").plan.fingerprint_source(resolve("llama-small"))
    assert main(["explain", str(out)]) == 0
    text = capsys.readouterr().out
    assert "one stage" in text and "per-op placements (the program that runs)" in text and "coverage" in text
    assert plan.placements and plan.intra_op_info is not None


_DETERMINISM_SCRIPT = """
import sys
from autopar.api import search_plans
r = search_plans("llama-tiny", "a100-80gb:2x2", global_batch=4, memory_gb=1.0)
sys.stdout.write(r.plan.dumps())
"""


def test_plan_json_is_byte_identical_across_processes() -> None:
    """Golden-style: a fresh process with another hash seed writes the same bytes as this one."""
    from autopar.api import search_plans

    here = search_plans("llama-tiny", "a100-80gb:2x2", global_batch=4, memory_gb=1.0).plan.dumps()
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    proc = subprocess.run([sys.executable, "-c", _DETERMINISM_SCRIPT], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == here
    assert Plan.loads(here).dumps() == here
