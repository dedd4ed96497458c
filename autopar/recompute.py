"""Recomputation (activation checkpointing) as a rewrite of the traced joint graph.

Where it sits: between capture and lowering (autopar/trace/capture.py `trace(..., recompute=)`).
A policy names which forward values of each repeated layer the backward reads from
memory; every other forward value the backward needs is recomputed: its forward op is
copied (with the chain of recomputed values it depends on) just before the backward of
that layer first needs it, and the backward reads the copy. The forward original then
dies at its last forward use, which is the memory saved.

Because the copies are ordinary nodes of the graph that is lowered, priced and solved,
the cost model charges exactly what runs: the ILP prices the recomputed ops (at the
placements it picks for them, resharding included) and the liveness memory rows see the
shorter lifetimes; the per-rank program executes the same copies. One definition per
policy, shared by pricing and runtime (DESIGN: price = run).

Policies (per repeated layer, `layers.<i>`; the embedding, head and loss are never
recomputed):
- "none": nothing recomputed.
- "full": only the layer's inputs are kept (what enters the layer from outside it,
  parameters included); every activation produced inside the layer is recomputed. Values
  computed from parameters alone (a weight's transpose, view or cast) are weights, not
  activations: the recomputed ops read the forward's. So the backward reads one tensor
  per weight where the recomputed forward and the gradient matmuls both need it, and a
  ZeRO-3 program gathers it once there (as FSDP unshards a unit once for its recompute
  and backward), not once for each.
- "selective": the outputs of matmuls and attention (the expensive ops) are kept; the
  norms, activations and other cheap elementwise and view ops are recomputed (the
  memory-heavy, compute-light part, as in Korthikanti et al. 2022's selective scheme).
Random ops (dropout masks) are never recomputed: a new draw would differ.
"""

from __future__ import annotations

import copy
import logging
import operator
import re
import time
import warnings
from dataclasses import replace
from typing import Any

import torch
from torch import fx

from autopar.ir import ATTENTION_FWD_OPS, GEMM_OPS

log = logging.getLogger(__name__)

RECOMPUTE_POLICIES = ("none", "selective", "full")

_EXPENSIVE = GEMM_OPS | ATTENTION_FWD_OPS
"""Kept by "selective" (with the getitems that read their outputs)."""


def _is_backward(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") == "is_backward"


def _is_random(node: fx.Node) -> bool:
    """Whether `node` draws random numbers. ATen tags every op that may draw them
    (`nondeterministic_seeded`), the fused attention kernels included because of their
    `dropout_p` argument; those with dropout_p = 0 draw none and are deterministic, so
    "full" recomputes them like any other op (as activation checkpointing of a whole
    block does: Megatron-LM's full recompute, torch.utils.checkpoint)."""
    target = node.target
    if not (isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags):
        return False
    names = [a.name for a in target._schema.arguments]
    if "dropout_p" not in names:
        return True
    i = names.index("dropout_p")
    value = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p",
                                                                    target._schema.arguments[i].default_value)
    return not (isinstance(value, (int, float)) and value == 0)


def _layer_of(node: fx.Node, pattern: re.Pattern[str] | None) -> int | None:
    if pattern is None:
        return None
    path = (node.meta.get("custom") or {}).get("module", "")
    match = pattern.match(path.removeprefix("model."))
    return int(match.group(1)) if match else None


def _recomputable(node: fx.Node, policy: str) -> bool:
    if node.op != "call_function" or _is_random(node):
        return False
    if policy == "full":
        return True
    name = str(node.target)
    if name in _EXPENSIVE:
        return False
    if node.target is operator.getitem and str(node.args[0].target) in _EXPENSIVE:
        return False
    return True


