"""Plan files: JSON round trip, validation with clear errors, fingerprints, explain."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from autopar.config import ParallelConfig
from autopar.estimate import Estimate
from autopar.models import resolve
from autopar.plan import (
    PLAN_VERSION,
    Alternative,
    Plan,
    PlanFileError,
    SearchInfo,
    StageInfo,
    fingerprint_source,
    model_fingerprint,
)


def _plan(**overrides) -> Plan:
    cfg = ParallelConfig(tp=2, pp=2, dp=2, zero=1, micro_batch=2, schedule="1f1b", recompute="selective")
    values = dict(
        model="llama-small", model_fingerprint="ab" * 32, num_layers=4, seq=64, global_batch=16,
        cluster="h100:1x8", memory_limit_bytes=80 * 10**9, config=cfg, stage_layers=(1, 3), mesh_shape=(2, 2, 2),
        stages=(StageInfo(index=0, first_layer=0, num_layers=1, has_embedding=True, has_head=False, submesh=(2, 2),
                          recompute="selective", zero=1, flops_per_microbatch=1.5e9, num_parameters=1000,
                          memory_bytes=9000),
                StageInfo(index=1, first_layer=1, num_layers=3, has_embedding=False, has_head=True, submesh=(2, 2),
                          recompute="selective", zero=1, flops_per_microbatch=3.5e9, num_parameters=3000,
                          memory_bytes=27000)),
        predicted=Estimate(step_time_s=0.5, tokens_per_s=2048.0, tokens_per_s_per_device=256.0,
                           model_tflops_per_device=1.5, mfu=0.25, peak_memory_bytes=12345, fits=True,
                           memory_limit_bytes=80 * 10**9, time_breakdown=(("compute_s", 0.4), ("bubble_s", 0.1)),
                           memory_breakdown=(("params_bytes", 12000),),
                           config=(("tp", 2), ("pp", 2), ("dp", 2), ("zero", 1), ("micro_batch", 2),
                                   ("num_microbatches", 4), ("schedule", "1f1b"), ("recompute", "selective"))),
        bubble_fraction=0.25,
        search=SearchInfo(cost_model="toy", num_candidates=10, num_priced=6, num_pruned_memory=3,
                          num_pruned_dominated=1, num_not_fitting=2,
                          alternatives=(Alternative(config=ParallelConfig(tp=8, dp=1), stage_layers=(4,),
                                                    step_time_s=0.6, peak_memory_bytes=100, fits=True),)),
    )
    values.update(overrides)
    return Plan(**values)


def test_round_trip_is_exact_and_sorted(tmp_path) -> None:
    plan = _plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    text = path.read_text()
    assert Plan.load(path) == plan
    assert Plan.load(path).dumps() == text
    data = json.loads(text)
    assert data["version"] == PLAN_VERSION == 6
    assert data["predicted"]["config"]["num_microbatches"] == 4 and data["bubble_fraction"] == 0.25
    assert list(data) == sorted(data)
    assert data["config"]["tp"] == 2 and data["stage_layers"] == [1, 3] and data["mesh_shape"] == [2, 2, 2]
    text.encode("ascii")


def _mutated(change) -> str:
    data = _plan().to_json()
    change(data)
    return json.dumps(data)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(version=1), "version 1 is not supported"),
    (lambda d: d.pop("stage_layers"), r"missing keys \['stage_layers'\]"),
    (lambda d: d.update(extra=1), r"unknown keys \['extra'\]"),
    (lambda d: d["config"].update(dp=4), "dp\\*tp\\*pp = 4\\*2\\*2 = 16 devices but its cluster h100:1x8 has 8"),
    (lambda d: d.update(stage_layers=[2, 3], stages=[]), "sum to 5 but the model has 4 layers"),
    (lambda d: d.update(stage_layers=[4], stages=[]), "must be 2 positive counts"),
    (lambda d: d.update(mesh_shape=[1, 4, 2]), "disagrees with its config"),
    (lambda d: d.update(global_batch=6), "not a multiple of dp \\* micro_batch"),
    (lambda d: d["config"].pop("zero"), r"config: missing keys \['zero'\]"),
    (lambda d: d["predicted"].update(time_breakdown={"x": "fast"}), "must be a number"),
    (lambda d: d["config"].update(schedule="zigzag"), "--schedule must be one of"),
])
def test_load_rejects_bad_plans_with_clear_errors(change, message) -> None:
    with pytest.raises(PlanFileError, match=message):
        Plan.loads(_mutated(change))


def test_load_reports_missing_file_and_bad_json(tmp_path) -> None:
    with pytest.raises(PlanFileError, match="does not exist"):
        Plan.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlanFileError, match="not valid JSON"):
        Plan.load(tmp_path / "bad.json")
    assert issubclass(PlanFileError, ValueError)


def test_generic_codec_reads_a_new_field_with_no_new_code() -> None:
    """Plan types get to_json/from_json from autopar/json_codec.py, by their type hints: a
    dataclass with fields no hand-written pair knows round-trips, and bad values say where."""
    from dataclasses import dataclass

    from autopar.json_codec import JsonData, JsonFormatError

    @dataclass(frozen=True, slots=True, kw_only=True)
    class StageCost(JsonData):  # e.g. a per-stage field a later search adds to the plan
        stage: int
        step_s: float
        breakdown: tuple[tuple[str, float], ...] = ()
        layers: tuple[int, ...] = ()
        config: ParallelConfig | None = None
        info: StageInfo | None = None

    full = StageCost(stage=1, step_s=0.5, breakdown=(("compute", 0.25), ("pp", 1)), layers=(2, 3),
                     config=ParallelConfig(pp=2, dp=4), info=_plan().stages[0])
    data = json.loads(json.dumps(full.to_json()))
    assert data["breakdown"] == {"compute": 0.25, "pp": 1} and data["layers"] == [2, 3]
    assert StageCost.from_json(data) == full and StageCost.from_json(data).to_json() == data
    assert StageCost.from_json({"stage": 0, "step_s": 1, "breakdown": {"comm": {"tp": 2}}, "layers": [],
                                "config": None, "info": None}).breakdown == (("comm.tp", 2),)
    for bad, where in ((dict(data, stage="1"), "StageCost.stage"), (dict(data, step_s=True), "StageCost.step_s"),
                       (dict(data, layers=[1.5]), "StageCost.layers[0]"),
                       (dict(data, info={**data["info"], "index": None}), "StageCost.info.index")):
        with pytest.raises(JsonFormatError, match=re.escape(f"malformed value at {where}:")):
            StageCost.from_json(bad)
    with pytest.raises(JsonFormatError, match=r"missing keys \['stage'\]"):
        StageCost.from_json({k: v for k, v in data.items() if k != "stage"})


def test_fingerprint_depends_on_names_and_shapes_only() -> None:
    a = model_fingerprint([("w", (2, 3)), ("b", (3,))])
    assert a == model_fingerprint([("b", [3]), ("w", (2, 3))])  # order-free
    assert a != model_fingerprint([("w", (3, 2)), ("b", (3,))])
    assert a != model_fingerprint([("v", (2, 3)), ("b", (3,))])
    assert len(a) == 64


def test_fake_built_fingerprint_equals_real_module_fingerprint() -> None:
    source = resolve("gpt-tiny")
    real = source.build()
    assert isinstance(next(real.parameters()), torch.nn.Parameter)
    assert fingerprint_source(source) == model_fingerprint((n, tuple(p.shape)) for n, p in real.named_parameters())
    assert fingerprint_source(resolve("gpt-small")) != fingerprint_source(source)


def test_check_model_refuses_another_model() -> None:
    plan = _plan()
    plan.check_model("ab" * 32)
    with pytest.raises(PlanFileError, match="made for another model.*Re-run `autopar search`"):
        plan.check_model("cd" * 32)
    _plan(model_fingerprint="").check_model("cd" * 32)  # built in code without a fingerprint: not checked


def test_compile_checks_a_plan_through_check_model() -> None:
    """autopar.compile(plan=...) refuses a plan of another model by the plan's own check."""
    import torch.distributed as dist

    import autopar

    try:
        with pytest.raises(PlanFileError, match="made for another model"):
            autopar.compile(torch.nn.Linear(4, 4), "cpu:1", plan=_plan())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_explain_names_every_stage_group_and_runner_up() -> None:
    text = _plan().explain()
    assert "stage 0: embedding, layers 0-0 (1)" in text
    assert "stage 1: layers 1-3 (3), final norm + head + loss" in text
    assert "why non-uniform" in text
    assert "tp8 pp1 dp1" in text and "(+20.0%)" in text
    text.encode("ascii")


