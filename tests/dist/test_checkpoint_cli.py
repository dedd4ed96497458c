"""`autopar train --checkpoint-dir D --save-every K --resume`, end to end through the CLI.

Run 1 trains steps 1-4 under DP2 and saves at steps 2 and 4; run 2 resumes under TP2 (a
different plan: GPT's qkv rows regrouped, parameters DTensors) and trains steps 5-6. The
oracle is the single-process reference of all six steps (`--check` on run 2): run 2's
losses must equal its steps 5-6, i.e. the resumed job continues exactly where an uninterrupted one is.
"""

from __future__ import annotations

import json
import shutil

import pytest

from autopar import cli
from autopar.runtime import checkpoint

pytestmark = [pytest.mark.dist, pytest.mark.alone]

MODEL = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16"


def _train(capsys, *flags: str) -> tuple[int, dict, str]:
    code = cli.main(["train", MODEL, "--devices", "2", "--global-batch", "4", "--json", *flags])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if captured.out.strip() else {}, captured.err


def test_train_resume_on_another_plan(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    code, first, _ = _train(capsys, "--steps", "4", "--checkpoint-dir", ckpt, "--save-every", "2")
    assert code == 0 and first["first_step"] == 1 and len(first["losses"]) == 4
    # each phase's peak memory growth per rank: the build holds the weights before
    # sharding, every later phase at least the program's state
    phases = first["memory_phases_bytes"]
    assert list(phases) == ["build", "first_step", "later_steps"] and all(v > 0 for v in phases.values()), phases
    assert checkpoint.latest(ckpt).step == 4
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step_000002", "step_000004"]
    _damaged_checkpoints_are_refused(tmp_path, capsys, ckpt)

    code, resumed, _ = _train(capsys, "--steps", "6", "--tp", "2", "--checkpoint-dir", ckpt, "--save-every", "2",
                           "--resume", "--check")
    assert code == 0, resumed
    assert resumed["first_step"] == 5 and len(resumed["losses"]) == 2
    assert resumed["config"]["tp"] == 2 and resumed["match"], resumed
    assert resumed["max_rel_loss_diff"] < 1e-4
    assert checkpoint.latest(ckpt).step == 6 and checkpoint.latest(ckpt).config["tp"] == 2

    # nothing left to train: refused before any rank starts
    code, _, err = _train(capsys, "--steps", "6", "--checkpoint-dir", ckpt, "--resume")
    assert code == 2 and "is at step 6" in err and "pass --steps greater than 6" in err


def _damaged_checkpoints_are_refused(tmp_path, capsys, ckpt: str) -> None:
    """A truncated shard or `.metadata` in the newest checkpoint: exit 2 before any rank
    starts, naming the file and the step, and pointing at the previous complete step."""
    for name, damage in ((".distcp", lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])),
                         (".metadata", lambda f: f.write_bytes(f.read_bytes()[:40]))):
        copy = tmp_path / f"damaged{name}"
        shutil.copytree(ckpt, copy)
        victim = sorted(p for p in (copy / "step_000004").iterdir() if p.name.endswith(name))[0]
        damage(victim)
        code, _, err = _train(capsys, "--steps", "6", "--checkpoint-dir", str(copy), "--resume")
        assert code == 2, err
        assert "checkpoint step 4 is damaged" in err and str(victim) in err, err
        assert "previous complete checkpoint is step 2" in err, err
        assert ("truncated" in err) if name == ".distcp" else ("cannot be read" in err), err
        assert "Traceback" not in err, err


def test_resume_without_a_checkpoint(tmp_path, capsys):
    """--resume with a missing or empty directory is an error (exit 2, no rank started);
    --resume-if-exists trains from step 1 there."""
    for where in (tmp_path / "missing", tmp_path):
        code, _, err = _train(capsys, "--steps", "2", "--checkpoint-dir", str(where), "--resume")
        assert code == 2 and "nothing to resume from" in err and "--resume-if-exists" in err, err
    code, out, err = _train(capsys, "--steps", "2", "--checkpoint-dir", str(tmp_path / "fresh"), "--save-every", "2",
                            "--resume-if-exists")
    assert code == 0 and out["first_step"] == 1 and len(out["losses"]) == 2, err
    assert checkpoint.latest(tmp_path / "fresh").step == 2


def test_buffers_updated_in_forward_are_saved_and_resumed(tmp_path, capsys):
    """BatchNorm's running statistics and batch count are part of the checkpoint: a run
    resumed after step 2 of 4 ends with the batch count of 4 uninterrupted steps (two
    microbatches each: 8), where a resume that lost the buffers would count 4."""
    import torch
    import torch.distributed.checkpoint as dcp

    model = "tests.factories:batchnorm_cnn"
    flags = ["--devices", "2", "--tp", "2", "--micro-batch", "4", "--checkpoint-dir", str(tmp_path), "--json"]
    assert cli.main(["train", model, "--steps", "2", "--save-every", "2", *flags]) == 0
    capsys.readouterr()
    assert cli.main(["train", model, "--steps", "4", "--save-every", "2", "--resume", "--check", *flags]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["first_step"] == 3 and out["match"], out
    last = checkpoint.latest(tmp_path)
    stored = dcp.FileSystemReader(last.path).read_metadata().state_dict_metadata
    assert {"buffer/bn.running_mean", "buffer/bn.running_var", "buffer/bn.num_batches_tracked"} <= set(stored)
    count = torch.zeros((), dtype=torch.long)
    dcp.load({"buffer/bn.num_batches_tracked": count}, checkpoint_id=last.path, no_dist=True)
    assert int(count) == 8


def test_step_lines_appear_as_the_steps_finish(tmp_path):
    """`autopar train` (no --json) prints each step's line from rank 0 when the step ends:
    the line of step 1 is read while the run is still training (its step-5 checkpoint is
    not written yet), where printing them all at the end would find every checkpoint on
    disk."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "autopar.cli", "train", MODEL, "--devices", "2", "--global-batch", "4",
           "--steps", "5", "--checkpoint-dir", str(tmp_path), "--save-every", "1"]
    with subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        early = None
        for line in proc.stdout:
            if line.startswith("step 1:"):
                early = not (tmp_path / "step_000005").exists()
                break
        rest, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert early is True, "step 1's line arrived after the last step"
    assert sum(line.startswith("step ") for line in rest.splitlines()) == 4 and "throughput" in rest, rest
    assert "memory per rank, peak growth by phase: build " in rest and "later steps" in rest, rest


_WARN_SCRIPT = """
import logging, warnings
from autopar.runtime.launch import spawn

def warn(rank):
    warnings.warn("one library warning")
    logging.getLogger("some.library").warning("one logged warning")
    logging.getLogger("some.library").error("an error on rank %d", rank)
    return rank

if __name__ == "__main__":
    assert spawn(warn, 2) == [0, 1]
"""


def test_library_warnings_print_once(tmp_path):
    """Every rank runs the same code: a library's warning is printed by rank 0 alone, errors by
    every rank. (In a fresh process: spawned ranks write to the stderr of the forkserver,
    which pytest's per-test capture does not follow.)"""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "warn.py"
    script.write_text(_WARN_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=300)
    err = proc.stderr
    assert proc.returncode == 0, err
    assert err.count("UserWarning: one library warning") == 1 and err.count("one logged warning") == 1, err
    assert "an error on rank 0" in err and "an error on rank 1" in err, err
