"""Restricting the strategy space before the intra-op ILP: forced layouts and gather-free axes.

Where it sits: between strategy enumeration (solver/intra_op/space.py) and the ILP
(solver/intra_op/ilp.py `solve_intra_op`, which calls these). Infeasible options are
absent, not expensive: a forced configuration (data parallel over an axis, ZeRO, no
tensor parallelism) removes placeholder strategies (`restrict_placeholders`), and a
data-parallel axis on which activations are never gathered removes every strategy no plan
can reach without such a gather (`prune_gather_free`). The one move of activations allowed
on that axis is expert parallelism's: a split moved to another split into or out of a
grouped op's expert-parallel strategy (`exchange_nodes`, `gathers_rows`).
"""

from __future__ import annotations

from typing import Any, Callable

from autopar.ir import Graph, Node, NodeId, Role
from autopar.placement import Placements, Shard
from autopar.sharding import InfeasiblePlanError, StrategySpace
from cost_model import reshard_collectives

PlaceholderFilter = Callable[[Node, Placements], bool]
"""keep(placeholder node, its placements): which layouts a forced configuration allows."""

UpdateFilter = Callable[[Node, Placements, Placements], bool]
"""keep(parameter node, compute placements, update placements): which weight-update
placements a forced configuration allows (the update equal to the compute placement is
offered to it too)."""


def restrict_placeholders(graph: Graph, space: StrategySpace, keep: PlaceholderFilter | None,
                          keep_update: UpdateFilter | None = None) -> StrategySpace:
    """A new space whose placeholders keep only the layouts `keep` allows, and whose
    parameters keep only the weight-update placements `keep_update` allows. Raises
    InfeasiblePlanError where none remains for a placeholder (the configuration has no plan:
    a search skips it, a command given it exits 2 with the parameter named)."""
    strategies = []
    for node, options in zip(graph.nodes, space.strategies):
        if node.op == "placeholder":
            kept = tuple(s for s in options if (keep is None or keep(node, s.outputs[0])) and (
                keep_update is None or node.role is not Role.PARAMETER
                or keep_update(node, s.outputs[0], s.update_placements)))
            if not kept:
                raise InfeasiblePlanError(f"the forced configuration leaves no layout for {node.role.value} "
                                 f"{node.param_name or node.name} of shape {node.output.shape} on mesh "
                                 f"{space.mesh_shape}; choose degrees that divide its dims")
            options = kept
        strategies.append(options)
    return StrategySpace(mesh_shape=space.mesh_shape, strategies=tuple(strategies),
                         fallback_ops=space.fallback_ops, follows=space.follows)


def stacked_gradient_bound(graph: Graph) -> frozenset[NodeId]:
    """Nodes computed only for stacked parameters' gradients (three or more dims): such a
    gradient node, and every node whose users are all such nodes (a weight-gradient batched
    matmul and the views that shape its result). The mirror of Graph.parameter_derived on
    the backward's far end."""
    bound: set[NodeId] = set()
    for node in reversed(graph.nodes):
        users = graph.users(node.id)
        if (node.role is Role.GRADIENT and len(node.outputs) == 1 and len(node.output.shape) >= 3) or (
                node.role is not Role.GRADIENT and users and all(u in bound for u in users)):
            bound.add(node.id)
    return frozenset(bound)


Exchange = dict[NodeId, tuple[bool, ...]]
"""Per grouped op (`exchange_nodes`), per strategy of its list: whether it is expert
parallelism over a gather-free axis (the only strategies a moved split may feed or leave)."""