def test_plan_written_before_a_defaulted_field_still_loads() -> None:
    """Plan files from before `pipeline` was added (no such key) load with its default;
    a required key stays required (the parametrized cases above)."""
    plan = Plan.loads(_mutated(lambda d: d.pop("pipeline")))
    assert plan.pipeline is None


def test_version_2_plan_file_loads() -> None:
    """A plan saved by version 2 (its `predicted` held nine Estimate fields and the bubble
    fraction) loads as the same plan: the bubble fraction moves beside the Estimate, the
    fields it lacked come from the plan (memory limit, config) or the Estimate's defaults."""
    plan = _plan()
    old = plan.to_json()
    keep = ("step_time_s", "tokens_per_s", "tokens_per_s_per_device", "model_tflops_per_device", "mfu",
            "peak_memory_bytes", "fits", "time_breakdown", "memory_breakdown")
    old["predicted"] = {**{k: old["predicted"][k] for k in keep}, "bubble_fraction": old.pop("bubble_fraction")}
    old["version"] = 2
    loaded = Plan.loads(json.dumps(old))
    assert loaded.bubble_fraction == 0.25 and loaded.predicted.memory_limit_bytes == plan.memory_limit_bytes
    config = dict(loaded.predicted.config)
    assert config["num_microbatches"] == 4 and config["tp"] == 2 and config["attention"] == "flash"
    assert loaded.predicted.time_breakdown == plan.predicted.time_breakdown
    assert loaded.explain() == plan.explain()
    assert json.loads(loaded.dumps())["version"] == PLAN_VERSION
    with pytest.raises(PlanFileError, match=r"plan\.predicted: missing keys \['fits'\]"):
        Plan.loads(json.dumps({**old, "predicted": {k: v for k, v in old["predicted"].items() if k != "fits"}}))


