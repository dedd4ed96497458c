"""The bad-input catalogue: every entry point refuses bad input with the exact error type (or
exit code 2 for the CLI) and a message that says what is wrong and what to try.

CLI cases run `autopar.cli.main([...])` in this process (it returns the exit code, or
argparse raises SystemExit(2) for a bad flag; both print `autopar CMD: error: ...`). One case (NaN loss) spawns a single rank; the
rest never start a process (the `no_ranks_started` fixture checks) or a process group.
More cases, refused in the launcher rather than in the ranks: test_bad_inputs_prespawn.py. Python API cases assert `type(exc) is X` (not a
subclass) and a key phrase of the message.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import autopar
from autopar import cli
from autopar.runtime import checkpoint
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.plan import Plan, PlanFileError
from autopar.runtime.program import NonFiniteLossError
from autopar.trace import TraceError

G = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16"
PRICE = ("price", G, "--cluster", "cpu:4", "--global-batch", "8")


# ---- user models (also factories for the CLI: `<this module>:<function>`) ----------------------------

class Logits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DictOut(Logits):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict:  # no `.loss`: not usable
        return {"out": self.net(x), "target": y}


class DataDependent(Logits):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.net(x).sum().item() > 0:  # a Python branch on a tensor value
            return self.net(x).pow(2).mean()
        return nn.functional.mse_loss(self.net(x)[:, :1], y)


def no_loss_model():
    return Logits(), (torch.randn(2, 4),)


def empty_model():
    return nn.Sequential(), (torch.randn(2, 4),)


def dict_output_model():
    return DictOut(), (torch.randn(2, 4), torch.randn(2, 1))


def _x():
    return (torch.randn(2, 4), torch.randn(2, 1))


# ---- plan files -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plan_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert cli.main(["search", G, "--cluster", "cpu:2", "--global-batch", "4", "--out", str(path)]) == 0
    return str(path)


# ---- CLI: (id, argv, key phrase of the message) -----------------------------------------------------

CLI_CASES = [
    ("unknown preset", ["price", "gpt9", "--cluster", "cpu:4", "--global-batch", "8"],
     "unknown model 'gpt9'; use a preset"),
    ("malformed cluster", ["price", G, "--cluster", "h100:16by8", "--global-batch", "8"],
     "expected HW:NODESxDEVICES such as 'h100:16x8'"),
    ("unknown hardware", ["price", G, "--cluster", "tpu:1x8", "--global-batch", "8"],
     "unknown hardware 'tpu'"),
    ("zero nodes", ["price", G, "--cluster", "h100:0x8", "--global-batch", "8"],
     "at least one node and one device per node, got 0 x 8"),
    ("zero global batch", ["price", G, "--cluster", "cpu:4", "--global-batch", "0"],
     "--global-batch: expected a positive integer, got 0"),
    ("negative global batch", ["price", G, "--cluster", "cpu:4", "--global-batch", "-8"],
     "expected a positive integer, got -8"),
    ("negative memory", [*PRICE, "--memory-gb", "-1"], "--memory-gb: expected a positive number"),
    ("zero devices", ["train", G, "--devices", "0"], "--devices: expected a positive integer, got 0"),
    ("batch not divisible by dp x microbatch", ["train", G, "--devices", "2", "--global-batch", "3"],
     "global batch 3 is not divisible by dp * micro-batch = 2 * 1 = 2"),
    ("tp*pp does not divide devices", [*PRICE, "--tp", "3"], "pick --tp/--pp whose product divides 4"),
    ("degrees do not multiply to devices", ["train", G, "--devices", "2", "--dp", "4"],
     "choose degrees whose product is 2"),
    ("more pipeline chunks than layers", ["train", G, "--devices", "4", "--pp", "4"],
     "lower --pp / --interleave so that pp * interleave <= 2"),
    ("interleaved without pp", ["train", G, "--devices", "2", "--schedule", "interleaved"],
     "add --pp 2 or more, or use --schedule 1f1b"),
    ("heads not dividing hidden", ["price", "gpt:layers=2,hidden=32,heads=3,vocab=64,seq=16", "--cluster",
                                   "cpu:2", "--global-batch", "8"], "pick heads that divide hidden"),
    ("spec missing keys", ["price", "gpt:layers=2,hidden=32,vocab=64", "--cluster", "cpu:2", "--global-batch", "8"],
     "is missing heads, seq"),
    ("spec non-number", ["trace", "gpt:layers=two,hidden=32,heads=2,vocab=64,seq=16"], "is not a valid number"),
    ("spec zero layers", ["trace", "gpt:layers=0,hidden=32,heads=2,vocab=64,seq=16"],
     "layers must be a positive integer, got 0"),
    ("factory module missing", ["trace", "nosuchmod:make"], "check the spelling and that its package is on PYTHONPATH"),
    ("factory function missing", ["trace", "os:nothing_here"], "name a function that returns (model, example_inputs)"),
    ("model without loss", ["trace", f"{__name__}:no_loss_model"], "not a scalar loss"),
    ("empty model", ["trace", f"{__name__}:empty_model"], "has no parameters: there is nothing to train"),
    ("non-tensor outputs", ["trace", f"{__name__}:dict_output_model"], "returned dict, not a scalar loss"),
    ("--save-every without a directory", ["train", G, "--devices", "2", "--save-every", "2"],
     "--save-every needs --checkpoint-dir D"),
    ("--resume without a directory", ["train", G, "--devices", "2", "--resume"], "--resume needs --checkpoint-dir"),
    ("--compile with price --plan", ["price", "--plan", "plan.json", "--compile"], "drop --compile"),
    ("missing plan file", ["explain", "/nonexistent/plan.json"], "write one with `autopar search ... --out"),
]


@pytest.mark.parametrize("argv, phrase", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input_exits_2_with_a_message(argv, phrase, capsys, no_ranks_started):
    assert _main(argv) == 2
    err = capsys.readouterr().err
    assert f"autopar {argv[0]}: error: " in err, err  # after argparse's usage lines for flag errors
    assert phrase in err, err


def _main(argv: list[str]) -> int:
    """cli.main's exit code; argparse reports bad flags by SystemExit(2) instead of returning."""
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return exc.code


