"""Liveness for the intra-op ILP's memory rows: which tensors are live when.

Where it sits: read by solver/intra_op/ilp.py (its `memory/t=T` rows) and by
solver/stage_costs.py (a stage's activation memory), so both count the same tensors.
Parameters and the raw gradients accumulated over the microbatches (charged by their
gradient nodes) count at every point; an activation counts from its producer to its last user,
a view aliasing its base. The rows check the MEMORY_POINTS times with the largest
replicated live bytes: sharding scales tensors unevenly, so this is a heuristic for the
true peak, exact at the checked points.

A traced layer stands for `w = graph.weight(n)` real layers, run one after another
(forward 1..w, backward w..1). How many of a layer tensor's w copies are live at once
(`live_copies`): all w if it is held across the turn from the forward to the backward
(a saved activation: every layer's is live when the backward starts), else one (a
temporary of one layer's forward, a recomputed value or a gradient inside one layer's
backward: each copy dies before the next layer's is made). Counting w for those too
charged w layers' recomputed activations at once: under full recompute a 40-layer
13B model (MPT-13b, 10 sequences of 4,096 per device, traced as 2 layers) priced at
173 GB of activations, 30 GB when each copy counts while it is live.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from autopar.ir import Graph, NodeId, Phase, Role
from cost_model import CostTable
from solver.intra_op.sharing import Reduction

MEMORY_POINTS = 4
"""Liveness points checked by memory rows (largest replicated live bytes first)."""


def live_intervals(graph: Graph, nodes: Sequence[NodeId]) -> tuple[list[NodeId], list[NodeId], dict[NodeId, NodeId]]:
    """What the memory rows count, over `nodes` (in order): (parameters, live tensors, the
    last use of each live tensor). A view aliases its base, which lives until the last use
    of any alias; gradients and multi-output nodes own no storage of their own."""
    active = set(nodes)
    end = {n: n for n in nodes}
    base: dict[NodeId, NodeId] = {}
    for n in nodes:  # views alias their base tensor; the base lives until the last alias use
        node = graph[n]
        if node.is_view and node.op not in ("getitem", "placeholder") and node.inputs and node.inputs[0] in active:
            base[n] = base.get(node.inputs[0], node.inputs[0])
        else:
            base[n] = n
        for u in node.inputs:
            if u in active:
                end[base[u]] = max(end[base[u]], n)
    static, live = [], []
    for n in nodes:
        node = graph[n]
        if node.role is Role.PARAMETER:
            static.append(n)
        elif base[n] == n and node.role is not Role.GRADIENT and len(node.outputs) == 1 \
                and node.op != "placeholder" or node.role in (Role.INPUT, Role.TANGENT):
            live.append(n)
    return static, live, end


def live_copies(graph: Graph, nodes: Sequence[NodeId], live: Sequence[NodeId], end: dict[NodeId, NodeId]
                ) -> dict[NodeId, float]:
    """Per live tensor: the real-model copies of it live at once (module docstring): its
    weight if it is produced before the first backward op of `nodes` and used at or after
    it, else at most one. (The loss tangent, a backward placeholder, sits among the
    inputs: the turn is the first backward node that computes.)"""
    turn = next((n for n in nodes if graph[n].phase is Phase.BACKWARD and graph[n].op != "placeholder"), None)
    out = {}
    for n in live:
        w = graph.weight(n)
        out[n] = w if turn is not None and n < turn <= end[n] else min(1.0, w)
    return out


def memory_terms(graph: Graph, table: CostTable, red: Reduction) -> list[tuple[int, dict[NodeId, list[float]]]]:
    """Per checked time point T: coefficients mem[o][j] of the live bytes at T."""
    static, live, end = live_intervals(graph, red.active)
    copies = live_copies(graph, red.active, live, end)
    # replicated profile via a sweep over interval starts/ends
    delta: dict[int, float] = defaultdict(float)
    for n in live:
        full = copies[n] * graph[n].output.size_bytes
        delta[n] += full
        delta[end[n] + 1] -= full
    profile, running = {}, 0.0
    for t in red.active:
        running += delta.get(t, 0.0)
        profile[t] = running
    points = sorted(sorted(profile, key=lambda t: (-profile[t], t))[:MEMORY_POINTS])
    # the raw gradients accumulated over the microbatches, charged by their gradient nodes
    # (cost_model/table.py strategy_cost), are held from the first microbatch's backward to
    # the step's sync: at every point, as the parameters
    static = static + [n for n in red.active if graph[n].role is Role.GRADIENT]
    terms = []
    for t in points:
        coef: dict[NodeId, list[float]] = {}
        for n in static + [m for m in live if m <= t <= end[m]]:
            o = red.owner[n]
            row = coef.setdefault(o, [0.0] * len(red.smap[o]))
            w = copies[n] if n in copies else graph.weight(n)  # a parameter or gradient: every copy
            for j, s in enumerate(red.smap[n]):
                row[j] += w * table.nodes[n][s].memory_bytes
        terms.append((t, coef))
    return terms