def exchange_nodes(graph: Graph, space: StrategySpace, gather_free_axes: tuple[int, ...]) -> Exchange:
    """The grouped ops of `graph` and their expert-parallel strategies. A grouped op computes
    with a stacked parameter (three or more dims: routed experts' weights [E, d, f]) or
    produces a stacked parameter's gradient (`stacked_gradient_bound`); its expert-parallel
    strategies split that tensor on a gather-free axis with every activation they read and
    write split on the same axis (none whole, none a pending sum): each device computes its
    own experts on the tokens sent to them. The token slots reach such a strategy split by
    batch and must move to the expert split, and back after it: on the edges into and out
    of a grouped op, and only for these strategies, `gathers_rows` allows the all-to-all
    (Shard(i) -> Shard(j)) over the gather-free axes. Everywhere else activations stay where
    their batch split put them, and a grouped op's other strategies (the weights gathered,
    or the contraction split into a pending sum) read their inputs as before.

    A dense layer's matmul never qualifies (its weights have two dims, and splitting a
    weight over the axis leaves the input whole or the output a pending sum), nor a norm's
    vector weight, so the dense strategy space is unchanged."""
    if not gather_free_axes:
        return {}
    derived = graph.parameter_derived()
    bound = stacked_gradient_bound(graph)
    out: Exchange = {}
    for node in graph.nodes:
        if node.op == "placeholder" or node.id in derived:
            continue
        stacked = [p for p, u in enumerate(node.inputs) if u in derived and len(graph[u].output.shape) >= 3]
        grad_out = node.id in bound and len(node.outputs) == 1 and len(node.output.shape) >= 3
        if not stacked and not grad_out:
            continue
        reads = [p for p, u in enumerate(node.inputs) if u not in derived]
        flags = tuple(any(_all_split(st, a, stacked, reads, grad_out) for a in gather_free_axes)
                      for st in space.strategies[node.id])
        if any(flags):
            out[node.id] = flags
    return out


def _all_split(st: Any, axis: int, stacked: list[int], reads: list[int], grad_out: bool) -> bool:
    """Whether strategy `st` splits its stacked tensor (input positions `stacked`, or its
    output if `grad_out`) and all its activation inputs `reads` and outputs on `axis`."""
    weight = any(isinstance(st.inputs[p][axis], Shard) for p in stacked) or (
        grad_out and isinstance(st.outputs[0][axis], Shard))
    return weight and all(isinstance(st.inputs[p][axis], Shard) for p in reads) \
        and all(isinstance(o[axis], Shard) for o in st.outputs)


def gathers_rows(collective: Any, src: Placements, dst: Placements, gather_free_axes: tuple[int, ...],
                 exchange: bool = False) -> bool:
    """Whether `collective`, one step of resharding an activation from `src` to `dst`,
    gathers rows on a gather-free (data-parallel) axis: an all-gather or all-to-all there.
    `exchange` (an edge into or out of a grouped op's expert-parallel strategy,
    `exchange_nodes`): except where that axis goes from Shard(i) to Shard(j), i != j.

    Such a move keeps every device holding 1/n of the tensor and computing on its own
    share: rows are exchanged, not duplicated, so the axis still divides the work. It is
    how expert parallelism sends tokens to the device holding their expert's weights and
    back (GShard, arXiv 2006.16668, section 2.2: the dispatch and combine all-to-alls;
    Megatron-Core and torchtitan carve the expert-parallel group out of the data-parallel
    ranks). DTensor runs it as one all-to-all on a GPU mesh, or an all-gather and a local
    chunk on a CPU (gloo) mesh, and it is priced as it runs (cost_model
    `reshard_collectives`). A gather to Replicate or to a pending sum stays forbidden:
    every device would then compute the same rows."""
    if collective.axis not in gather_free_axes or collective.kind not in ("all_gather", "all_to_all"):
        return False
    if not exchange:
        return True
    a, b = src[collective.axis], dst[collective.axis]
    return not (isinstance(a, Shard) and isinstance(b, Shard) and a.dim != b.dim)


