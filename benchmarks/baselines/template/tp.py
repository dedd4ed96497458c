"""Tensor parallelism (Megatron column/row split, optional sequence parallelism) for chunks.

Where it sits: benchmarks/baselines/template/, called by the template baseline
(benchmarks/baselines/template_program.py) and its source (emit.py here) on each
module-level pipeline chunk before ZeRO wrapping; never by the runtime. The rule table
(rules.py here) names which module gets which style; this file only maps style names to
`torch.distributed.tensor.parallel` styles and applies the family's fix-ups (per-rank
head counts, fused-qkv row regrouping, shape-agnostic forwards).

Layouts (one TP mesh axis): without SP, activations between blocks are replicated and
each row-parallel output is all-reduced. With SP the residual stream is Shard(1) (over
the sequence): a region's entry all-gathers it, the row-parallel output reduce-scatters
back to Shard(1), and norms run on sequence shards (their weight grads are partial sums,
reduced in the runtime's grad finalisation).
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from benchmarks.baselines.template.rules import FamilyRules, TPRule
from benchmarks.baselines.template.stages import Chunk


def _style(rule: TPRule, sequence_parallel: bool) -> ParallelStyle | None:
    if rule.style == "colwise":
        return ColwiseParallel()
    if rule.style == "rowwise":
        if sequence_parallel:
            return RowwiseParallel(output_layouts=Shard(1))
        return RowwiseParallel()
    if rule.style == "norm":
        return SequenceParallel() if sequence_parallel else None
    if rule.style == "region":
        if not sequence_parallel:
            return None
        rest = (None,) * (rule.num_inputs - 1)
        # The region's input stays a (replicated) DTensor inside the region: its column-
        # parallel linears then hand back partial input gradients that add up as DTensors
        # and are reduce-scattered once, at the region's entry (Megatron's single
        # collective), not all-reduced once per linear (5 per Llama layer).
        return PrepareModuleInput(input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest))
    raise AssertionError(f"unknown TP style {rule.style!r} in the rule table")


def check_tp(rules: FamilyRules | None, model: nn.Module, tp: int) -> None:
    """ValueError when the model cannot be split tp ways (unknown structure, heads)."""
    if tp == 1:
        return
    if rules is None:
        raise ValueError(
            f"--tp {tp} needs a model of known structure (the zoo's GPT or Llama); "
            f"{type(model).__name__} gets data parallel, ZeRO and pipeline parallel only. Use --tp 1"
        )
    layer = model.layers[0]
    for count in rules.head_counts:
        value = getattr(layer.get_submodule(count.path), count.attr)
        if value % tp:
            raise ValueError(
                f"--tp {tp} does not divide the model's {value} {count.attr.replace('_', '-')}; "
                f"choose a tp that divides {value}"
            )


def apply_tp(chunk: Chunk, rules: FamilyRules, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Shard every layer of `chunk` over `tp_mesh` in place (parameters become DTensors)."""
    tp = tp_mesh.size()
    for layer in chunk.layers.values():
        with torch.no_grad():
            for perm in rules.permutations:
                owner, _, name = perm.path.rpartition(".")
                param = getattr(layer.get_submodule(owner), name, None)
                if param is not None:
                    param.copy_(perm.to_tp(param.detach(), tp))
        for count in rules.head_counts:
            module = layer.get_submodule(count.path)
            setattr(module, count.attr, getattr(module, count.attr) // tp)
        for path, forward in rules.tp_forwards:
            module = layer.get_submodule(path)
            module.forward = types.MethodType(forward, module)
        plan = {r.path: s for r in rules.tp_rules if (s := _style(r, sequence_parallel)) is not None}
        parallelize_module(layer, tp_mesh, plan)
    if sequence_parallel:
        chunk.sp_mesh = tp_mesh