def test_cli_memory_too_small_for_any_plan(capsys):
    assert cli.main(["search", G, "--cluster", "cpu:4", "--global-batch", "8", "--memory-gb", "0.000001"]) == 2
    err = capsys.readouterr().err
    assert "No plan fits" in err and "raise --memory-gb" in err


def test_cli_malformed_plan_file(tmp_path, capsys):
    bad = tmp_path / "plan.json"
    bad.write_text('{"version": 1, "model": ')
    assert cli.main(["explain", str(bad)]) == 2
    assert "plan is not valid JSON" in capsys.readouterr().err


def test_cli_plan_for_other_devices_or_model(plan_path, capsys):
    assert cli.main(["train", G, "--devices", "4", "--plan", plan_path]) == 2
    assert "was searched for 2 devices" in capsys.readouterr().err
    other = "gpt:layers=3,hidden=32,heads=2,vocab=64,seq=16"
    assert cli.main(["train", other, "--devices", "2", "--plan", plan_path]) == 2
    assert "was made for another model" in capsys.readouterr().err


def test_cli_compile_with_an_eager_plan(plan_path, capsys, no_ranks_started):
    """A plan searched for the eager program is not run compiled: it was priced eager."""
    assert cli.main(["train", G, "--devices", "2", "--plan", plan_path, "--compile"]) == 2
    assert "was searched and priced for the eager program" in capsys.readouterr().err


def test_cli_resume_past_the_last_step(tmp_path, capsys):
    """A complete checkpoint at step 4 (written by a real run elsewhere: here its metadata
    and DCP marker) and --steps 4: refused before any rank starts."""
    step = tmp_path / "step_000004"
    step.mkdir()
    (step / ".metadata").write_bytes(b"")
    (step / "autopar.json").write_text(json.dumps({
        "version": 1, "step": 4, "samples_seen": 16, "world_size": 2, "config": {}, "model": G,
        "model_fingerprint": "", "qkv_order": "canonical"}))
    assert cli.main(["train", G, "--devices", "2", "--steps", "4", "--checkpoint-dir", str(tmp_path),
                     "--resume"]) == 2
    assert "pass --steps greater than 4" in capsys.readouterr().err


