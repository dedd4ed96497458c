"""`make bench` (benchmarks/run_all.py) regenerates every table and plot in
benchmarks/results/: each file there is one a phase of run_all writes, named in
its docstring (the list a reader checks), or a row file a lent GPU measured that a phase
reads. Measurements nothing re-makes do not belong in the tree: their finding goes into the
code or the docs, the run itself into a commit message."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
GPU_ROWS = re.compile(r"gpu_h100_run\d+\.jsonl")
"""Input rows (benchmarks/gpu_check.sh on a lent H100); run_all re-prices them into gpu_h100.md."""


def _named_outputs() -> set[str]:
    """Result file names run_all's docstring gives, brace groups expanded:
    `results/sweep_cpu.{md,json}` -> sweep_cpu.md, sweep_cpu.json; `results/*.png` is the
    plots script's list."""
    import ast

    doc = ast.get_docstring(ast.parse((ROOT / "benchmarks" / "run_all.py").read_text()))
    doc = re.sub(r"\s*\n\s*", " ", doc)
    names: set[str] = set()
    for stem, exts in re.findall(r"results/(\w+)\.\{([\w,]+)\}", doc):
        names.update(f"{stem}.{e}" for e in exts.split(","))
    for stem, parts, ext in re.findall(r"results/(\w+)_\{([\w,]+)\}\.(\w+)", doc):
        names.update(f"{stem}_{p}.{ext}" for p in parts.split(","))
    names.update(re.findall(r"results/(\w+\.(?:md|json|png))\b", doc))
    if "results/*.png" in doc:
        plots = (ROOT / "benchmarks" / "plots_results.py").read_text()
        names.update(re.findall(r'RESULTS / "(\w+\.png)"', plots))
    return names


def test_run_all_names_every_results_file():
    named = _named_outputs()
    present = sorted(p.name for p in RESULTS.iterdir() if p.is_file())
    assert present, f"no files under {RESULTS}"
    unnamed = [n for n in present if n not in named and not GPU_ROWS.fullmatch(n)]
    assert not unnamed, (f"benchmarks/results/ holds files benchmarks/run_all.py does not regenerate: {unnamed}; "
                         "add the phase that writes them to run_all (and its docstring), or remove them and "
                         "put what they found in the docs")


@pytest.mark.parametrize("name", ["sweep_cpu.json", "cost_model_validation.md", "op_coverage.md", "gpu_h100.md",
                                  "search_plans_run.md", "validation_scatter.png", "explain_plan.png"])
def test_the_reader_parses_brace_and_plot_forms(name):
    assert name in _named_outputs()
