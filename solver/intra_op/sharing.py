"""Graph simplification for the intra-op ILP: layer sharing and strategy following.

Where it sits: inside `solver.intra_op.ilp.solve_intra_op`, between pricing and the ILP.
It decides which nodes own a decision variable and expresses every other node's choice
as a function of an owner's choice, so the ILP grows with one layer, not with depth.

Terms:
- owner: a node that has ILP variables x[o, j], one per strategy j of o.
- smap[n][j]: the strategy of node n when its owner picks j (identity for owners).
- layer sharing: the k-th node of every traced layer of a layer group uses the owner of
  the k-th node of the group's first (active) traced layer; its costs are added to that
  owner with the node's multiplicity weight `graph.weight(n)`.
- following: a getitem, a single-input node, or a pointwise op (through the operand the
  strategy space names in `StrategySpace.follows`), in the same layer as its producer
  and whose strategies accept every placement the producer can output (views, unary and
  binary elementwise, reductions), takes the producer's owner; each producer choice maps
  to the cheapest follower strategy consuming it unchanged (no resharding between
  them). A pointwise op's other operands reshard on their own edges as priced. This is
  Alpa's "follow" merging: an elementwise op rarely gains from a layout its main operand
  does not have, and sharing the variable removes most edge variables. A weight's view
  in the backward (computed from parameters alone) does not follow a forward producer:
  left its own variable, it can read the backward's gather of that producer (the weight
  gathered once for the recomputed forward and the gradient matmuls, as FSDP unshards a
  unit once for both) instead of being gathered apart in its producer's layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.ir import Graph, NodeId
from autopar.placement import Placements
from autopar.sharding import StrategySpace
from cost_model import CostTable


@dataclass(frozen=True, slots=True, kw_only=True)
class Reduction:
    active: tuple[NodeId, ...]
    owner: tuple[NodeId, ...]
    """Per node id (inactive nodes: -1)."""
    smap: tuple[tuple[int, ...], ...]
    """Per node id, strategy index of the node for each strategy index of its owner."""
    owners: tuple[NodeId, ...]


def _layer_positions(graph: Graph, active: set[NodeId]) -> tuple[dict[NodeId, NodeId], dict[NodeId, tuple[int, int]]]:
    """rep[n] (shared-variable representative) and the (group, traced layer) of layer nodes."""
    rep: dict[NodeId, NodeId] = {}
    where: dict[NodeId, tuple[int, int]] = {}
    for group in graph.layer_groups:
        for ell, layer_nodes in enumerate(group.nodes):
            for nid in layer_nodes:
                where[nid] = (group.index, ell)
        for k in range(len(group.nodes[0])):
            members = [layer_nodes[k] for layer_nodes in group.nodes if layer_nodes[k] in active]
            for nid in members:
                rep[nid] = members[0]
    return rep, where


def layer_representatives(graph: Graph, active: set[NodeId]) -> dict[NodeId, NodeId]:
    """{layer node: its twin in the first active traced layer of its group} (the node whose
    variables it shares); nodes outside the layer stack are absent."""
    return _layer_positions(graph, active)[0]


def crosses_phase(graph: Graph, derived: frozenset[NodeId], u: NodeId, v: NodeId) -> bool:
    """Whether v is a weight's value (computed from parameters alone) computed in another
    phase than its input u: the backward's transpose of a forward weight view. It does not
    follow u (module docstring); its input edge may only keep u's layout or gather it on
    the first mesh axis (edges.py `EdgePrices.add`), so a weight the backward gathers is
    gathered once there and the views computed from it need no group of their own."""
    return v in derived and graph[u].phase is not graph[v].phase


def reduce_graph(graph: Graph, space: StrategySpace, table: CostTable,
                 active_nodes: tuple[NodeId, ...] | None) -> Reduction:
    active = set(range(len(graph))) if active_nodes is None else set(active_nodes)
    rep, where = _layer_positions(graph, active)
    owner = [-1] * len(graph)
    smap: list[tuple[int, ...]] = [()] * len(graph)

    def copy_rep(nid: NodeId) -> bool:
        r = rep[nid]
        if owner[r] < 0:
            return False
        assert space[r] == space[nid], f"layer-shared nodes {r} and {nid} differ in strategies"
        owner[nid], smap[nid] = owner[r], smap[r]
        return True

    # representatives first (a backward node of a later layer precedes its layer-0 twin)
    order = [n for n in sorted(active) if rep.get(n, n) == n] + [n for n in sorted(active) if rep.get(n, n) != n]
    derived = graph.parameter_derived()
    for nid in order:
        node = graph[nid]
        strategies = space[nid]
        if rep.get(nid, nid) != nid:
            if owner[nid] < 0:
                assert copy_rep(nid), f"representative of node {nid} unresolved"
            continue
        srcs = tuple(dict.fromkeys(node.inputs))
        followed = False
        lead = space.follows[nid] if space.follows else None
        if len(srcs) == 1:
            lead = 0
        if lead is not None and node.op != "placeholder":
            u = node.inputs[lead]
            positions = [p for p, src in enumerate(node.inputs) if src == u]
            if u in active and owner[u] < 0 and rep.get(u, u) != u:
                copy_rep(u)  # a non-layer node after a later layer's node
            if u in active and owner[u] >= 0 and not crosses_phase(graph, derived, u, nid) \
                    and (where.get(nid) is None or where.get(u) == where.get(nid)):
                idx = graph[u].output_position(node.args[1]) if node.op == "getitem" else 0
                costs = table.nodes[nid]
                # the cheapest strategy reading each layout at every position of u (ties: the first)
                cheapest: dict[Placements, int] = {}
                for i, s in enumerate(strategies):
                    layout = s.inputs[positions[0]]
                    if all(s.inputs[p] == layout for p in positions[1:]):
                        best = cheapest.get(layout)
                        if best is None or costs[i].compute_s + costs[i].comm_s < \
                                costs[best].compute_s + costs[best].comm_s:
                            cheapest[layout] = i
                mapping = []
                for j in smap[u]:
                    match = cheapest.get(space[u][j].outputs[idx])
                    if match is None:
                        break
                    mapping.append(match)
                else:
                    owner[nid], smap[nid] = owner[u], tuple(mapping)
                    followed = True
        if not followed:
            owner[nid], smap[nid] = nid, tuple(range(len(strategies)))
    owners = tuple(sorted({owner[n] for n in active}))
    return Reduction(active=tuple(sorted(active)), owner=tuple(owner), smap=tuple(smap), owners=owners)