def test_cli_nan_loss_stops_with_the_step(capsys):
    """lr 1e30 blows the weights up after one step: the run stops at step 2, names it, exit 2."""
    assert cli.main(["train", G, "--devices", "1", "--steps", "4", "--lr", "1e30"]) == 2
    err = capsys.readouterr().err
    assert "NonFiniteLossError: loss is nan at step 2" in err and "Lower the learning rate" in err


# ---- Python API: (id, call, exact error type, key phrase) ---------------------------------------------

def _trace(model, inputs, **kw):
    return autopar.trace(model, inputs, **kw)


def _decorated_non_module():
    return autopar.compile(mesh="cpu:4")(lambda: 3)()


API_CASES = [
    ("compile without mesh", lambda: autopar.compile(Logits()), ValueError, "give a mesh ('cpu:4'"),
    ("compile zero devices", lambda: autopar.compile(Logits(), 0), ValueError, "or a positive int, got 0"),
    ("compile bad cluster", lambda: autopar.compile(Logits(), "cpu:four"), ValueError, "malformed cluster"),
    ("compile 4 devices without a process group", lambda: autopar.compile(Logits(), "cpu:4"), ValueError,
     "process group"),
    ("decorated factory returns no module", _decorated_non_module, ValueError,
     "must return an nn.Module or (module, example_inputs)"),
    ("trace a non-module", lambda: _trace(lambda x: x, _x()), TraceError, "trace needs an nn.Module"),
    ("trace empty model", lambda: _trace(nn.Sequential(), _x()), TraceError, "has no parameters"),
    ("trace model without loss", lambda: _trace(Logits(), _x()[:1]), TraceError,
     "returned a tensor of shape (2, 3), not a scalar loss"),
    ("trace non-tensor outputs", lambda: _trace(DictOut(), _x()), TraceError, "returned dict, not a scalar loss"),
    ("trace unsupported data-dependent op", lambda: _trace(DataDependent(), _x()), TraceError,
     "data-dependent control flow"),
    ("config zero tp", lambda: ParallelConfig(tp=0), ValueError, "--tp must be a positive integer, got 0"),
    ("config negative dp", lambda: ParallelConfig(dp=-2), ValueError, "--dp must be a positive integer, got -2"),
    ("config zero stage 4", lambda: ParallelConfig(zero=4), ValueError, "--zero must be 0, 1, 2 or 3"),
    ("config heads not divisible", lambda: ParallelConfig(tp=3).check(global_batch=8, num_devices=3, heads=4),
     ValueError, "pick --tp from 1, 2, 4"),
    ("config batch not divisible", lambda: ParallelConfig(dp=4, micro_batch=2).num_microbatches(12), ValueError,
     "pick a global batch that is a multiple of 8"),
    ("cluster malformed", lambda: autopar.Cluster.parse("h100-16x8"), ValueError, "expected HW:NODESxDEVICES"),
    ("unknown preset", lambda: resolve("llama4-1t"), ValueError, "unknown model 'llama4-1t'"),
    ("plan not an object", lambda: Plan.loads("[1, 2]"), PlanFileError, "a plan must be a JSON object"),
    ("checkpoint half written", lambda: checkpoint.read_info("/nonexistent/step_000003.tmp"),
     checkpoint.CheckpointError, "is not a complete checkpoint"),
]


@pytest.mark.parametrize("call, error, phrase", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_api_bad_input_raises_with_a_message(call, error, phrase):
    with pytest.raises(Exception) as info:
        call()
    assert type(info.value) is error, repr(info.value)
    assert phrase in str(info.value), str(info.value)


def test_nan_loss_error_names_the_step():
    exc = NonFiniteLossError(7, float("nan"))
    assert isinstance(exc, ValueError) and exc.step == 7
    assert "loss is nan at step 7" in str(exc) and "Lower the learning rate" in str(exc)

