"""What the runtime can execute: one predicate per parallelism, for the search and the checks.

Where it sits: shared facts (read by the tracer, the planner, the pre-spawn checks in
autopar/preflight.py and the runtime): where a model's repeated layers are, how a pipeline
cuts them, and which pipelines run. A plan the runtime cannot execute is never ranked
(DESIGN.md): the search asks `pipeline_support(graph, config)` before it prices a
pipeline, and the runtime raises the same reason if it is given one anyway.

Pipelines (pp > 1) run one way, for any model with a repeated layer stack (the zoo's and
Hugging Face models alike): autopar/runtime/pipe_spmd.py cuts the traced step at the layers
(torch.distributed.pipelining's tracer) and compiles every stage by the per-op path on its
(dp, tp) submesh (the intra-op ILP under the configuration's rules, solver/forced.py), so
tp, dp and ZeRO come from the ILP as for pp = 1; torch's GPipe, 1F1B and interleaved
1F1B schedules run the stages; recompute is the joint graph's rewrite (autopar/recompute.py)
on each stage, the recomputed ops running in the stage's backward graph. Not there yet:
ScheduleInterleavedZeroBubble (`zb`: a per-op stage's backward computes input and weight
gradients in one graph, so there is no weight half to fill the bubbles with).

The planner asks `runnable(PlanShape)` about every priced candidate (solver/pipeline_search.py):
a candidate it refuses is recorded as a runner-up with the reason, never ranked as a plan.
Large described clusters (h100:128x8) are never run here, but a plan for them is still only
one whose shape this runtime could build. Both predicates read one rule set
(`_pipeline_reason`), so what the search ranks and what `autopar train` accepts agree.
The planner prices a pipeline stage by the solve its chunks run (solver/forced.py
solve_stage: the ILP on the stage's whole (dp, tp) submesh under the configuration's rules),
so a stage's price is the program it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from autopar.config import ParallelConfig, default_stage_layers
from autopar.ir import Graph

RUNTIME_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")
"""Pipeline schedules the planner may rank and the per-op pipeline runs (autopar/runtime/pipe_spmd.py);
`zb` is refused (module docstring)."""

ZOO_FAMILIES = ("gpt", "llama", "moe")
"""The zoo's model families (autopar/models), as `zoo_family` names them."""

_ZOO_MODULES = {"autopar.models.gpt": "gpt", "autopar.models.llama": "llama", "autopar.models.moe": "moe"}
"""Where the zoo's model classes live (by name: this module imports no stage)."""


def layer_container(model: Any) -> tuple[str, int]:
    """(module path, length) of the model's largest nn.ModuleList / nn.Sequential /
    numbered nn.ModuleDict, ('', 0) if none: where autopar/trace/ reads layer indices."""
    best = ("", 0)
    for name, mod in model.named_modules():
        # torchtitan keeps its blocks in a ModuleDict keyed "0", "1", ... (so pipeline
        # splits can delete some and keep the others' names): a layer list too
        numbered = isinstance(mod, nn.ModuleDict) and list(mod.keys()) == [str(i) for i in range(len(mod))]
        if (isinstance(mod, (nn.ModuleList, nn.Sequential)) or numbered) and len(mod) > best[1]:
            best = (name, len(mod))
    return best if best[1] >= 1 else ("", 0)


def layer_stack(model: Any) -> tuple[str, int]:
    """(module path, length) of `model`'s repeated layer stack: its layer container when
    it holds at least two blocks of one class; ('', 0) when there is none."""
    prefix, num_layers = layer_container(model)
    if num_layers < 2 or len({type(block) for block in model.get_submodule(prefix).children()}) != 1:
        return "", 0
    return prefix, num_layers


def split_layers(num_layers: int, num_chunks: int, stage_layers: tuple[int, ...] | None = None) -> tuple[range, ...]:
    """Layer ranges per pipeline chunk: the plan's `stage_layers`, or `autopar.config.default_stage_layers`
    (as even as possible, earlier chunks take the remainder: what the cost model prices). The cut every pipeline runtime uses."""
    if stage_layers is not None:
        if len(stage_layers) != num_chunks or sum(stage_layers) != num_layers or min(stage_layers) < 1:
            raise ValueError(
                f"plan stage_layers {tuple(stage_layers)} do not fit {num_chunks} pipeline chunks of a "
                f"{num_layers}-layer model: need {num_chunks} positive counts summing to {num_layers}; "
                "re-run `autopar search` for this model and pipeline degree"
            )
        counts = list(stage_layers)
    else:
        if num_layers < num_chunks:
            raise ValueError(
                f"{num_chunks} pipeline chunks (pp * interleave) but the model has only {num_layers} "
                "layers; lower --pp or --interleave"
            )
        counts = list(default_stage_layers(num_layers, num_chunks))
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return tuple(ranges)


def zoo_family(model: Any) -> str:
    """The zoo family ("gpt", "llama", "moe") of a model built from autopar/models, else ""."""
    return next((_ZOO_MODULES[c.__module__] for c in type(model).__mro__ if c.__module__ in _ZOO_MODULES), "")


