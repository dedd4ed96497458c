"""The intra-op ILP's edge terms: what resharding each graph edge costs under each pair of choices.

Where it sits: inside solver/intra_op/ilp.py `solve_intra_op`, after the graph reduction
(sharing.py) and before the model is built. Every edge u -> v of the traced step (an
activation read, a weight's use, a gradient's sync to its update placement, a buffer's
write-back) becomes a matrix over the owners' choices (j_a, j_b) of the reshard's price
(cost_model ReshardPricer: DTensor's redistribute plan, priced per collective), or None
where the move is not a plan: DTensor cannot do it, or it would gather an activation on
a data-parallel axis (every device would compute the same rows), or gather a weight on an
axis where weights stay whole (ZeRO 0-2). The one exception on a data-parallel axis is a
move from one split to another into or out of a grouped op's expert-parallel strategy
(restrict.py `exchange_nodes`): the dispatch and combine all-to-alls of expert
parallelism. Edges within one owner fold into its node costs or forbid its choice.
"""

from __future__ import annotations

from typing import Any, Callable

from autopar.ir import Graph, NodeId
from autopar.placement import Placements, Replicate, communicates, is_partial
from cost_model import ReshardPricer
from solver.intra_op.collective_groups import activation_reads, expected_bucket_bytes, param_gather_uses
from solver.intra_op.gather_rows import GatherGroups
from solver.intra_op.restrict import Exchange, gathers_rows
from solver.intra_op.shared_rows import SharedReshards
from solver.intra_op.sharing import Reduction, crosses_phase, layer_representatives
from solver.intra_op.overlap_rows import SYNC, HiddenComm

_UNPRICED = object()
"""A memo's miss (None is a price: the move is not a plan)."""

TIE_BREAK_S = 1e-10
"""Added to the objective (not to reported costs) per collective an edge needs: among
equal-time plans prefer fewer collectives (an all-reduce over reduce-scatter + all-gather)."""


def _num_collectives(src: Placements, dst: Placements) -> int:
    """Axes whose change needs communication (R->anything is local)."""
    return sum(1 for a, b in zip(src, dst) if a != b and not isinstance(a, Replicate) and not is_partial(b))