def prune_gather_free(graph: Graph, space: StrategySpace, gather_free_axes: tuple[int, ...], *,
                      gloo: bool, memo: dict | None = None, exchange: Exchange | None = None) -> StrategySpace:
    """`space` without the strategies no plan can use under `gather_free_axes`: a node's
    strategy goes when one of its activation inputs (an edge `edges.edge_matrices` prices, from
    a tensor not derived from a parameter) has no remaining producer strategy that DTensor
    can reshard to it without an all-gather or all-to-all on such an axis (the edges
    `edges.edge_matrices` forbids): no plan loses a strategy it could use. Propagated in
    topological order to a fixed point; layer-shared nodes (reduce_graph) take one choice
    together, so they keep the strategies all of them can use and their lists stay
    identical. On a (dp, tp) mesh with data-parallel dp most of the product space is such
    strategies (an activation can only stay split by batch over dp): llama3-70b's stage on
    (32, 4) goes from 20054 ILP variables to 1750. reduce_graph's follow-the-producer
    reduction may then tie more pointwise ops to their producer, so the optimum can move a
    little (13 stage ILPs checked: 10 the same, 3 within 0.3% above). Returns `space` itself
    when nothing is pruned.

    A node left with no strategy proves the configuration has no plan: every strategy it
    has needs an input layout that no remaining producer choice reaches without the
    forbidden gather (the edges the ILP forbids, and a multi-output op's getitem reads its
    result as produced). InfeasiblePlanError then names the node and its module, without
    building the ILP: an LSTM's input projection flattens (time, batch) with batch inner,
    which DTensor cannot keep split by batch, and its dp candidates cost 1-5 s of ILP
    build and solve each to say so.

    `memo` (one search's, for spaces it shares between solves): the pass reads only the
    strategies of nodes not derived from parameters, and only which collective kinds on
    which axes a reshard runs (not the sizes), so solves whose spaces hold the same
    strategy lists there (the ZeRO layouts of one stage, microbatches with one
    divisibility signature: solver/pipeline_search.py) share one pass. Keyed by those
    lists (placeholders' by value: restrict_placeholders rebuilds them per solve, the
    others by identity, kept alive in the memo).

    `exchange`: the grouped ops (`exchange_nodes` of `space`), into and out of whose
    expert-parallel strategies an activation may move from one split to another over the
    axes (`gathers_rows`)."""
    exchange = exchange or {}
    if not gather_free_axes:
        return space
    derived = graph.parameter_derived()
    key = None
    if memo is not None:
        key = (gather_free_axes, gloo, len(graph.nodes), tuple(sorted(exchange.items())),
               tuple(0 if i in derived else options if graph[i].op == "placeholder" else id(options)
                     for i, options in enumerate(space.strategies)))
        if key in memo:
            return _replay(memo[key][0], space, memo)
    reshards = None
    if memo is not None:  # its answers are pure in (shape, dtype, layouts): shared by the search's passes
        reshards = memo.get(("reshards", space.mesh_shape, gather_free_axes, gloo))
    if reshards is None:
        reshards = _GatherFreeReshards(space.mesh_shape, gather_free_axes, gloo=gloo)
        if memo is not None:
            memo[("reshards", space.mesh_shape, gather_free_axes, gloo)] = reshards
    try:
        kept = _surviving_strategies(graph, space, derived, reshards, exchange)
    except InfeasiblePlanError as blocked:
        if key is not None:
            memo[key] = (blocked, space.strategies)  # the lists stay alive: their ids key the memo
        raise
    if all(len(k) == len(options) for k, options in zip(kept, space.strategies)):
        if key is not None:
            memo[key] = (None, space.strategies)
        return space
    if key is not None:  # derived nodes keep the caller's lists (the pass never reads or changes them)
        memo[key] = ([None if i in derived else k for i, k in enumerate(kept)], space.strategies)
        return _replay(memo[key][0], space, memo)
    return StrategySpace(mesh_shape=space.mesh_shape, strategies=tuple(tuple(options[j] for j in k)
                                                                       for k, options in zip(kept, space.strategies)),
                         fallback_ops=space.fallback_ops, follows=space.follows)


def _replay(kept: list[list[int] | None] | InfeasiblePlanError | None, space: StrategySpace,
            memo: dict) -> StrategySpace:
    """A memoised pass applied to `space`: its error raised again, `space` itself where it
    pruned nothing, else the strategies it kept (None: the node's list unchanged). A kept
    sublist is built once per (list, indices) and then shared (`memo`), so the solves that
    replay one pass see the same list objects, which later per-list memos key by identity
    (cost_model/table.py cost_table's `memo`)."""
    if isinstance(kept, InfeasiblePlanError):
        raise InfeasiblePlanError(str(kept))
    if kept is None:
        return space

    def sublist(options: tuple, k: list[int]) -> tuple:
        key = ("kept", id(options), tuple(k))
        if key not in memo:  # the list is kept alive beside its sublist: its id stays its own
            memo[key] = (options, tuple(options[j] for j in k))
        return memo[key][1]

    return StrategySpace(mesh_shape=space.mesh_shape, strategies=tuple(
        options if k is None else sublist(options, k)
        for k, options in zip(kept, space.strategies)), fallback_ops=space.fallback_ops,
        follows=space.follows)


