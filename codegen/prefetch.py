"""Issue the weights' collectives ahead of their use in a recorded per-rank step graph.

Where it sits: codegen, on the `step` graph `codegen/apply.py` records, for one-stage
programs (autopar/build/one_stage.py; `--emit` shows the same graph). It moves nodes
and changes no value: the graph computes what it computed, with the same collectives
(kind, count, bytes) in the same order on every rank.

Why: in the recorded graph every functional collective is followed at once by its
`wait_tensor` (make_fx waits where the result is first read, and the interpreter gathers a
weight group where its first consumer runs), so a weight's all-gather blocks the compute
that needs it. A collective of weights alone (its inputs computed from parameters only)
can start earlier: this pass issues each one as soon as the weights' collective before
it has been waited and copied out of its flat buffer, within its phase (the backward's
first stays at its use), together with the copies that pack its input. It then runs on
NCCL's stream (or gloo's threads) beside the compute between that wait and its own,
which stays where it was: the one-deep prefetch of FSDP, which issues the next unit's
all-gather as the current unit's compute starts (Zhao et al., "PyTorch FSDP", arXiv 2304.11277, Sec. 3.4 "forward/backward
prefetching"). One collective in flight at a time keeps the extra memory to one group's
gathered weights.

What the cost model takes off for it: per phase, min(the weight collectives but the
first layer's, rho x the phase's compute) (cost_model/table.py `hidden_comm_s`,
solver/intra_op/overlap_rows.py).
"""

from __future__ import annotations

import operator
from typing import Any

from torch import fx

from autopar.ir import Role
from codegen.emit import program_source

_NAMESPACE = "_c10d_functional."
_WAIT = "_c10d_functional.wait_tensor"


def _is_collective(node: fx.Node) -> bool:
    target = str(node.target)
    return node.op == "call_function" and target.startswith(_NAMESPACE) and not target.startswith(_WAIT)


def _is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).startswith(_WAIT)


def weights_only(gm: fx.GraphModule, weights: set[str]) -> set[fx.Node]:
    """The nodes computed from the placeholders named in `weights` alone (through copies,
    views, collectives and their waits): what may run before any activation exists."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.name in weights:
                out.add(node)
        elif node.op == "call_function" and node.all_input_nodes and all(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _aliases(node: fx.Node) -> bool:
    """Whether `node`'s result shares its input's storage: an ATen op whose schema says its
    output aliases an input (view, slice, reshape as a view, ...) or an item of one's tuple."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None


def _copied_out(waits: list[fx.Node], derived: set[fx.Node], order: dict[fx.Node, int]) -> fx.Node:
    """The node after which the gathered buffer of a weights' collective is no longer read
    by the weights' own nodes: the last of its waits, the views of their results and the
    weights-alone nodes reading those (the copies out of the flat buffer into each weight,
    codegen/apply.py `_Interpreter._gather`). The buffer is freed there, unless compute
    reads a view of it directly."""
    last = min(waits, key=order.__getitem__)
    seen, stack = set(), list(waits)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if _aliases(u):
                stack.append(u)
            if u in derived and order[u] > order[last]:
                last = u
    return last


def prefetch_weight_collectives(gm: fx.GraphModule, weights: set[str], backward: fx.Node | None = None) -> int:
    """Move each collective of weights alone (`weights`: the parameters' placeholder names)
    but the first to just after the one before it has been waited and its gathered buffer
    copied out into the weights (`_copied_out`), with the nodes of weights alone it needs
    that come after that point (in their order); returns the number moved. Issued before
    the copies, the next group's buffer was live beside this one's and its copies: one
    group's gathered bytes more at the step's peak (2.25 MiB of a 4-layer Llama's fsdp4
    rank, a layer's weights). A collective already issued before that wait stays, and so
    does the backward's first (`backward`: the backward's first node): each phase's first collective runs where
    its phase needs it, as the price charges it (nothing of its phase before it to hide it),
    and the backward's first weights are not gathered while the forward's last are live."""
    derived = weights_only(gm, weights)
    collectives = [n for n in gm.graph.nodes if _is_collective(n) and n in derived]
    moved = 0
    for before, node in zip(collectives, collectives[1:]):
        waits = [u for u in before.users if _is_wait(u)]
        if not waits:
            continue
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        anchor = _copied_out(waits, derived, order)
        if order[node] < order[anchor] or (backward is not None and order[anchor] < order[backward] <= order[node]):
            continue
        needed: set[fx.Node] = set()
        stack = [node]
        while stack:
            n = stack.pop()
            if n in needed or order[n] <= order[anchor]:
                continue
            needed.add(n)
            stack.extend(a for a in n.all_input_nodes if a in derived)
        at = anchor
        for n in sorted(needed, key=order.__getitem__):
            at.append(n)  # fx: moves n to just after `at`
            at = n
        moved += 1
    if moved:
        gm.graph.lint()
        gm.recompile()
    return moved


def prefetch_program(program: Any) -> int:
    """`prefetch_weight_collectives` on a one-stage program's `step` (codegen/apply.py
    RankGraphs), its parameters' placeholders the weights; its source rewritten. Returns
    the number of collectives moved."""
    nodes = list(program.step.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    weights = {n.name for n, slot in zip(placeholders, program.slots) if slot.role is Role.PARAMETER}
    moved = prefetch_weight_collectives(program.step, weights, backward_start(program))
    if moved:
        program.source = program_source(program)
    return moved


def backward_start(program: Any) -> fx.Node | None:
    """The step's first backward node: the first that combines the loss tangent (or a view
    of it) with another value. The interpreter views every placeholder at the start, so the
    tangent's first reader is not yet the backward."""
    nodes = list(program.step.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    seeds: set[fx.Node] = {n for n, slot in zip(placeholders, program.slots) if slot.role is Role.TANGENT}
    for node in nodes:
        inputs = node.all_input_nodes
        if node.op != "call_function" or not any(a in seeds for a in inputs):
            continue
        if all(a in seeds for a in inputs):
            seeds.add(node)  # a view or copy of the tangent alone
        else:
            return node
    return None