class EdgePrices:
    """The edge terms of one solve, added one graph edge at a time (`edge_matrices`): same-owner
    edges fold into `node_coef` or `forbidden`; the others collect as matrices over (j_a, j_b)
    in `edges`. Layer-shared edges repeat the same (tensor, placements) matrix, and placements
    repeat within one: each distinct pair is priced once, keyed by small ints (hashing
    placement dataclasses dominated the build). An edge's tensor and layouts are interned
    once per edge (`_ids`), not once per pair of choices."""

    def __init__(self, graph: Graph, red: Reduction, pricer: ReshardPricer, node_coef: dict[NodeId, list[float]],
                 forbidden: dict[NodeId, set[int]], gather_free_axes: tuple[int, ...],
                 prices: tuple[dict, dict, dict] | None, gathers: GatherGroups,
                 exchange: Exchange | None = None, weights_whole_axes: tuple[int, ...] = (),
                 hidden: HiddenComm | None = None, shared: SharedReshards | None = None) -> None:
        self.graph, self.red, self.pricer, self.gathers, self.hidden = graph, red, pricer, gathers, hidden
        self.shared = shared if shared is not None else SharedReshards()
        self.weights_whole_axes = weights_whole_axes
        self.owner_ep = _owner_flags(red, exchange or {})
        self.node_coef, self.forbidden, self.gather_free_axes = node_coef, forbidden, gather_free_axes
        self.from_params = graph.parameter_derived() if gather_free_axes else frozenset()
        self.edges: dict[tuple[NodeId, NodeId], list[list[float | None]]] = {}
        self.intern: dict[Placements, int]
        self.pair_cost: dict[tuple, float]
        self.matrices: dict[tuple, list[list[float]]]
        self.intern, self.pair_cost, self.matrices = prices if prices is not None else ({}, {}, {})
        self.gather_uses = param_gather_uses(graph)
        self.derived = graph.parameter_derived()
        self.expected_buckets = expected_bucket_bytes(graph)

    def _ids(self, values: Any) -> list[int]:
        """Small ints for tensors and layouts, shared by the solves that share the memos."""
        intern = self.intern
        return [intern.setdefault(v, len(intern)) for v in values]

    def priced(self, meta: Any, m: int, s: Placements, i: int, d: Placements, k: int, activation: bool | str,
               grad: bool, share: float | None = None, uses: int = 1) -> float | None:
        """The objective's price of resharding `meta` (interned as m) from `s` (i) to `d` (k)
        (None: not allowed). `activation`: False, True (no gather on a gather-free axis),
        "exchange" (an edge of a grouped op: a split may move to another split there,
        restrict.py `gathers_rows`), "weight" (a weight's edge: no gather on
        `weights_whole_axes`) or "view" (into a weight's view computed in another phase,
        sharing.py `crosses_phase`: u's layout kept, or gathered on the first mesh axis
        where weights are not kept whole there; so no group's member needs a group to be
        computed, codegen/apply.py `_gather`)."""
        if i == k:
            return 0.0
        key = (m, i, k, activation, grad, share, uses)
        found = self.pair_cost.get(key, _UNPRICED)
        if found is _UNPRICED:
            pricer = self.pricer
            t = pricer.grad_sync_time(meta, s, d, bucket_bytes=share) if grad else pricer(meta, s, d) \
                if share is None else pricer.gather_time(meta, s, d, share)
            if t is not None and uses > 1 and pricer.gather_axis(meta, s, d) is not None:
                # read `uses` times in its group, gathered once: each read pays its part (exact
                # where every reader asks for the same placement; solution.py prices the program)
                t /= uses
            if t is not None and activation == "view" and (pricer.gather_axis(meta, s, d) != 0
                                                           or 0 in self.weights_whole_axes):
                t = None
            axes = self.weights_whole_axes if activation in ("weight", "view") else self.gather_free_axes
            if t is not None and activation and any(gathers_rows(c, s, d, axes, activation == "exchange")
                                                    for c in pricer.collectives(meta, s, d) or ()):
                t = None
            found = self.pair_cost[key] = None if t is None else t + TIE_BREAK_S * _num_collectives(s, d)
        return found

    def add(self, u: NodeId, v: NodeId, meta: Any, src_of: Callable[[int], Placements],
            dst_of: Callable[[int], Placements], weight: float, grad: bool = False,
            twin: tuple | None = None) -> None:
        """The edge u -> v carrying `meta`, its layouts at strategy j of u and of v. `twin`:
        (u's twin-layer key, phase) where u has other readers in v's phase: its moves are
        charged once for them all (shared_rows.py), not on this edge."""
        graph, red = self.graph, self.red
        activation = bool(self.gather_free_axes) and u not in self.from_params and not grad
        if activation and (red.owner[u] in self.owner_ep or red.owner[v] in self.owner_ep):
            self._add_exchange(u, v, meta, src_of, dst_of, weight, twin)  # a grouped op's edge
            return
        share, uses = None, 1
        a, b = red.owner[u], red.owner[v]
        pool = self._pool(u, v, grad)
        if grad:
            share = self.expected_buckets[u]
        elif u in self.derived:  # a grouped gather: its group's latency is y_g's (gather_rows.py)
            share, uses = 0.0, self.gather_uses[(u, graph[v].layer, graph[v].phase.value)]
            if self.weights_whole_axes:
                activation = "weight"
            if crosses_phase(graph, self.derived, u, v):
                activation = "view"
            self.gathers.add_edge(graph[v].layer, graph[v].phase.value, meta.dtype,
                                  a, [src_of(j) for j in red.smap[u]], b, [dst_of(j) for j in red.smap[v]], weight)
        if a == b:
            self._add_within(a, meta, tuple(src_of(s) for s in red.smap[u]), tuple(dst_of(s) for s in red.smap[v]),
                             weight, (activation, grad, share, uses), pool, (twin, u))
            return
        src = tuple(src_of(j) for j in red.smap[u])
        dst = tuple(dst_of(j) for j in red.smap[v])
        key = (meta, src, dst, activation, grad, share, uses)
        unit = self.matrices.get(key)
        if unit is None:  # price each distinct (source, target) layout pair once
            (m,) = self._ids((meta,))
            us, ud = list(dict.fromkeys(src)), list(dict.fromkeys(dst))
            ius, iud = self._ids(us), self._ids(ud)
            distinct = {(a, b): self.priced(meta, m, a, i, b, k, activation, grad, share, uses)
                        for a, i in zip(us, ius) for b, k in zip(ud, iud)}
            unit = self.matrices[key] = [[distinct[(a, b)] for b in dst] for a in src]
        if twin is not None:
            unit = self.shared.add_edge(twin, u, a, src, b, dst, unit, weight)
        if pool is not None:
            self.hidden.add_matrix(pool, a, b, _hideable(unit, src, dst, pool), weight)
        self._accumulate(a, b, unit, weight)

    def _pool(self, u: NodeId, v: NodeId, grad: bool) -> str | None:
        """The overlap pool (overlap_rows.py) edge u -> v's charge joins, if any: a
        gradient's sync, or a collective of weights alone read by v's layer and phase."""
        hidden = self.hidden
        if hidden is None:
            return None
        if grad:
            return hidden.sync_pool(u)
        return hidden.gather_pool(self.graph[v].layer, self.graph[v].phase.value) if u in self.derived else None

    def _add_within(self, a: NodeId, meta: Any, src: tuple[Placements, ...], dst: tuple[Placements, ...],
                    weight: float, how: tuple, pool: str | None,
                    shared: tuple[tuple | None, NodeId] = (None, -1)) -> None:
        """An edge inside owner a (a follower chain): at a's choice j it moves `meta` from
        src[j] to dst[j]; its price joins c[a, j], or forbids j. Equal edges (layer twins)
        share one row of prices. `shared`: (twin key, the activation) where the move is
        charged once for all its readers (shared_rows.py); `pool`: the overlap pool its
        charge also joins (overlap_rows.py)."""
        key = ("within", meta, src, dst, how)
        row = self.matrices.get(key)
        if row is None:
            (m,), isrc, idst = self._ids((meta,)), self._ids(src), self._ids(dst)
            row = self.matrices[key] = [self.priced(meta, m, s, i, d, k, *how)
                                        for s, i, d, k in zip(src, isrc, dst, idst)]
        twin, u = shared
        if twin is not None:
            row = self.shared.add_within(twin, u, a, src, dst, row, weight)
        coef = self.node_coef[a]
        for j, c in enumerate(row):
            if c is None:
                self.forbidden.setdefault(a, set()).add(j)
            else:
                coef[j] += weight * c
                if pool is not None and (pool == SYNC or communicates(src[j], dst[j])):
                    self.hidden.add_node(pool, a, j, len(coef), weight * c)

    def _add_exchange(self, u: NodeId, v: NodeId, meta: Any, src_of: Callable[[int], Placements],
                      dst_of: Callable[[int], Placements], weight: float, twin: tuple | None = None) -> None:
        """An activation edge into or out of a grouped op, or a node that takes its choice
        (`_owner_flags`): a split may move to another split over the gather-free axes where
        the choice on either side is expert-parallel, and nowhere else. Priced per pair of
        owner choices; equal edges (layer twins) share one matrix."""
        red = self.red
        a, b = red.owner[u], red.owner[v]
        no = (False,) * max(len(red.smap[u]), len(red.smap[v]))
        ep_a, ep_b = self.owner_ep.get(a, no), self.owner_ep.get(b, no)
        srcs, dsts = [src_of(s) for s in red.smap[u]], [dst_of(s) for s in red.smap[v]]
        (m,), isrc, idst = self._ids((meta,)), self._ids(srcs), self._ids(dsts)

        def price(ja: int, jb: int) -> float | None:
            return self.priced(meta, m, srcs[ja], isrc[ja], dsts[jb], idst[jb],
                               "exchange" if ep_a[ja] or ep_b[jb] else True, False)

        if a == b:
            coef = self.node_coef[a]
            row = [price(j, j) for j in range(len(coef))]
            if twin is not None:
                row = self.shared.add_within(twin, u, a, srcs, dsts, row, weight)
            for j in range(len(coef)):
                c = row[j]
                if c is None:
                    self.forbidden.setdefault(a, set()).add(j)
                else:
                    coef[j] += weight * c
            return
        src, dst = tuple(srcs), tuple(dsts)
        key = ("exchange", meta, src, dst, ep_a[:len(src)], ep_b[:len(dst)])
        unit = self.matrices.get(key)
        if unit is None:
            unit = self.matrices[key] = [[price(ja, jb) for jb in range(len(dst))] for ja in range(len(src))]
        if twin is not None:
            unit = self.shared.add_edge(twin, u, a, src, b, dst, unit, weight)
        self._accumulate(a, b, unit, weight)

    def _accumulate(self, a: NodeId, b: NodeId, unit: list[list[float | None]], weight: float) -> None:
        """Add `weight` x `unit` to the edge matrix of owners (a, b) (None: forbidden)."""
        matrix = self.edges.get((a, b))
        if matrix is None:
            self.edges[(a, b)] = [[None if c is None else weight * c for c in row] for row in unit]
            return
        for row, unit_row in zip(matrix, unit):
            for jb, c in enumerate(unit_row):
                if c is None or row[jb] is None:
                    row[jb] = None
                elif c:
                    row[jb] += weight * c