class _GatherFreeReshards:
    """Which reshards keep activations split on the gather-free axes: a memo of DTensor's
    planner by (shape, dtype, source, destination), with placements interned as ints
    (hashing placement objects dominated the pass). Its answers depend on the mesh, the
    axes and the backend only, so one search shares it between its passes on one mesh
    (prune_gather_free's `memo`), and a strategy list's interned layouts are kept by the
    list's identity (`layouts_of`: layer twins and the solves of one space share lists)."""

    def __init__(self, mesh: tuple[int, ...], gather_free_axes: tuple[int, ...], *, gloo: bool) -> None:
        self.mesh, self.gather_free_axes, self.gloo = mesh, gather_free_axes, gloo
        self.ids: dict[Placements, int] = {}
        self.layouts: list[Placements] = []
        self.compatible: dict[tuple, bool] = {}
        self.reach: dict[tuple, frozenset[int]] = {}
        self.by_list: dict[int, tuple[tuple, list, list]] = {}
        """id(strategy list) -> (the list, kept alive so its id stays its own; per strategy
        its interned output layouts; its interned input layouts)."""

    def layouts_of(self, options: tuple) -> tuple[list, list]:
        """(per strategy, its outputs' layout ids; per strategy, its inputs' layout ids)."""
        found = self.by_list.get(id(options))
        if found is None:
            found = self.by_list[id(options)] = (
                options, [tuple(self.intern(o) for o in st.outputs) for st in options],
                [tuple(self.intern(x) for x in st.inputs) for st in options])
        return found[1], found[2]

    def intern(self, pl: Placements) -> int:
        i = self.ids.get(pl)
        if i is None:
            i = self.ids[pl] = len(self.layouts)
            self.layouts.append(pl)
        return i

    def reachable(self, meta: Any, produced: frozenset[int], need: frozenset[int],
                  exchange: bool = False) -> frozenset[int]:
        """The layouts of `need` that some layout of `produced` reshards to (`ok`), memoised:
        layer twins and the fixed point's later sweeps ask again."""
        key = (meta.shape, meta.dtype, produced, need, exchange)
        found = self.reach.get(key)
        if found is None:
            found = self.reach[key] = frozenset(d for d in need if any(self.ok(meta, s, d, exchange)
                                                                       for s in produced))
        return found

    def ok(self, meta: Any, src: int, dst: int, exchange: bool = False) -> bool:
        if src == dst:
            return True
        key = (meta.shape, meta.dtype, src, dst, exchange)
        found = self.compatible.get(key)
        if found is None:
            a, b = self.layouts[src], self.layouts[dst]
            steps = reshard_collectives(meta, a, b, self.mesh, gloo=self.gloo)
            found = self.compatible[key] = steps is not None and not any(
                gathers_rows(c, a, b, self.gather_free_axes, exchange) for c in steps)
        return found


def _layer_twins(graph: Graph) -> dict[NodeId, list[NodeId]]:
    """Per node of a repeated layer: the nodes at its position in every layer of its group
    (reduce_graph gives them one choice together)."""
    twins: dict[NodeId, list[NodeId]] = {}
    for group in graph.layer_groups:
        for k in range(len(group.nodes[0])):
            members = [layer[k] for layer in group.nodes]
            for nid in members:
                twins[nid] = members
    return twins


def _activation_edges(graph: Graph, derived: frozenset[NodeId]) -> list[list[tuple[int, int, int, bool]]]:
    """Per node: (input position, producer, producer's output index, priced as a reshard)
    for each input not derived from a parameter; a getitem reads its producer's output as
    produced (reduce_graph ties it to its producer's choice), so it is no reshard."""
    edges: list[list[tuple[int, int, int, bool]]] = [[] for _ in graph.nodes]
    for node in graph.nodes:
        for p, u in enumerate(node.inputs):
            if u in derived:
                continue
            if len(graph[u].outputs) == 1:
                edges[node.id].append((p, u, 0, True))
            elif node.op == "getitem":
                edges[node.id].append((p, u, graph[u].output_position(node.args[1]), False))
    return edges