def _staged(**overrides) -> Plan:
    """The pp2 plan above with per-op placements recorded for both its chunks."""
    from autopar.plan import OpPlacement, StagePlacements

    ops = (OpPlacement(key="N0", op="placeholder", outputs=("(R, S(0))",), inputs=()),
           OpPlacement(key="N1", op="aten.mm.default", outputs=("(R, R)",), inputs=("(R, S(0))", "(R, S(1))")))
    stages = tuple(StagePlacements(chunk=k, placements=ops, collectives=(("all_reduce", "tp", 4, 1024),))
                   for k in (0, 1))
    return _plan(placements=stages, **overrides)


def test_chunk_placements_round_trip_validate_and_explain() -> None:
    plan = _staged()
    assert Plan.loads(plan.dumps()) == plan
    text = plan.explain()
    assert "per-stage per-op placements (the program each stage runs, replayed at build): 2 chunks" in text
    assert "chunk 1 (stage 1): 2 ops; collectives per step: all_reduce over tp x4" in text
    # read by a pipeline program (of any interleave: ProgramPlacements checks the chunks), never a one-stage one
    assert plan.records_program_for(plan.config) and not plan.records_program_for(ParallelConfig(dp=8))
    assert not _plan().records_program_for(_plan().config)
    data = plan.to_json()
    bad = json.loads(json.dumps(data))
    bad["placements"] = bad["placements"][:1]
    with pytest.raises(PlanFileError, match=r"plan has per-op placements for chunks \[0\], but its config .* has chunks "
                                            r"\[0, 1\]; the file was edited"):
        Plan.loads(json.dumps(bad))
    bad = json.loads(json.dumps(data))
    bad["placements"][1]["placements"][1][0] = "N0"
    with pytest.raises(PlanFileError, match=r"plan placements\[1\] name an op twice"):
        Plan.loads(json.dumps(bad))
    bad = json.loads(json.dumps(data))
    bad["placements"][0]["placements"][0][2] = ["(R, R, R)"]
    with pytest.raises(PlanFileError, match=r"plan placements\[0\]\['N0'\] \(R, R, R\) do not match the \(dp, tp\) mesh"):
        Plan.loads(json.dumps(bad))


def test_version_3_pipeline_plan_loads_and_says_the_build_solves() -> None:
    """A version-3 pipeline plan (no stage placements) loads; explain says each run solves the chunks."""
    old = _plan().to_json()
    old["version"] = 3
    loaded = Plan.loads(json.dumps(old))
    assert loaded == _plan() and loaded.placements == ()
    assert "per-stage per-op placements: not in this plan" in loaded.explain()
    assert "every run solves each chunk's intra-op ILP" in loaded.explain()