def _hideable(unit: list[list[float | None]], src: tuple[Placements, ...], dst: tuple[Placements, ...],
              pool: str) -> list[list[float | None]]:
    """The part of an edge's unit matrix that runs beside compute: all of a gradient's sync
    (its bucket copies too, as cost_model `exposed_sync_s` takes them); of a weight's edge,
    the pairs that communicate (a local slice or copy runs on the compute stream)."""
    if pool == SYNC:
        return unit
    return [[c if c and communicates(s, d) else 0.0 for c, d in zip(row, dst)] for row, s in zip(unit, src)]


def _owner_flags(red: Reduction, exchange: Exchange) -> dict[NodeId, tuple[bool, ...]]:
    """Per owner holding a grouped op (restrict.py `exchange_nodes`) or taking its choice
    with one, per owner choice: whether a grouped op's strategy there is expert-parallel.
    A view that follows a grouped op (sharing.py) takes its layout unchanged, so the split
    leaving the op can only move on the view's own out-edge: its edges are the op's."""
    flags: dict[NodeId, list[bool]] = {}
    for n, ep in exchange.items():
        if red.owner[n] < 0:
            continue
        a = red.owner[n]
        mine = flags.setdefault(a, [False] * len(red.smap[a]))
        for j, k in enumerate(red.smap[n]):
            mine[j] = mine[j] or ep[k]
    return {a: tuple(f) for a, f in flags.items()}