def _surviving_strategies(graph: Graph, space: StrategySpace, derived: frozenset[NodeId],
                          reshards: _GatherFreeReshards, exchange: Exchange) -> list[list[int]]:
    """Per node, the indices of the strategies some plan can still use: the fixed point of
    dropping a strategy whose input no remaining producer strategy reaches (prune_gather_free).
    Raises the InfeasiblePlanError of a node left with none."""
    twins = _layer_twins(graph)
    ids = [reshards.layouts_of(options) for options in space.strategies]
    out_ids = [o for o, _ in ids]
    in_ids = [i for _, i in ids]
    edges = _activation_edges(graph, derived)
    kept: list[list[int]] = [list(range(len(options))) for options in space.strategies]
    changed = True
    while changed:  # in topological order, each node sees its producers' latest sets
        changed = False
        for node in graph.nodes:
            v = node.id
            alive = kept[v]
            for p, u, idx, reshard in edges[v]:
                produced = frozenset(out_ids[u][i][idx] for i in kept[u])
                need = frozenset(in_ids[v][j][p] for j in alive)
                if not reshard:
                    reachable = need & produced
                elif u in exchange or v in exchange:
                    reachable = _exchange_reachable(graph[u].output, reshards, produced, need, p, idx,
                                                    exchange.get(u), kept[u], out_ids[u], exchange.get(v), alive,
                                                    in_ids[v])
                else:
                    reachable = reshards.reachable(graph[u].output, produced, need)
                if isinstance(reachable, dict):  # per strategy of v
                    alive = [j for j in alive if reachable[j]]
                elif len(reachable) != len(need):
                    alive = [j for j in alive if in_ids[v][j][p] in reachable]
            if len(alive) == len(kept[v]):
                continue
            if not alive:
                raise _no_split_error(graph, node, reshards.gather_free_axes, space.mesh_shape)
            alive_set = set(alive)
            for n in twins.get(v, [v]):  # layer-shared nodes take one choice together
                kept[n] = [j for j in kept[n] if j in alive_set]
            changed = True
    return kept


def _exchange_reachable(meta: Any, reshards: _GatherFreeReshards, produced: frozenset[int], need: frozenset[int],
                        p: int, idx: int, ep_u: tuple[bool, ...] | None, kept_u: list[int], out_u: list,
                        ep_v: tuple[bool, ...] | None, alive: list[int], in_v: list) -> dict[int, bool]:
    """{strategy j of v: whether its input p is reachable} on an edge of a grouped op: a
    layout reached without moving a split, or by a move out of one of u's expert-parallel
    strategies, or by a move into one of v's."""
    plain = reshards.reachable(meta, produced, need)
    from_ep = frozenset()
    if ep_u is not None:
        from_ep = reshards.reachable(meta, frozenset(out_u[i][idx] for i in kept_u if ep_u[i]), need, True)
    into_ep = frozenset()
    if ep_v is not None:
        into_ep = reshards.reachable(meta, produced, frozenset(in_v[j][p] for j in alive if ep_v[j]), True)
    return {j: in_v[j][p] in plain or in_v[j][p] in from_ep or (ep_v is not None and ep_v[j] and in_v[j][p] in into_ep)
            for j in alive}


def _no_split_error(graph: Graph, node: Node, gather_free_axes: tuple[int, ...],
                    mesh: tuple[int, ...]) -> InfeasiblePlanError:
    """What prune_gather_free found: `node` cannot consume its inputs as they stay split on
    the data-parallel axes `gather_free_axes` of `mesh`."""
    where = f" in {node.module_path}" if node.module_path else ""
    shapes = ", ".join(str(tuple(graph[u].output.shape)) for u in dict.fromkeys(node.inputs)
                       if len(graph[u].outputs) == 1)
    axes = ", ".join(f"axis {a} ({mesh[a]} devices)" for a in gather_free_axes)
    return InfeasiblePlanError(
        f"{graph.model.name} has no plan on mesh {mesh} with its batch split over {axes}: "
        f"node {node.id} ({node.op}{where}, inputs {shapes}) has no DTensor strategy that keeps its input split "
        f"there, and gathering an activation on a data-parallel axis is not a plan (every device would compute "
        f"the same rows). {_cause(node.op)}")


def _cause(op: str) -> str:
    """Why such a node cannot keep the batch split, by what it is, and what to try."""
    name = op.split(".")[1] if op.count(".") >= 2 else op
    if any(word in name for word in ("view", "reshape", "flatten", "transpose", "permute", "expand")):
        return ("A reshape that merges the batch dim into a dim in front of it (time-major recurrent layers, a "
                "transpose before a flatten) is the usual cause. Use a smaller dp (the search tries the others), or "
                "keep the batch dim outermost before such a reshape")
    return (f"{name} reads every row of the batch at once (a sort over all tokens orders them by values of every "
            f"row), so no split of the batch computes it. Use a smaller dp, shard over tp instead (the search tries "
            f"the others), or compute it per sequence")
