"""What the runtime can execute: one predicate per parallelism, for the search and the checks.

Where it sits: shared facts (read by the tracer, the planner, the pre-spawn checks in
autopar/preflight.py and the runtime): where a model's repeated layers are, how a pipeline
cuts them, and which pipelines run. A plan the runtime cannot execute is never ranked
(DESIGN.md): the search asks `pipeline_support(graph, config)` before it prices a
pipeline, and the runtime raises the same reason if it is given one anyway.

Pipelines (pp > 1) run in one of two ways today:
- the zoo's GPT and Llama (family "gpt" / "llama"): the module-level program
  (autopar/runtime.py: chunks by the family tables, Megatron TP, FSDP2 / ZeRO-1);
- any other model with a repeated layer stack (Hugging Face models, factories):
  autopar/runtime_pipe.py, stages cut at the layers by torch.distributed.pipelining,
  data parallelism by a gradient all-reduce (ZeRO 0) or FSDP2 on each stage (ZeRO 2/3):
  tp = 1, no ZeRO-1, no recompute.
"""

from __future__ import annotations

from typing import Any

from autopar.config import ParallelConfig, default_stage_layers

ZOO_FAMILIES = ("gpt", "llama")
"""Families the module-level pipeline (rule tables, Megatron TP, FSDP2) runs."""

_ZOO_MODULES = {"autopar.models.gpt": "gpt", "autopar.models.llama": "llama"}
"""Where the zoo's model classes live (by name: this module imports no stage)."""


def layer_container(model: Any) -> tuple[str, int]:
    """(module path, length) of the model's largest nn.ModuleList / nn.Sequential /
    numbered nn.ModuleDict, ('', 0) if none: where autopar/trace.py reads layer indices."""
    from torch import nn

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


def _structure(model_or_graph: Any) -> tuple[str, int, str, tuple[int, ...]]:
    """(family or '', repeated layers, model name, (heads, key/value heads) of a zoo model)
    of a model or its traced Graph."""
    from autopar.ir import Graph

    if isinstance(model_or_graph, Graph):
        info = model_or_graph.model
        return info.family, info.num_layers, info.name, (info.heads, info.kv_heads)
    model = model_or_graph
    family = next((_ZOO_MODULES[c.__module__] for c in type(model).__mro__ if c.__module__ in _ZOO_MODULES), "")
    cfg = getattr(model, "cfg", None)
    heads = (cfg.heads, getattr(cfg, "num_kv_heads", cfg.heads)) if family and cfg is not None else (0, 0)
    return family, layer_stack(model)[1], type(model).__name__, heads


def pipeline_support(model_or_graph: Any, config: ParallelConfig) -> str | None:
    """None when the runtime runs `config`'s pipeline for this model (an nn.Module or its
    traced Graph), else the reason it cannot (what is wrong, what to try). pp = 1 plans
    always pass here (the per-op program runs any model the ILP can shard)."""
    if config.pp == 1:
        return None
    family, num_layers, name, heads = _structure(model_or_graph)
    chunks = config.pp * config.interleave
    if num_layers < 2:
        return (f"--pp {config.pp} needs a model with a repeated layer stack (an nn.ModuleList of blocks) to cut "
                f"into stages; {name} has none. Use --pp 1 (per-op data, tensor and ZeRO sharding)")
    if num_layers < chunks:
        return (f"pp * interleave = {chunks} pipeline chunks but {name} has only {num_layers} layers; lower --pp "
                "or --interleave")
    if family in ZOO_FAMILIES:
        for count, what in zip(heads, ("attention heads", "key/value heads")):
            if count and count % config.tp:  # Megatron TP splits whole heads
                return (f"--tp {config.tp} does not divide {name}'s {count} {what} (its pipeline splits whole "
                        f"heads over tp); pick a tp that divides {count}")
        if config.zero == 1 and config.dp > 1 and config.tp > 1:
            return ("--zero 1 with --tp > 1 and --pp > 1 is not supported (ZeroRedundancyOptimizer takes plain "
                    "tensors, TP parameters are DTensors); use --zero 2, which also shards the optimizer state")
        return None
    unsupported = []
    if config.tp > 1:
        unsupported.append(f"--tp {config.tp}")
    if config.zero == 1 and config.dp > 1:
        unsupported.append("--zero 1")
    if config.recompute != "none":
        unsupported.append(f"--recompute {config.recompute}")
    if unsupported:
        return (f"a pipeline of {name} (stages cut at its {num_layers} repeated layers) runs data parallel "
                f"stages (--zero 0, 2 or 3) without recompute; {', '.join(unsupported)} is not supported there yet. "
                f"Use --pp 1 for tensor parallelism and ZeRO on this model, or drop {', '.join(unsupported)}")
    return None


__all__ = ["ZOO_FAMILIES", "layer_container", "layer_stack", "pipeline_support", "split_layers"]