def edge_matrices(graph: Graph, space, red: Reduction, pricer: ReshardPricer,
                   node_coef: dict[NodeId, list[float]], forbidden: dict[NodeId, set[int]], gathers: GatherGroups,
                   *, grad_sync_weight: float = 1.0, gather_free_axes: tuple[int, ...] = (),
                   prices: tuple[dict, dict, dict] | None = None, exchange: Exchange | None = None,
                   weights_whole_axes: tuple[int, ...] = (), hidden: HiddenComm | None = None,
                   shared: SharedReshards | None = None) -> dict[tuple[NodeId, NodeId], list[list[float | None]]]:
    """Resharding cost per owner pair (a, b) as a matrix over (j_a, j_b) (None: DTensor
    cannot reshard, or it would gather an activation on a `gather_free_axes` axis); folds
    same-owner edges into node costs or `forbidden` choices. `prices`: the (intern, pair,
    matrix) price memos of earlier solves with the same pricer and axes (a search's solves
    of one submesh share them: every key holds the tensor and both layouts it prices).
    `gathers` collects the grouped weight gathers' rows (gather_rows.py), `hidden` the
    hideable charges (overlap_rows.py); `exchange` the grouped ops, into and
    out of whose expert-parallel strategies a split may move over `gather_free_axes`
    (restrict.py `exchange_nodes`); `weights_whole_axes` the axes no weight is gathered on;
    `shared` the moves of activations read more than once in a phase (shared_rows.py)."""
    active = set(red.active)
    edges = EdgePrices(graph, red, pricer, node_coef, forbidden, gather_free_axes, prices, gathers, exchange,
                       weights_whole_axes, hidden, shared)
    reads = activation_reads(graph, active)
    twins = layer_representatives(graph, active)
    for v in red.active:
        node = graph[v]
        for p, u in enumerate(node.inputs):
            if u not in active or len(graph[u].outputs) != 1:
                continue
            phase = node.phase.value
            edges.add(u, v, graph[u].output, lambda j, u=u: space[u][j].outputs[0],
                      lambda j, v=v, p=p: space[v][j].inputs[p], graph.weight(v),
                      twin=(twins.get(u, u), phase) if reads.get((u, phase), 0) > 1 else None)
    for param, grad in graph.param_grads:
        if param in active and grad in active:
            edges.add(grad, param, graph.grad_meta(grad), lambda j, g=grad: space[g][j].outputs[0],
                      lambda j, q=param: space[q][j].update_placements, graph.weight(grad) * grad_sync_weight,
                      grad=True)
    for buf, value in graph.buffer_updates:  # a buffer's new value, written back every microbatch
        if buf in active and value in active:
            edges.add(value, buf, graph[value].output, lambda j, u=value: space[u][j].outputs[0],
                      lambda j, b=buf: space[b][j].outputs[0], graph.weight(value))
    return edges.edges
