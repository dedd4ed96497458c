"""The README's quick start runs as written: its Python snippet under `torchrun
--nproc_per_node 2` (the mesh it names, cpu:2), and its quick command lines that need no
cluster (`trace`, `price`). The search lines are the search benchmark's (tens of seconds)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]


def _blocks(kind: str) -> list[str]:
    """The README's fenced blocks of one kind ("python", or "" for plain), in order."""
    blocks, current, inside = [], [], None
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            if inside is None:
                inside, current = line[3:].strip(), []
            else:
                if inside == kind:
                    blocks.append("\n".join(current) + "\n")
                inside = None
        elif inside is not None:
            current.append(line)
    return blocks


def test_python_quick_start_runs_under_torchrun(tmp_path):
    (snippet,) = _blocks("python")[:1]
    script = tmp_path / "train.py"
    script.write_text(snippet)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "_c10d_functional" in proc.stdout or "placements" in proc.stdout, proc.stdout[-2000:]


def test_cli_quick_start_lines_without_a_cluster_run():
    lines = [line.split("#")[0].split() for block in _blocks("") for line in block.splitlines()
             if line.startswith("autopar trace") or line.startswith("autopar price")]
    assert lines, "the README's CLI quick start lost its trace/price lines"
    for argv in lines:
        proc = subprocess.run([sys.executable, "-m", "autopar.cli", *argv[1:]], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, (argv, proc.stderr[-2000:])
