"""The bad-input catalogue, continued: what used to fail inside the ranks now fails in the
launcher, once, before any rank starts (autopar/preflight.py, autopar/commands/train.py).

Each case runs `autopar train` in this process with process starts instrumented
(`no_ranks_started`, tests/conftest.py): the CLI must exit 2 with the message alone (no
`rank 0 failed:`), having started no worker process and no process group.
"""

from __future__ import annotations

import json

import pytest

from autopar import cli

G = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16"
MLP = "tests.factories:mlp"


def _plan(tmp_path, model: str, *flags: str, edit=None) -> str:
    path = tmp_path / "plan.json"
    assert cli.main(["search", model, "--cluster", "cpu:2", "--global-batch", "8", "--out", str(path), *flags]) == 0
    if edit is not None:
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))
    return str(path)


def _renamed_op(data: dict) -> None:
    """A per-op plan edited so one node's op is not the model's (same fingerprint)."""
    data["placements"][0]["placements"][-1][1] = "aten.weird_op.default"  # chunk 0's [key, op, outputs, inputs]


def _as_uneven_pp2(data: dict) -> None:
    """A pp2 plan whose cut (2 + 1 layers) does not fit the 2-layer model it names (its
    chunks' placements not recorded, so the cut is what is checked)."""
    data["config"].update(pp=2, dp=1, tp=1, zero=0)
    data.update(mesh_shape=[2, 1, 1], num_layers=3, stage_layers=[2, 1], stages=[], placements=[])


CASES = [
    ("pp for a model without a repeated layer stack", lambda tmp: ["train", MLP, "--devices", "2", "--pp", "2"],
     "--pp 2 needs a model with a repeated layer stack"),
    ("zero-bubble schedule (not run by per-op pipeline stages)",
     lambda tmp: ["train", "tests.hf_factories:gpt2", "--devices", "4", "--pp", "2", "--schedule", "zb"],
     "--schedule zb is not run by per-op pipeline stages"),
    ("unfused attention, which the program does not run", lambda tmp: ["train", G, "--devices", "2",
                                                                       "--attention", "math"], "fused attention"),
    ("devices not divisible by tp", lambda tmp: ["train", G, "--devices", "3", "--tp", "2"],
     "--devices 3 is not divisible by tp * pp = 2"),
    ("plan whose per-op placements do not match the model",
     lambda tmp: ["train", MLP, "--devices", "2", "--plan", _plan(tmp, MLP, edit=_renamed_op)],
     "does not match this model's traced step"),
    ("plan for another global batch", lambda tmp: ["train", MLP, "--devices", "2", "--plan",
                                                   _plan(tmp, MLP, edit=lambda d: d.update(global_batch=16))],
     "was searched for a global batch of 16 but factory 'tests.factories:mlp' gives batches of 8"),
    ("plan cut that does not fit the model",
     lambda tmp: ["train", G, "--devices", "2", "--plan", _plan(tmp, G, edit=_as_uneven_pp2)],
     "plan stage_layers (2, 1) do not fit 2 pipeline chunks of a 2-layer model"),
    ("check with a random op it cannot make deterministic",
     lambda tmp: ["train", "tests.factories:shuffled_features", "--devices", "2", "--check"],
     "draws random numbers with aten.randperm.default, which the check cannot make deterministic"),
    ("a forward that returns a vector, not a scalar loss (under --check: no notice about random ops)",
     lambda tmp: ["train", "tests.factories:vector_loss", "--devices", "2", "--dp", "2", "--check"],
     "VectorLoss.forward returned a tensor of shape (2,), not a scalar loss"),
    ("a forced configuration no placement obeys",
     lambda tmp: ["train", "tests.factories:small_lstm", "--devices", "4", "--tp", "2", "--dp", "2"],
     "the configuration dp=2 tp=2 (given by --tp --dp) cannot run tests.factories:small_lstm: SmallLSTM has no plan "
     "on mesh (2, 2) with its batch split over axis 0"),
    ("an expert-parallel degree that is not the data-parallel one",
     lambda tmp: ["train", "moe-tiny", "--devices", "4", "--dp", "4", "--ep", "2"],
     "--ep 2: expert parallelism runs over the whole data-parallel axis, so --ep must be 1 or equal --dp (4)"),
    ("an expert-parallel degree for a model without experts",
     lambda tmp: ["train", G, "--devices", "2", "--dp", "2", "--ep", "2"],
     "--ep 2: GPT has no routed experts to split"),
    ("an expert-parallel degree that does not divide the experts",
     lambda tmp: ["train", "moe:layers=1,hidden=32,heads=2,kv_heads=2,vocab=64,seq=16,experts=3,top_k=1,expert_ffn=32",
                  "--devices", "2", "--dp", "2", "--ep", "2"],
     "do not split 2 ways; use a --dp and --ep that divide 3"),
    ("the default configuration (dp over every device) for a model BatchNorm keeps whole",
     lambda tmp: ["train", "tests.factories:batchnorm_cnn", "--devices", "4"],
     "(the default for --devices 4: data parallel over every device) cannot run"),
]


@pytest.mark.parametrize("argv, phrase", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_before_any_rank_starts(argv, phrase, tmp_path, capsys, no_ranks_started):
    args = argv(tmp_path)
    capsys.readouterr()
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    # (Hugging Face factories log config warnings of their own while the model is built)
    err = "".join(line for line in err.splitlines(keepends=True) if not line.startswith("[transformers]"))
    assert err.startswith("autopar train: error: ") and phrase in err, err
    assert "rank" not in err.split(": error: ", 1)[1][:20], err  # the message alone, not a rank's report
    assert "could not trace" not in err and "Traceback" not in err, err


def test_the_instrumentation_sees_a_rank_start(no_ranks_started):
    """The fixture is a real measurement: a spawn under it is seen (and stopped)."""
    from autopar.runtime.launch import spawn

    with pytest.raises(AssertionError, match="was started: bad input must be refused before any rank starts"):
        spawn(print, 2)
    assert len(no_ranks_started) == 1
    no_ranks_started.clear()  # seen; let the fixture's own check pass