def test_version_4_plan_files_load_with_one_stage_list() -> None:
    """Version 4 kept an inter-op plan's stage records in `pipeline.stages` (with `stages`
    empty) and the template's in `stages` without a submesh, recompute or ZeRO (the plan's
    config): both load as version 5's one list, and explain the same."""
    from autopar.plan import PipelineInfo

    template = _plan()
    old = template.to_json()
    old["version"] = 4
    for s in old["stages"]:
        for key in ("submesh", "recompute", "zero", "time_per_microbatch_s", "inflight_microbatches", "placements",
                    "collectives"):
            s.pop(key)
    assert Plan.loads(json.dumps(old)) == template
    stages = tuple(StageInfo(index=k, first_layer=k, num_layers=n, has_embedding=k == 0, has_head=k == 1,
                             submesh=(2, 2), recompute="selective", zero=1, memory_bytes=9000,
                             time_per_microbatch_s=0.1, inflight_microbatches=2.0 - k,
                             placements=(("layers.*.attn.qkv.weight", "(R, S(0))"),),
                             collectives=(("all_reduce", "tp", 4, 1024),)) for k, n in enumerate((1, 3)))
    searched = _plan(stages=stages, pipeline=PipelineInfo(schedule="1f1b", chunks=1, microbatch=4, num_microbatches=4,
                                                          bubble_s=0.1, p2p_s=0.01))
    old = searched.to_json()
    old["version"] = 4
    old["pipeline"]["stages"] = [{k: v for k, v in s.items() if k not in ("flops_per_microbatch", "num_parameters")}
                                 for s in old["stages"]]
    old["stages"] = []
    loaded = Plan.loads(json.dumps(old))
    assert loaded == searched and loaded.explain() == searched.explain()
    assert "stage 1: layers 1-3 (3), final norm + head + loss on submesh (dp, tp) = (2, 2)" in loaded.explain()
    old["pipeline"]["stages"][1]["num_layers"] = 2
    with pytest.raises(PlanFileError, match=r"plan stages \(index, first_layer, num_layers\) .* disagree with "
                                            r"stage_layers \[1, 3\]"):
        Plan.loads(json.dumps(old))


DATA = Path(__file__).parent.parent / "data"


def test_version_5_plan_files_load_with_one_placement_record() -> None:
    """Version 5 kept a one-stage plan's op rows in `placements` and a pipeline's chunk
    records in `stage_placements`, and the template's layer-group choices in `intra_op`:
    the files the version-5 writer wrote (tests/data) load as version 6's one record per
    chunk with the same placements, drop `intra_op`, and write back as version 6."""
    from autopar.plan import StagePlacements

    for name in ("plan_v5_one_stage.json", "plan_v5_pipeline.json"):
        old = json.loads((DATA / name).read_text())
        assert old["version"] == 5
        plan = Plan.load(DATA / name)
        new = json.loads(plan.dumps())
        assert new["version"] == PLAN_VERSION and "stage_placements" not in new and "intra_op" not in new
        want = old["stage_placements"] or [{"chunk": 0, "placements": old["placements"], "collectives": []}]
        assert new["placements"] == want
        assert all(isinstance(s, StagePlacements) for s in plan.placements)
        moved = ("version", "placements", "stage_placements", "intra_op")
        assert {k: v for k, v in new.items() if k not in moved} == {k: v for k, v in old.items() if k not in moved}
        assert Plan.loads(plan.dumps()) == plan
    one = Plan.load(DATA / "plan_v5_one_stage.json")
    assert [s.chunk for s in one.placements] == [0] and len(one.chunk_placements(0)) == 2
    assert one.intra_op_info is not None and one.intra_op_info.collectives[1] == ("all_reduce", "tp", 8, 2048)
    assert "per-op placements (the program that runs): 2 ops chosen by the intra-op ILP, optimal" in one.explain()
    pipe = Plan.load(DATA / "plan_v5_pipeline.json")
    assert [s.chunk for s in pipe.placements] == [0, 1] and pipe == _staged()
    assert "chunk 1 (stage 1): 2 ops; collectives per step: all_reduce over tp x4" in pipe.explain()
    bad = json.loads((DATA / "plan_v5_pipeline.json").read_text())
    bad["stage_placements"] = bad["stage_placements"][1:]
    with pytest.raises(PlanFileError, match=r"plan has per-op placements for chunks \[1\], but its config"):
        Plan.loads(json.dumps(bad))