def _structure(model_or_graph: Any) -> tuple[str, int, str, tuple[int, ...]]:
    """(family or '', repeated layers, model name, (heads, key/value heads) of a zoo model)
    of a model or its traced Graph."""
    if isinstance(model_or_graph, Graph):
        info = model_or_graph.model
        return info.family, info.num_layers, info.name, (info.heads, info.kv_heads)
    model = model_or_graph
    family = zoo_family(model)
    cfg = getattr(model, "cfg", None)
    heads = (cfg.heads, getattr(cfg, "num_kv_heads", cfg.heads)) if family and cfg is not None else (0, 0)
    return family, layer_stack(model)[1], type(model).__name__, heads


def pipeline_support(model_or_graph: Any, config: ParallelConfig) -> str | None:
    """None when the runtime runs `config`'s pipeline for this model (an nn.Module or its
    traced Graph), else the reason it cannot (what is wrong, what to try). pp = 1 plans
    always pass here (the per-op program runs any model the ILP can shard)."""
    if config.pp == 1:
        return None
    if config.schedule not in RUNTIME_SCHEDULES:
        return (f"--schedule {config.schedule} is not run by per-op pipeline stages (their backward computes input "
                f"and weight gradients together); use one of {', '.join(RUNTIME_SCHEDULES)}")
    family, num_layers, name, heads = _structure(model_or_graph)
    return _pipeline_reason(family, num_layers, name, heads, pp=config.pp, dp=config.dp, tp=config.tp,
                            zero=config.zero, recompute=config.recompute, chunks=config.pp * config.interleave)


def _pipeline_reason(family: str, num_layers: int, name: str, heads: tuple[int, int], *, pp: int, dp: int, tp: int,
                     zero: int, recompute: str, chunks: int) -> str | None:
    """The one rule set of what pipelines run (module docstring), on plain values."""
    if num_layers < 2:
        return (f"--pp {pp} needs a model with a repeated layer stack (an nn.ModuleList of blocks) to cut "
                f"into stages; {name} has none. Use --pp 1 (per-op data, tensor and ZeRO sharding)")
    if num_layers < chunks:
        return (f"pp * interleave = {chunks} pipeline chunks but {name} has only {num_layers} layers; lower --pp "
                "or --interleave")
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class StageShape:
    num_layers: int
    submesh: tuple[int, int]
    """(dp, tp)."""
    recompute: str
    zero: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanShape:
    """What `runnable` needs to know about a candidate plan (no costs)."""

    family: str
    """The model's family when it is one of the zoo's ("gpt", "llama"), else ""."""
    name: str = "this model"
    heads: int = 0
    kv_heads: int = 0
    num_layers: int
    """The repeated layers (0: no repeated stack)."""
    schedule: str = "1f1b"
    chunks: int = 1
    stages: tuple[StageShape, ...]


def runnable(shape: PlanShape) -> str | None:
    """None when the runtime executes this plan shape; else why not (one sentence). A
    pipeline runs one ParallelConfig: every stage on the same submesh, recompute and ZeRO,
    a schedule the planner prices, interleaving with each stage's layers split evenly over
    its chunks (stages may differ); the rest is
    `_pipeline_reason`, the rule `pipeline_support` applies to `autopar train`."""
    if len(shape.stages) == 1:
        return None  # the per-op program: any model, any (dp, tp) mesh the ILP placed
    p = len(shape.stages)
    first = shape.stages[0]
    if any(s.submesh != first.submesh for s in shape.stages):
        return "stages on different submeshes (the runtime runs one (pp, dp, tp) mesh)"
    if any(s.recompute != first.recompute for s in shape.stages):
        return "stages with different recompute policies (the runtime applies one)"
    if any(s.zero != first.zero for s in shape.stages):
        return "stages with different ZeRO layouts (the runtime applies one)"
    if shape.schedule not in RUNTIME_SCHEDULES:
        return f"schedule {shape.schedule} (the runtime builds {', '.join(RUNTIME_SCHEDULES)})"
    v = shape.chunks if shape.schedule == "interleaved" else 1
    chunks = p * v
    if v > 1 and any(s.num_layers % v for s in shape.stages):
        return (f"interleaved with non-uniform cuts: stage layers {'/'.join(str(s.num_layers) for s in shape.stages)} "
                f"(the runtime splits each stage's layers evenly over its {v} chunks, "
                "autopar/build/chunks.py chunk_layers)")
    dp, tp = first.submesh
    return _pipeline_reason(shape.family, shape.num_layers, shape.name, (shape.heads, shape.kv_heads), pp=p, dp=dp,
                            tp=tp, zero=first.zero, recompute=first.recompute, chunks=chunks)


__all__ = ["RUNTIME_SCHEDULES", "ZOO_FAMILIES", "PlanShape", "StageShape", "layer_container",
           "layer_stack", "pipeline_support", "runnable", "split_layers", "zoo_family"]