def _parameter_derived(nodes: list[fx.Node]) -> set[fx.Node]:
    """The parameters (placeholders aot_export describes as `ParamAOTInput`) and the nodes
    computed from them alone (as autopar/ir.py `Graph.parameter_derived` after lowering)."""
    out: set[fx.Node] = set()
    for n in nodes:
        if n.op == "placeholder":
            if type(n.meta.get("desc")).__name__ == "ParamAOTInput":
                out.add(n)
        elif n.op == "call_function" and n.all_input_nodes and all(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def apply_recompute(gm: fx.GraphModule, policy: str, layer_prefix: str) -> int:
    """Rewrite `gm` (in place) for `policy`; returns the number of ops copied."""
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"--recompute must be one of {', '.join(RECOMPUTE_POLICIES)}, got {policy!r}")
    if policy == "none" or not layer_prefix:
        return 0
    pattern = re.compile(rf"^{re.escape(layer_prefix)}\.(\d+)(?:\.|$)")
    graph = gm.graph
    nodes = list(graph.nodes)
    layer = {n: _layer_of(n, pattern) for n in nodes}
    # a layer's boundary: forward values read by forward ops outside the layer (its output,
    # the residual stream) stay in memory, as checkpointing keeps each layer's input
    boundary = {n for n in nodes if not _is_backward(n) and any(
        not _is_backward(u) and layer[u] != layer[n] for u in n.users)}
    # forward values of a layer that its backward would otherwise read from memory; a
    # weight's transpose or view (computed from parameters alone) is a weight, not an
    # activation: the recomputed ops read the forward's, so under ZeRO-3 the backward
    # gathers the weight once for the recomputed forward and the backward together
    weights = _parameter_derived(nodes)
    recompute = {n for n in nodes if not _is_backward(n) and layer[n] is not None and n not in boundary
                 and n not in weights and _recomputable(n, policy)}
    copies: dict[fx.Node, fx.Node] = {}
    made = 0

    def copy_of(node: fx.Node, before: fx.Node) -> fx.Node:
        nonlocal made
        if node not in recompute:
            return node
        if node in copies:
            return copies[node]
        args = fx.node.map_arg(node.args, lambda a: copy_of(a, before))
        kwargs = fx.node.map_arg(node.kwargs, lambda a: copy_of(a, before))
        with graph.inserting_before(before):
            clone = graph.call_function(node.target, args, kwargs)
        clone.meta = {**node.meta, "partitioner_tag": "is_backward", "recomputed": True}
        copies[node] = clone
        made += 1
        return clone

    for user in nodes:
        if not _is_backward(user) or user.op != "call_function":
            continue
        reads = [a for a in user.all_input_nodes if a in recompute]
        if not reads:
            continue
        user.args = fx.node.map_arg(user.args, lambda a: copy_of(a, user) if a in recompute else a)
        user.kwargs = fx.node.map_arg(user.kwargs, lambda a: copy_of(a, user) if a in recompute else a)
    graph.lint()
    gm.recompile()
    return made



def recompute_copy(traced: Any, policy: str) -> Any:
    """`traced` (an autopar.trace.Traced captured with recompute "none") rewritten for
    `policy` on a copy of its graph: what `trace(..., recompute=policy)` returns for the same
    model and inputs, without capturing the joint graph again. The rewrite (`apply_recompute`)
    reads only the captured graph, its nodes' meta and the layer prefix, and the copy keeps
    every node's name, order and meta (`fx.Graph.__deepcopy__`; the meta dicts are copied,
    their fake-tensor values shared and never written), so the rewritten copy is node for
    node the rewritten capture. A search that prices several policies at one batch captures
    once (the capture is most of a trace's time: aot_export_joint_with_descriptors)."""
    if policy == "none":
        return traced
    start = time.perf_counter()
    with warnings.catch_warnings():
        # torch's own deepcopy of the graph's pytree codegen trips its LeafSpec deprecation
        warnings.simplefilter("ignore", FutureWarning)
        graph = copy.deepcopy(traced.gm.graph)
    gm = fx.GraphModule(traced.gm, graph)
    copied = apply_recompute(gm, policy, traced.layer_prefix)
    log.info("recompute %s: %d forward ops recomputed in backward", policy, copied)
    return replace(traced, gm=gm, trace_time_s=traced.trace_time_s + time.perf_counter() - start)


__all__ = ["RECOMPUTE_POLICIES", "apply_recompute", "recompute_copy"]
