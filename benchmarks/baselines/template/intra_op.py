"""The config-template intra-op choice: Megatron tensor parallelism plus data parallelism.

Where it sits: benchmarks/baselines/template/, used by the template grid (search.py here)
as the per-layer-group intra-op choice; the product's choice is the intra-op ILP
(solver/intra_op/ilp.py). It records, per parameter of a
layer group, how Megatron shards it over the tp axis, in the template search's result
(search.py `TemplateSearchResult`, not in the product's plan file, which records the
per-op placements that run), so its explanation can say what each weight does.

Rules (Shoeybi et al. 2019; Korthikanti et al. 2022): the first linear of attention and
of the MLP is column-parallel (output features sharded, no communication in the
forward), the second row-parallel (input features sharded, one all-reduce or
reduce-scatter after it); embedding and output head are vocab-parallel; norms are
replicated (their activations sequence-parallel when enabled).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autopar.ir import Graph, Role


@dataclass(frozen=True, slots=True, kw_only=True)
class IntraOpChoice:
    """Per layer group: how its parameters are placed on the tp submesh, and by whom."""

    layer_group: str
    """'layers' for the repeated layers, 'embedding' and 'head' for the rest."""
    submesh: tuple[int, ...]
    source: str
    """'template' (Megatron tp + dp rules) or 'ilp' (layer_groups.py here)."""
    placements: tuple[tuple[str, str], ...]
    """(parameter name inside the group, placement on the tp axis and why)."""
    cost_s: float = 0.0
    """Intra-op objective of the group per step when solved by the ILP (0 for templates)."""


def layer_group_lines(choices: tuple[IntraOpChoice, ...]) -> list[str]:
    """The explanation of `choices`, per layer group: its submesh, who chose, each
    parameter's placement (the template search's addition to its plan's `explain`)."""
    lines = ["layer groups (intra-op):"] if choices else []
    for choice in choices:
        if choice.source == "ilp":
            note = f"ilp, ILP cost {choice.cost_s:.4g} s per step; recorded beside the template, not priced"
        else:
            note = f"{choice.source}, priced by the cost model"
        lines.append(f"  {choice.layer_group} on submesh {list(choice.submesh)} [{note}]")
        lines.extend(f"    {name}: {placement}" for name, placement in choice.placements)
    return lines

_COLUMN = ("wq", "wk", "wv", "w1", "w3", "qkv", "fc", "c_attn", "c_fc", "q_proj", "k_proj", "v_proj",
           "gate_proj", "up_proj")
_ROW = ("wo", "w2", "proj", "c_proj", "o_proj", "down_proj", "dense_4h_to_h")
_VOCAB = ("tok_embeddings", "wte", "embed_tokens", "output", "lm_head")
_POSITION = ("wpe",)


def _rule(name: str, tp: int) -> str:
    parts = name.split(".")
    leaf, kind = (parts[-2] if len(parts) > 1 else parts[0]), parts[-1]
    if tp == 1:
        return "Replicate() (tp=1: whole tensor; data parallel only)"
    if leaf in _COLUMN:
        what = "Shard(0) column-parallel" if kind == "weight" else "Shard(0) with its column-parallel weight"
        return f"{what}: output features split {tp} ways, no forward communication"
    if leaf in _ROW:
        if kind == "weight":
            return f"Shard(1) row-parallel: input features split {tp} ways, reduce-scatter/all-reduce after"
        return "Replicate() bias of a row-parallel linear, added after the reduction"
    if leaf in _VOCAB:
        return f"Shard(0) vocab-parallel: vocabulary split {tp} ways (all-reduce / parallel cross-entropy)"
    if leaf in _POSITION:
        return "Replicate() position table (small)"
    if "norm" in leaf or leaf.startswith("ln"):
        return "Replicate() norm weight (activations sequence-parallel)"
    return "Replicate() (no template rule for this parameter)"


def template_intra_op(graph: Graph, tp: int) -> tuple[IntraOpChoice, ...]:
    """Per layer group ('embedding', 'layers', 'head'): the template placement of each parameter."""
    groups: dict[str, dict[str, str]] = {"embedding": {}, "layers": {}, "head": {}}
    for node in graph.nodes:
        if node.role is not Role.PARAMETER or not node.param_name:
            continue
        if node.layer is not None:
            name = re.sub(r"^(.*?)\.\d+\.", "", node.param_name, count=1)
            groups["layers"].setdefault(name, _rule(name, tp))
        else:
            key = "embedding" if node.segment == "pre" else "head"
            groups[key].setdefault(node.param_name, _rule(node.param_name, tp))
    return tuple(
        IntraOpChoice(layer_group=key, submesh=(tp,), source="template", placements=tuple(sorted(rules.items())))
        for key, rules in groups.items() if rules
    )
