"""The README's Python quick start runs as written, under `torchrun --nproc_per_node 2`
(the mesh it names, cpu:2). (Its command lines are the CLI's, which tests/unit and the
search benchmark run.)"""

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
