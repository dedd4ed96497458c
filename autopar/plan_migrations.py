"""Plan file migrations: an older version's JSON brought forward to the next version's.

Where it sits: under autopar/plan.py `Plan.from_json`, which applies MIGRATIONS in turn
until the JSON is at PLAN_VERSION, then decodes and validates it as any plan file. A
migration works on parsed JSON (dicts and lists, never unpickled objects) and leaves
anything malformed for the codec to report with its location.

What each version changed (version 1 files are not read):
- 2: plans carry the ILP's per-op placements (`placements`), which is what runs.
- 3: `predicted` is the whole `Estimate` the search priced (autopar/estimate.py), the
  bubble fraction beside it (`Plan.bubble_fraction`): `_from_version_2`.
- 4: pipelines carry each chunk's per-op placements (`stage_placements`), replayed at
  build; a version-3 file has none (each run solves the chunks): `_from_version_3`.
- 5: one per-stage record list, `stages` (StageInfo), for the inter-op DP's plans and the
  template search's alike; `pipeline` keeps the schedule-level decision: `_from_version_4`.
- 6: one placement record, `placements` (one StagePlacements per chunk, a one-stage plan's
  being chunk 0), for what versions 2-5 kept in `placements` (one stage) and
  `stage_placements` (pipelines); the template baseline's layer-group choices (`intra_op`)
  are no longer in a plan: `_from_version_5`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping


def _from_version_2(data: Mapping[str, Any]) -> dict[str, Any]:
    """A version-2 plan file's JSON as version 3. Its `predicted` held nine of the Estimate's
    fields and the bubble fraction: the fraction moves to `bubble_fraction`, and the fields
    it lacked are the plan's own (memory limit, config with its microbatch count) or the
    Estimate's defaults (hardware TFLOP/s 0, peak stage 0). Anything malformed is left for
    the codec to report."""
    out = dict(data, version=3)
    pred, config = data.get("predicted"), data.get("config")
    if not isinstance(pred, Mapping):
        return out
    pred = dict(pred)
    out["bubble_fraction"] = pred.pop("bubble_fraction", 0.0)
    pred.setdefault("memory_limit_bytes", data.get("memory_limit_bytes"))
    if isinstance(config, Mapping):
        try:
            extra = {"num_microbatches": int(data["global_batch"]) // (int(config["dp"]) * int(config["micro_batch"]))}
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            extra = {}
        pred.setdefault("config", {**config, **extra})
    out["predicted"] = pred
    return out


def _from_version_3(data: Mapping[str, Any]) -> dict[str, Any]:
    """A version-3 plan file's JSON as version 4: version 4 added `stage_placements`, which
    a version-3 file lacks (its default, empty: each run solves the chunks)."""
    return dict(data, version=4)


def _from_version_4(data: Mapping[str, Any]) -> dict[str, Any]:
    """A version-4 plan file's JSON as version 5, whose stage records are one list,
    `stages`. A version-4 pipeline (inter-op DP) held its stages in `pipeline.stages`
    (with `stages` empty): they move to `stages` as they are. A version-4 template plan
    held `stages` without a submesh, recompute or ZeRO: they were the plan's config for
    every stage. Anything malformed is left for the codec to report."""
    out = dict(data, version=5)
    pipe, config = data.get("pipeline"), data.get("config")
    if isinstance(pipe, Mapping) and "stages" in pipe:
        out["pipeline"] = {k: v for k, v in pipe.items() if k != "stages"}
        out["stages"] = pipe["stages"]
    elif isinstance(data.get("stages"), list) and isinstance(config, Mapping):
        shared = {"submesh": [config.get("dp"), config.get("tp")], "recompute": config.get("recompute"),
                  "zero": config.get("zero")}
        out["stages"] = [{**shared, **s} if isinstance(s, Mapping) else s for s in data["stages"]]
    return out


def _from_version_5(data: Mapping[str, Any]) -> dict[str, Any]:
    """A version-5 plan file's JSON as version 6, whose per-op placements are one list of
    per-chunk records, `placements`. A version-5 one-stage plan held its op rows in
    `placements`: they become chunk 0's record (its priced collectives stay in
    `intra_op_info`). A version-5 pipeline held its chunk records in `stage_placements`:
    they move to `placements` as they are. `intra_op` (the template baseline's layer-group
    choices, which nothing ran) is dropped. Anything malformed is left for the codec to
    report."""
    out = {k: v for k, v in data.items() if k not in ("stage_placements", "intra_op")}
    out["version"] = 6
    rows, chunks = data.get("placements"), data.get("stage_placements")
    if chunks:
        out["placements"] = chunks
    elif rows:
        out["placements"] = [{"chunk": 0, "placements": rows}]
    else:
        out["placements"] = []
    return out


MIGRATIONS: dict[int, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    2: _from_version_2, 3: _from_version_3, 4: _from_version_4, 5: _from_version_5}
"""Plan file version -> its JSON as the next version's (Plan.from_json applies them in turn)."""