def test_placements_for_matches_the_chunk_graph_or_says_why() -> None:
    from types import SimpleNamespace

    from autopar.placement import Replicate, Shard

    def graph(*ops: str):
        nodes = [SimpleNamespace(op=op, name=f"n{i}", module_path="layers.0") for i, op in enumerate(ops)]
        return SimpleNamespace(nodes=nodes, node_keys=lambda: tuple(f"N{i}" for i in range(len(ops))))

    plan = _staged()
    got = plan.placements_for(graph("placeholder", "aten.mm.default"), 1)
    assert got[0].outputs == ((Replicate(), Shard(0)),) and got[1].inputs[1] == (Replicate(), Shard(1))
    with pytest.raises(PlanFileError, match=r"pipeline chunk 1: op aten.bmm.default \(n1, layers.0\) is "
                                            r"aten.mm.default in the plan"):
        plan.placements_for(graph("placeholder", "aten.bmm.default"), 1)
    with pytest.raises(PlanFileError, match=r"pipeline chunk 0: the plan places 1 ops this trace does not have"):
        plan.placements_for(graph("placeholder"), 0)
    with pytest.raises(PlanFileError, match="has no per-op placements for chunk 0"):
        _plan().placements_for(graph("placeholder"), 0)


def test_weight_update_placements_round_trip_and_explain() -> None:
    """A parameter's update placement is a fifth entry of its op row, written only where it
    differs from the compute placement (rows without one load and write as before); it is
    applied at build and `explain` names the ZeRO-1 layout per layer group."""
    from types import SimpleNamespace

    from autopar.explain import summarize_placements
    from autopar.plan import OpPlacement, StagePlacements
    from autopar.placement import Replicate, Shard

    ops = (OpPlacement(key="N0", op="placeholder", outputs=("(R, S(0))",), inputs=(), update="(S(1), S(0))"),
           OpPlacement(key="N1", op="aten.mm.default", outputs=("(R, R)",), inputs=("(R, S(0))", "(R, S(1))")))
    plan = _plan(placements=tuple(StagePlacements(chunk=k, placements=ops) for k in (0, 1)))
    data = json.loads(plan.dumps())
    rows = data["placements"][0]["placements"]
    assert rows[0][4] == "(S(1), S(0))" and len(rows[1]) == 4
    assert Plan.loads(plan.dumps()) == plan
    graph = SimpleNamespace(nodes=[SimpleNamespace(op=op, name=f"n{i}", module_path="layers.0")
                                   for i, op in enumerate(("placeholder", "aten.mm.default"))],
                            node_keys=lambda: ("N0", "N1"))
    got = plan.placements_for(graph, 0)
    assert got[0].outputs == ((Replicate(), Shard(0)),) and got[0].update == (Shard(1), Shard(0))
    assert got[0].update_placements == (Shard(1), Shard(0)) and got[1].update is None
    bad = json.loads(plan.dumps())
    bad["placements"][0]["placements"][0][4] = "(S(1), S(0), R)"
    with pytest.raises(PlanFileError, match=r"\(S\(1\), S\(0\), R\) do not match the \(dp, tp\) mesh"):
        Plan.loads(json.dumps(bad))
    lines = summarize_placements((("layers.*.mlp.fc1.weight", "(R, S(0)) update (S(1), S(0))"),
                                  ("layers.*.mlp.fc2.weight", "(R, S(1)) update (S(0), S(1))"),
                                  ("layers.*.attn.qkv.weight", "(S(0), S(0))"), ("norm.weight", "(R, R)")))
    assert "MLP (2 params): column/row over tp; weights replicated over dp, update S(1) over dp (ZeRO-1) / " \
           "weights replicated over dp, update S(0) over dp (ZeRO-1)" in lines
    assert "attention (1 params): heads over tp (column); S(0) over dp (sharded: ZeRO-3)" in lines
    assert "norms (1 params): replicated over tp; replicated over dp" in lines


def test_emit_refuses_a_one_stage_plan_without_per_op_placements(tmp_path) -> None:
    """`--emit` writes the program a plan runs; a one-stage plan that records no per-op
    placements names none, so it is refused (the template's module program is a baseline,
    benchmarks/baselines/template/emit.py), and nothing is written."""
    from autopar.build.emit import emit_plan

    plan = _plan(config=ParallelConfig(tp=2, dp=4, micro_batch=2), stage_layers=(4,), mesh_shape=(1, 4, 2), stages=())
    assert plan.config.pp == 1 and plan.placements == ()
    with pytest.raises(ValueError, match="records no per-op placements.*search again"):
        emit_plan(plan, tmp_path / "out")
    assert not (tmp_path / "out").exists()
