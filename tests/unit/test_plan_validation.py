"""Plan files are validated on load, end to end: a plan written by `autopar search --out`,
then damaged the ways files get damaged (another version, another model, another device
count, edited numbers, a pickle in its place). Every case is refused with PlanFileError (or
exit 2 from the CLI) and a message saying what to do; nothing is ever unpickled or run.
"""

from __future__ import annotations

import json
import os
import pickle

import pytest

from autopar import cli
from autopar.models import resolve
from autopar.plan import Plan, PlanFileError, fingerprint_source

G = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16"


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert cli.main(["search", G, "--cluster", "cpu:2", "--global-batch", "4", "--out", str(path)]) == 0
    return str(path)


def _write(tmp_path, data) -> str:
    out = tmp_path / "tampered.json"
    out.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(out)


def _tampered(plan_path: str, tmp_path, change) -> str:
    data = json.loads(open(plan_path).read())
    change(data)
    return _write(tmp_path, data)


def test_searched_plan_loads_and_matches_its_model(plan_path):
    plan = Plan.load(plan_path)
    assert plan.version == 6 and plan.config.num_devices == 2 and plan.chunk_placements(0)
    plan.check_model(fingerprint_source(resolve(G)))  # the model it was searched for: accepted


def test_wrong_version(plan_path, tmp_path, capsys):
    path = _tampered(plan_path, tmp_path, lambda d: d.update(version=99))
    with pytest.raises(PlanFileError,
                       match=r"plan version 99 is not supported; this autopar reads version 6 \(and versions 2, 3, 4 and 5\)"):
        Plan.load(path)
    assert cli.main(["explain", path]) == 2
    assert "Re-run `autopar search`" in capsys.readouterr().err


def test_wrong_model_fingerprint(plan_path, capsys):
    other = "gpt:layers=2,hidden=64,heads=2,vocab=64,seq=16"
    with pytest.raises(PlanFileError, match="Re-run `autopar search` for this model"):
        Plan.load(plan_path).check_model(fingerprint_source(resolve(other)))
    assert cli.main(["train", other, "--devices", "2", "--plan", plan_path]) == 2
    assert "was made for another model" in capsys.readouterr().err


def test_mesh_does_not_match_the_devices(plan_path, capsys):
    assert cli.main(["train", G, "--devices", "4", "--plan", plan_path]) == 2
    err = capsys.readouterr().err
    assert "was searched for 2 devices" in err and "run with --devices 2" in err


def test_config_flags_with_a_plan_are_refused(plan_path, capsys):
    assert cli.main(["train", G, "--devices", "2", "--plan", plan_path, "--tp", "2"]) == 2
    assert "drop the configuration flags --tp" in capsys.readouterr().err


@pytest.mark.parametrize("change, phrase", [
    (lambda d: d["config"].update(dp=d["config"]["dp"] * 2), "devices but its cluster"),
    (lambda d: d.update(mesh_shape=[9, 9, 9]), "disagrees with its config"),
    (lambda d: d.update(num_layers=d["num_layers"] + 1), "but the model has 3 layers"),
    (lambda d: d.update(global_batch=3), "is not a multiple of dp * micro_batch"),
    (lambda d: d.update(seq=-16), "memory_limit_bytes and seq must be positive"),
    (lambda d: d.update(model_fingerprint="sha256:not-a-digest"), "is not a (sha256) hex digest"),
    (lambda d: d["config"].update(zero=7), "--zero must be 0, 1, 2 or 3"),
    (lambda d: d["config"].update(tp="2"), "--tp must be a positive integer, got '2'"),
    (lambda d: d.update(stage_layers=["one"]), "malformed value"),
    (lambda d: d.pop("config"), "missing keys ['config']"),
], ids=["devices", "mesh_shape", "num_layers", "global_batch", "seq", "fingerprint", "zero", "tp-type",
        "stage_layers-type", "missing-key"])
def test_tampered_numbers(plan_path, tmp_path, change, phrase):
    with pytest.raises(PlanFileError) as info:
        Plan.load(_tampered(plan_path, tmp_path, change))
    assert phrase in str(info.value), str(info.value)


def test_nan_and_infinity_are_refused(plan_path, tmp_path):
    text = open(plan_path).read()
    data = json.loads(text)
    step_time = json.dumps(data["predicted"]["step_time_s"])
    damaged = text.replace(f'"step_time_s": {step_time}', '"step_time_s": NaN', 1)
    assert damaged != text
    with pytest.raises(PlanFileError, match="contains NaN"):
        Plan.load(_write(tmp_path, damaged))


class _Payload:
    """Unpickling this would create a file: proves a plan is never unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_is_never_unpickled(tmp_path, capsys):
    marker = tmp_path / "executed"
    path = tmp_path / "plan.json"
    path.write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(PlanFileError, match="never pickles"):
        Plan.load(path)
    assert cli.main(["explain", str(path)]) == 2
    assert "is not a plan" in capsys.readouterr().err
    assert not os.path.exists(marker)


def test_python_source_is_not_executed(tmp_path):
    marker = tmp_path / "executed"
    path = _write(tmp_path, f"__import__('pathlib').Path({str(marker)!r}).touch()")
    with pytest.raises(PlanFileError, match="not valid JSON"):
        Plan.load(path)
    assert not marker.exists()
