"""What the runtime executes today: the one predicate the search consults before ranking.

Where it sits: shared by the planner (solver/pipeline_search.py asks it about every
priced candidate; a candidate it refuses is recorded as a runner-up with the reason, never
ranked as a plan) and the runtime's owners, who widen it when the runtime learns more.
Large described clusters (h100:128x8) are never run here, but a plan for them is still
only one whose shape this runtime could build.

Today (autopar/runtime.py `build_program`):
- pp = 1: the per-op program runs any model with the ILP's placements on its (dp, tp)
  mesh (autopar/runtime_spmd.py): always runnable.
- pp > 1: the module-level program (`build_module_program`): only a model of known
  structure (the zoo's GPT and Llama: codegen/rules.py `rules_for`), every stage on the
  same (dp, tp) submesh with the same recompute and ZeRO (one ParallelConfig), tp from the
  family rule tables (so tp must divide the heads and key/value heads), schedules gpipe,
  1f1b and interleaved (torch's Schedule1F1B / ScheduleGPipe / ScheduleInterleaved1F1B),
  the interleaved one only on an even split of the layers into pp x v chunks (the runtime
  ignores non-uniform cuts there), and no ZeRO-1 with tp > 1.

PIPELINE_STAGES_PER_OP says whether a pipeline stage runs the ILP's per-op placements; while
it is False the planner prices pp > 1 stages under the forced (dp, tp) layout the rule
tables run (batch over dp, weights over tp; solver/forced.py), so the price stays close
to what runs.
"""

from __future__ import annotations

from dataclasses import dataclass

PIPELINE_STAGES_PER_OP = False
"""True once pipeline stages run their per-op placements (issue 14, runtime side)."""

RUNTIME_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")
"""Pipeline schedules autopar/runtime.py builds."""

PIPELINE_FAMILIES: tuple[str, ...] = ("gpt", "llama")
"""Model families the module-level pipeline can cut into stages (codegen/rules.py)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StageShape:
    num_layers: int
    submesh: tuple[int, int]
    """(dp, tp)."""
    recompute: str
    zero: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanShape:
    """What the predicate needs to know about a candidate plan (no costs)."""

    family: str
    """The model's family when the runtime knows its structure ("gpt", "llama"), else ""."""
    heads: int = 0
    kv_heads: int = 0
    num_layers: int
    schedule: str = "1f1b"
    chunks: int = 1
    stages: tuple[StageShape, ...]


def runnable(shape: PlanShape) -> str | None:
    """None when the runtime executes this plan shape; else why not (one sentence)."""
    if len(shape.stages) == 1:
        return None  # the per-op program: any model, any (dp, tp) mesh the ILP placed
    p = len(shape.stages)
    if shape.family not in PIPELINE_FAMILIES:
        return (f"pp {p} needs a model the runtime can cut into stages (the zoo's "
                f"{' or '.join(PIPELINE_FAMILIES)}); this one runs as one stage")
    first = shape.stages[0]
    if any(s.submesh != first.submesh for s in shape.stages):
        return "stages on different submeshes (the runtime runs one (pp, dp, tp) mesh)"
    if any(s.recompute != first.recompute for s in shape.stages):
        return "stages with different recompute policies (the runtime applies one)"
    if any(s.zero != first.zero for s in shape.stages):
        return "stages with different ZeRO layouts (the runtime applies one)"
    if shape.schedule not in RUNTIME_SCHEDULES:
        return f"schedule {shape.schedule} (the runtime builds {', '.join(RUNTIME_SCHEDULES)})"
    dp, tp = first.submesh
    if tp > 1 and ((shape.heads and shape.heads % tp) or (shape.kv_heads and shape.kv_heads % tp)):
        return f"tp {tp} does not divide the {shape.heads} heads / {shape.kv_heads} key/value heads"
    if shape.schedule == "interleaved":
        chunks = p * shape.chunks
        if shape.num_layers % chunks or len({s.num_layers for s in shape.stages}) > 1:
            return (f"interleaved with non-uniform cuts (the runtime splits {shape.num_layers} layers "
                    f"evenly into {chunks} chunks)")
    if first.zero == 1 and tp > 1 and dp > 1:
        return "ZeRO-1 with tp > 1 (ZeroRedundancyOptimizer takes plain tensors)"
    return None
