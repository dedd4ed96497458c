"""Intra-op sharding ILP: choose every op's placements on a device mesh.

Where it sits: `solve_intra_op(graph, cluster, mesh_shape)` runs
strategies (solver/intra_op/space.py) -> prices (cost_model/table.py) -> simplification
(solver/intra_op/sharing.py) -> this ILP, and returns a frozen `IntraOpSolution`
(autopar/sharding.py) for the whole-plan search and codegen. Data, tensor, sequence and
ZeRO-3/FSDP parallelism are not special cases: they are what the minimum below picks.

Math. O = owner nodes (after layer sharing and following), S_o = strategies of o,
x[o,j] in {0,1} picks strategy j of o; a followed node n is at strategy smap_n(j) of its
owner o(n); w_n = graph.weight(n) (multiplicity of repeated layers).

    minimise   sum_o sum_j c[o,j] x[o,j]  +  sum_(a,b) sum_(r,k) C_ab[r,k] e_ab[r,k]

    c[o,j]   = sum_{n: o(n)=o} w_n (compute(n, smap_n(j)) + comm(n, smap_n(j)) + u(n, smap_n(j)))
               + resharding on edges inside one owner (a follower chain) at j
               (the objective also carries TIE_BREAK_S per collective and
               MEMORY_TIE_BREAK_S_PER_BYTE per activation byte; reported costs do not)
    u(p, s)  = for a parameter whose strategy s computes in one placement and updates in
               another (NodeStrategy.update: weight-update sharding, Xu et al. 2020), the
               all-gather of its updated weights from the update placement back to the
               compute placement, once per step (weighted like the gradient sync; a
               layer's weights travel in one flat all-gather, each paying its share of
               the latency: `_add_update_gathers`); 0 for every other node
    C_ab     = sum over graph edges u->v with o(u)=a, o(v)=b of w_v reshard(u->v), plus
               for each (parameter p, gradient g) the edge g->p, priced as resharding the
               gradient into its parameter's weight-update placement (all-reduce from
               Partial = data parallel, reduce-scatter into a Shard = ZeRO-1/2 where the
               compute placement is replicated, ZeRO-3/FSDP where it is the same shard):
               forward/backward consistency is a cost, so it can never make the problem
               infeasible.
               Rows r and columns k are classes of identical rows/columns of the matrix.

    one_choice/o:     sum_j x[o,j] = 1
    edge/a->b/row=r:  sum_k e_ab[r,k] = sum_{j in class r} x[a,j]       (Alpa-style;
    edge/a->b/col=k:  sum_r e_ab[r,k] = sum_{j in class k} x[b,j]        e continuous >= 0)
    memory/t=T:       sum_{n live at T} w_n mem(n, smap_n(j)) x[o(n),j] <= budget

    forbid/o/j:       x[o,j] = 0 where a strategy needs a reshard DTensor cannot do
                      (a shard into a pending sum) on an edge inside one owner or on a
                      separable edge; on other edges the pair's e variable is absent.

Gradient edges are weighted by `grad_sync_weight` (1/m with m microbatches: the program
reduces accumulated gradients once per step, the rest of the graph runs m times; the
objective is per microbatch). With `num_microbatches` (a one-stage step), each
parameter's strategy also carries the once-per-step terms the step price adds
(solver/spmd_search.py `estimate`), over m: the optimizer step over its update shard and
(on its gradient's strategies) the microbatches' accumulation into the raw gradient as
the backward leaves it (cost_model.optimizer_time_s, grad_accumulation_time_s), so the ILP minimises the step
time it reports, not only the per-microbatch part (a plan keeping a few more parameters
replicated for a smaller per-microbatch cost paid more optimizer time than it saved). Placeholder restrictions (`restrict_placeholders`) express
a forced configuration (data parallel over an axis, ZeRO, no tensor parallelism) by
removing placeholder strategies: infeasible options are absent, not expensive.

The row/column sums force e_ab to the outer product of the two one-hot rows, so the
edge term is exact without McCormick rows. An edge whose matrix has one row class (or
one column class) is separable and folds into c. Memory: parameters count
their state bytes at every T (master weight and optimizer state divided by the shard factor of
the update placement, compute copy and gradient by that of the compute placement, in the
dtypes of the precision policy: cost_model/memory.py `parameter_state_bytes`); activations count from their producer to their last user (views
alias their base). T ranges over the MEMORY_POINTS times with the largest replicated
live bytes (the forward/backward boundary among them): sharding scales tensors
unevenly, so this is a heuristic for the true peak, exact at the checked points.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import replace

import pulp

from typing import Any, Callable, Sequence

from autopar.cluster import Cluster
from autopar.ir import Graph, Node, NodeId, Role
from autopar.placement import Placements, Replicate, is_partial
from autopar.sharding import (
    CostBreakdown,
    InfeasiblePlanError,
    IntraOpSolution,
    NodeChoice,
    PricedCollective,
    StrategySpace,
)
from autopar.buckets import UPDATE_PHASE, gather_group, gather_share, gradient_bucket_key, plan_buckets
from cost_model import (
    CostTable,
    ReshardPricer,
    bucket_copy_s_per_byte,
    cost_table,
    reshard_collectives,
    runs_gloo,
)
from solver.intra_op.sharing import Reduction, reduce_graph
from solver.intra_op.space import enumerate_strategies

PlaceholderFilter = Callable[[Node, Placements], bool]
"""keep(placeholder node, its placements): which layouts a forced configuration allows."""

UpdateFilter = Callable[[Node, Placements, Placements], bool]
"""keep(parameter node, compute placements, update placements): which weight-update
placements a forced configuration allows (the update equal to the compute placement is
offered to it too)."""


def _release_import_frames(package: Any) -> int:
    """Drop the tracebacks of the exceptions `package`'s modules keep from their import.

    PuLP probes optional solvers when it is imported and keeps each failure as a class
    attribute (`COPT_DLL.err`, `CPLEX_PY.err`) to show when that solver is asked for. A
    traceback holds its frames, and every frame its caller (`f_back`): the whole stack of
    the first `import pulp` stays alive for the process's life. That import happens lazily
    inside the first solve, so a pipeline rank that solved its chunk kept its build's
    locals (the user's model, the split pipeline: about two copies of the weights) after
    the build returned. The messages stay; only the frames go. Returns how many were cut."""
    cut = 0
    prefix = package.__name__ + "."
    for name, module in list(sys.modules.items()):
        if module is None or not (name == package.__name__ or name.startswith(prefix)):
            continue
        for value in list(vars(module).values()):
            holders = [value] if isinstance(value, BaseException) else \
                [v for v in vars(value).values() if isinstance(v, BaseException)] if isinstance(value, type) else []
            for exc in holders:
                if exc.__traceback__ is not None:
                    exc.__traceback__ = None
                    cut += 1
    return cut


_release_import_frames(pulp)

log = logging.getLogger(__name__)

OBJECTIVE_SCALE = 1e6
"""The ILP objective is in microseconds: second-sized coefficients (1e-9..1) sit below
the solvers' default tolerances."""

MEMORY_SCALE = 1.0 / 2**20
"""Memory rows are written in MiB for the same reason."""

LP_SIMPLEX_TIME_S = 3.0
"""The LP relaxation's simplex gets this long before the interior point takes over
(`_solve`): every relaxation of the 70B / 405B searches that the simplex finishes takes
under 0.5 s here, the ones it struggles on run 30 s or more."""

MEMORY_POINTS = 4
"""Liveness points checked by memory rows (largest replicated live bytes first)."""

TIE_BREAK_S = 1e-10
"""Added to the objective (not to reported costs) per collective an edge needs: among
equal-time plans prefer fewer collectives (an all-reduce over reduce-scatter + all-gather)."""

MEMORY_TIE_BREAK_S_PER_BYTE = 1e-19
"""Added to the objective (not to reported costs) per byte of a non-parameter tensor:
among equal-time plans prefer sharded activations and inputs (an input placeholder is
free to arrive replicated or sharded; 1 GiB weighs 1e-10 s). Parameters have none, so
that TIE_BREAK_S alone decides between data parallel and ZeRO when their times tie."""

SOLVER_SEED = 0
REL_GAP = 1e-9
"""Solve to proven optimality (default MIP gaps of 1e-4 would let the oracle tests drift)."""

SOLVERS = ("highs", "cbc")

INTEGRALITY_TOL = 1e-6


class CutoffExceeded(Exception):
    """The LP relaxation proved the ILP's objective (per microbatch) at least the caller's
    `cutoff_s` (solve_intra_op): branch and bound was skipped. The whole-plan search prunes
    with it: a candidate whose bound already loses to the plans found so far is not solved
    exactly."""

    def __init__(self, lower_bound_s: float, cutoff_s: float) -> None:
        super().__init__(f"LP relaxation bound {lower_bound_s:.6g} s >= cutoff {cutoff_s:.6g} s")
        self.lower_bound_s = lower_bound_s
        self.cutoff_s = cutoff_s
"""An LP-relaxation value this close to 0 or 1 counts as integral."""


def _num_collectives(src: Placements, dst: Placements) -> int:
    """Axes whose change needs communication (R->anything is local)."""
    return sum(1 for a, b in zip(src, dst) if a != b and not isinstance(a, Replicate) and not is_partial(b))


def restrict_placeholders(graph: Graph, space: StrategySpace, keep: PlaceholderFilter | None,
                          keep_update: UpdateFilter | None = None) -> StrategySpace:
    """A new space whose placeholders keep only the layouts `keep` allows, and whose
    parameters keep only the weight-update placements `keep_update` allows (at least one
    must remain per placeholder: the caller's filters must allow some layout)."""
    strategies = []
    for node, options in zip(graph.nodes, space.strategies):
        if node.op == "placeholder":
            kept = tuple(s for s in options if (keep is None or keep(node, s.outputs[0])) and (
                keep_update is None or node.role is not Role.PARAMETER
                or keep_update(node, s.outputs[0], s.update_placements)))
            if not kept:
                raise ValueError(f"the forced configuration leaves no layout for {node.role.value} "
                                 f"{node.param_name or node.name} of shape {node.output.shape} on mesh "
                                 f"{space.mesh_shape}; choose degrees that divide its dims")
            options = kept
        strategies.append(options)
    return StrategySpace(mesh_shape=space.mesh_shape, strategies=tuple(strategies),
                         fallback_ops=space.fallback_ops, follows=space.follows)


def prune_gather_free(graph: Graph, space: StrategySpace, gather_free_axes: tuple[int, ...], *,
                      gloo: bool, memo: dict | None = None) -> StrategySpace:
    """`space` without the strategies no plan can use under `gather_free_axes`: a node's
    strategy goes when one of its activation inputs (an edge `_edge_matrices` prices, from
    a tensor not derived from a parameter) has no remaining producer strategy that DTensor
    can reshard to it without an all-gather or all-to-all on such an axis (the edges
    `_edge_matrices` forbids): no plan loses a strategy it could use. Propagated in
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
    others by identity, kept alive in the memo)."""
    if not gather_free_axes:
        return space
    mesh = space.mesh_shape
    derived = graph.parameter_derived()
    key = None
    if memo is not None:
        key = (gather_free_axes, gloo, len(graph.nodes),
               tuple(0 if i in derived else options if graph[i].op == "placeholder" else id(options)
                     for i, options in enumerate(space.strategies)))
        if key in memo:
            kept_hit = memo[key][0]
            if isinstance(kept_hit, InfeasiblePlanError):
                raise InfeasiblePlanError(str(kept_hit))
            if kept_hit is None:
                return space
            return StrategySpace(mesh_shape=mesh, strategies=tuple(
                options if k is None else tuple(options[j] for j in k)
                for k, options in zip(kept_hit, space.strategies)), fallback_ops=space.fallback_ops,
                follows=space.follows)
    twins: dict[NodeId, list[NodeId]] = {}
    for group in graph.layer_groups:
        for k in range(len(group.nodes[0])):
            members = [layer[k] for layer in group.nodes]
            for nid in members:
                twins[nid] = members
    # placements interned as ints (hashing placement objects dominated the pass)
    ids: dict[Placements, int] = {}
    layouts: list[Placements] = []

    def intern(pl: Placements) -> int:
        i = ids.get(pl)
        if i is None:
            i = ids[pl] = len(layouts)
            layouts.append(pl)
        return i

    out_ids = [[tuple(intern(o) for o in st.outputs) for st in options] for options in space.strategies]
    in_ids = [[tuple(intern(x) for x in st.inputs) for st in options] for options in space.strategies]
    compatible: dict[tuple, bool] = {}

    def ok(meta, src: int, dst: int) -> bool:
        if src == dst:
            return True
        key = (meta.shape, meta.dtype, src, dst)
        found = compatible.get(key)
        if found is None:
            steps = reshard_collectives(meta, layouts[src], layouts[dst], mesh, gloo=gloo)
            found = compatible[key] = steps is not None and not any(
                c.axis in gather_free_axes and c.kind in ("all_gather", "all_to_all") for c in steps)
        return found

    edges: list[list[tuple[int, int, int, bool]]] = [[] for _ in graph.nodes]  # (position, producer, output, reshard)
    for node in graph.nodes:
        for p, u in enumerate(node.inputs):
            if u in derived:
                continue
            if len(graph[u].outputs) == 1:
                edges[node.id].append((p, u, 0, True))
            elif node.op == "getitem":  # read as produced: reduce_graph ties it to its producer's choice
                edges[node.id].append((p, u, graph[u].output_position(node.args[1]), False))
    kept: list[list[int]] = [list(range(len(options))) for options in space.strategies]
    changed = True
    while changed:  # in topological order, each node sees its producers' latest sets
        changed = False
        for node in graph.nodes:
            v = node.id
            alive = kept[v]
            for p, u, idx, reshard in edges[v]:
                produced = {out_ids[u][i][idx] for i in kept[u]}
                need = {in_ids[v][j][p] for j in alive}
                if reshard:
                    meta = graph[u].output
                    reachable = {d for d in need if any(ok(meta, s, d) for s in produced)}
                else:
                    reachable = need & produced
                if len(reachable) != len(need):
                    alive = [j for j in alive if in_ids[v][j][p] in reachable]
            if len(alive) == len(kept[v]):
                continue
            if not alive:
                blocked = _no_split_error(graph, node, gather_free_axes, mesh)
                if key is not None:
                    memo[key] = (blocked, space.strategies)  # the lists stay alive: their ids key the memo
                raise blocked
            alive_set = set(alive)
            for n in twins.get(v, [v]):  # layer-shared nodes take one choice together
                kept[n] = [j for j in kept[n] if j in alive_set]
            changed = True
    if all(len(k) == len(options) for k, options in zip(kept, space.strategies)):
        if key is not None:
            memo[key] = (None, space.strategies)
        return space
    if key is not None:  # derived nodes keep the caller's lists (the pass never reads or changes them)
        memo[key] = ([None if i in derived else k for i, k in enumerate(kept)], space.strategies)
    return StrategySpace(mesh_shape=mesh, strategies=tuple(tuple(options[j] for j in k)
                                                           for k, options in zip(kept, space.strategies)),
                         fallback_ops=space.fallback_ops, follows=space.follows)


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
        f"the same rows). A reshape that merges the batch dim into a dim in front of it (time-major recurrent "
        f"layers, a transpose before a flatten) is the usual cause. Use a smaller dp (the search tries the "
        f"others), or keep the batch dim outermost before such a reshape")


def param_gather_bytes(graph: Graph) -> dict[tuple[int | None, str], float]:
    """Per (consumer layer, phase): the bytes of the distinct parameter-derived tensors
    (a weight, its transpose, a cast of it) that compute ops there consume, the size of
    that group's gathers when each is gathered once, before its compute op (autopar/buckets.py gather_group; each member pays its
    share of one latency)."""
    derived = graph.parameter_derived()
    seen: dict[tuple[int | None, str], dict[NodeId, float]] = {}
    for v in graph.nodes:
        if v.id in derived:
            continue  # a view or cast of a weight: its consumer reads the weight (counted there)
        for u in v.inputs:
            if u in derived and len(graph[u].outputs) == 1:
                seen.setdefault((v.layer, v.phase.value), {})[u] = graph[u].output.size_bytes
    return {k: sum(d.values()) for k, d in seen.items()}


def expected_bucket_bytes(graph: Graph) -> dict[NodeId, tuple[float, float]]:
    """Per gradient: the bytes of the bucket it is expected to travel in, as an all-reduce
    and as a reduce-scatter: the buckets autopar/buckets.py forms (the same items and order
    as `gradient_sync_collectives`: all-reduces fill DDP-sized buckets over the whole
    model, reduce-scatters one bucket per layer) if every gradient is synced the same way.
    What the ILP's objective charges a gradient's share of a bucket's latency against,
    before the placements (and so the real buckets) are known; where every gradient does
    sync one way (a 1-D data-parallel mesh, say) it is the real bucket. A small model's
    gradients fill one bucket, which still runs one collective."""
    grads = [g for _p, g in graph.param_grads]
    expected: dict[NodeId, list[float]] = {g: [0.0, 0.0] for g in grads}
    for k, (key_of, weighted) in enumerate(((lambda g: "all", True), (lambda g: ("layer", graph[g].layer), False))):
        items = [(key_of(g), graph.grad_meta(g).size_bytes * (graph.weight(g) if weighted else 1.0)) for g in grads]
        for bucket in plan_buckets(items):
            size = sum(items[i][1] for i in bucket)
            for i in bucket:
                expected[grads[i]][k] = size
    return {g: (a, b) for g, (a, b) in expected.items()}


def param_gather_uses(graph: Graph) -> dict[tuple[NodeId, int | None, str], int]:
    """Per (parameter-derived tensor, consumer layer, phase): how many input edges read it
    there. The runtime gathers a tensor once per group (codegen/apply.py `_gather_groups`
    keys members by tensor and placements), so a tensor read twice in one phase (a norm
    weight under full recompute: the recomputed forward and the backward) pays one gather."""
    derived = graph.parameter_derived()
    uses: dict[tuple[NodeId, int | None, str], int] = {}
    for v in graph.nodes:
        for u in v.inputs:
            if u in derived and len(graph[u].outputs) == 1:
                key = (u, v.layer, v.phase.value)
                uses[key] = uses.get(key, 0) + 1
    return uses


def _edge_matrices(graph: Graph, space, red: Reduction, pricer: ReshardPricer,
                   node_coef: dict[NodeId, list[float]], forbidden: dict[NodeId, set[int]], *,
                   grad_sync_weight: float = 1.0, gather_free_axes: tuple[int, ...] = (),
                   prices: tuple[dict, dict, dict] | None = None
                   ) -> dict[tuple[NodeId, NodeId], list[list[float | None]]]:
    """Resharding cost per owner pair (a, b) as a matrix over (j_a, j_b) (None: DTensor
    cannot reshard, or it would gather an activation on a `gather_free_axes` axis); folds
    same-owner edges into node costs or `forbidden` choices. `prices`: the (intern, pair,
    matrix) price memos of earlier solves with the same pricer and axes (a search's solves
    of one submesh share them: every key holds the tensor and both layouts it prices)."""
    active = set(red.active)
    from_params = graph.parameter_derived() if gather_free_axes else frozenset()
    edges: dict[tuple[NodeId, NodeId], list[list[float | None]]] = {}
    # Layer-shared edges repeat the same (tensor, placements) matrix, and placements repeat
    # within one: price each distinct pair once, keyed by small ints (hashing placement
    # dataclasses dominated the build).
    intern: dict[Placements, int]
    pair_cost: dict[tuple, float]
    matrices: dict[tuple, list[list[float]]]
    intern, pair_cost, matrices = prices if prices is not None else ({}, {}, {})

    group_bytes = param_gather_bytes(graph)
    gather_uses = param_gather_uses(graph)
    derived = graph.parameter_derived()
    expected_buckets = expected_bucket_bytes(graph)

    def priced(meta, s: Placements, d: Placements, activation: bool, grad: bool,
               share: float | None = None, uses: int = 1) -> float | None:
        i, k = intern.setdefault(s, len(intern)), intern.setdefault(d, len(intern))
        if i == k:
            return 0.0
        key = (meta.shape, meta.strides, meta.dtype, i, k, activation, grad, share, uses)
        if key not in pair_cost:
            t = pricer.grad_sync_time(meta, s, d, bucket_bytes=share) if grad else pricer(meta, s, d) \
                if share is None else pricer.gather_time(meta, s, d, share)
            if t is not None and uses > 1 and pricer.gather_axis(meta, s, d) is not None:
                # read `uses` times in its group, gathered once: each read pays its part (exact
                # where every reader asks for the same placement; _extract prices the program)
                t /= uses
            if t is not None and activation and any(
                    c.axis in gather_free_axes and c.kind in ("all_gather", "all_to_all")
                    for c in pricer.collectives(meta, s, d) or ()):
                t = None
            pair_cost[key] = None if t is None else t + TIE_BREAK_S * _num_collectives(s, d)
        return pair_cost[key]

    def add(u: NodeId, v: NodeId, meta, src_of, dst_of, weight: float, grad: bool = False) -> None:
        activation = bool(gather_free_axes) and u not in from_params and not grad
        share, uses = None, 1
        if grad:
            share = expected_buckets[u]
        elif u in derived:
            share = gather_share(meta.size_bytes, group_bytes[(graph[v].layer, graph[v].phase.value)])
            uses = gather_uses[(u, graph[v].layer, graph[v].phase.value)]
        a, b = red.owner[u], red.owner[v]
        if a == b:
            coef = node_coef[a]
            for j in range(len(coef)):
                c = priced(meta, src_of(red.smap[u][j]), dst_of(red.smap[v][j]), activation, grad, share, uses)
                if c is None:
                    forbidden.setdefault(a, set()).add(j)
                else:
                    coef[j] += weight * c
            return
        src = tuple(src_of(j) for j in red.smap[u])
        dst = tuple(dst_of(j) for j in red.smap[v])
        key = (meta.shape, meta.strides, meta.dtype, src, dst, activation, grad, share, uses)
        unit = matrices.get(key)
        if unit is None:  # price each distinct (source, target) layout pair once
            us, ud = list(dict.fromkeys(src)), list(dict.fromkeys(dst))
            distinct = {(a, b): priced(meta, a, b, activation, grad, share, uses) for a in us for b in ud}
            unit = matrices[key] = [[distinct[(a, b)] for b in dst] for a in src]
        matrix = edges.get((a, b))
        if matrix is None:
            edges[(a, b)] = [[None if c is None else weight * c for c in row] for row in unit]
            return
        for row, unit_row in zip(matrix, unit):
            for jb, c in enumerate(unit_row):
                if c is None or row[jb] is None:
                    row[jb] = None
                elif c:
                    row[jb] += weight * c

    for v in red.active:
        node = graph[v]
        for p, u in enumerate(node.inputs):
            if u not in active or len(graph[u].outputs) != 1:
                continue
            add(u, v, graph[u].output, lambda j, u=u: space[u][j].outputs[0],
                lambda j, v=v, p=p: space[v][j].inputs[p], graph.weight(v))
    for param, grad in graph.param_grads:
        if param in active and grad in active:
            add(grad, param, graph.grad_meta(grad), lambda j, g=grad: space[g][j].outputs[0],
                lambda j, q=param: space[q][j].update_placements, graph.weight(grad) * grad_sync_weight, grad=True)
    for buf, value in graph.buffer_updates:  # a buffer's new value, written back every microbatch
        if buf in active and value in active:
            add(value, buf, graph[value].output, lambda j, u=value: space[u][j].outputs[0],
                lambda j, b=buf: space[b][j].outputs[0], graph.weight(value))
    return edges


def _classes(vectors: list[tuple[float, ...]]) -> list[list[int]]:
    groups: dict[tuple[float, ...], list[int]] = {}
    for i, vec in enumerate(vectors):
        groups.setdefault(vec, []).append(i)
    return list(groups.values())


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


def _memory_terms(graph: Graph, space, table: CostTable, red: Reduction) -> list[tuple[int, dict[NodeId, list[float]]]]:
    """Per checked time point T: coefficients mem[o][j] of the live bytes at T."""
    static, live, end = live_intervals(graph, red.active)
    # replicated profile via a sweep over interval starts/ends
    delta: dict[int, float] = defaultdict(float)
    for n in live:
        full = graph.weight(n) * graph[n].output.size_bytes
        delta[n] += full
        delta[end[n] + 1] -= full
    profile, running = {}, 0.0
    for t in red.active:
        running += delta.get(t, 0.0)
        profile[t] = running
    points = sorted(sorted(profile, key=lambda t: (-profile[t], t))[:MEMORY_POINTS])
    terms = []
    for t in points:
        coef: dict[NodeId, list[float]] = {}
        for n in static + [m for m in live if m <= t <= end[m]]:
            o = red.owner[n]
            row = coef.setdefault(o, [0.0] * len(red.smap[o]))
            w = graph.weight(n)
            for j, s in enumerate(red.smap[n]):
                row[j] += w * table.nodes[n][s].memory_bytes
        terms.append((t, coef))
    return terms


def _make_solver(solver: str, time_limit_s: float | None, *, msg: bool = False) -> pulp.LpSolver:
    if solver == "highs":
        return pulp.HiGHS(msg=msg, threads=1, timeLimit=time_limit_s, gapRel=REL_GAP, random_seed=SOLVER_SEED)
    if solver == "cbc":
        # COIN_CMD (PULP_CBC_CMD is deprecated in PuLP 3.3): a cbc on PATH, else PuLP's bundled one
        path = shutil.which("cbc") or pulp.apis.coin_api.pulp_cbc_path
        return pulp.COIN_CMD(path=path, msg=msg, threads=1, timeLimit=time_limit_s, gapRel=REL_GAP,
                             options=[f"randomSeed {SOLVER_SEED + 1}", f"randomCbcSeed {SOLVER_SEED + 1}"])
    raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")


_BANNER_SILENCED = False


def _silence_highs_banner() -> None:
    """HiGHS >= 1.16 prints a two-line banner on stdout from the first C++ `Highs` object a
    process makes, whatever `output_flag` says (PuLP sets it after construction), and
    never again. That first object is made here, once, with fd 1 on /dev/null, so the
    user sees only autopar's own lines."""
    global _BANNER_SILENCED
    if _BANNER_SILENCED:
        return
    _BANNER_SILENCED = True
    try:
        import highspy
    except ImportError:  # PuLP's HiGHS needs it; the solve reports that itself
        return
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    try:
        highspy.Highs()
    finally:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).fflush(None)
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


@contextlib.contextmanager
def _native_stdout_to_stderr() -> Any:
    """Native writes to stdout (fd 1) go to stderr meanwhile, HiGHS's banner nowhere
    (_silence_highs_banner): solver output would corrupt `autopar search --json` and plan
    files written to stdout. C stdio buffers stdout when it is a pipe, so it is flushed
    before fd 1 returns."""
    _silence_highs_banner()
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


def _solve(model: "_Model", solver: str, time_limit_s: float | None, cutoff_s: float | None = None) -> int:
    """Solve `model`, returning PuLP's solution status.

    HiGHS first solves the LP relaxation: the Alpa-style edge rows make it tight, and on
    the zoo models its optimum is usually integral, which proves it optimal for the ILP
    without MIP presolve and heuristics (about half the time on llama3-8b). Otherwise
    (or with CBC) the ILP is solved with branch and bound, unless the relaxation's
    objective (a lower bound of the ILP's) already reaches `cutoff_s`: CutoffExceeded.
    The relaxation runs the dual simplex without HiGHS's presolve, for at most
    LP_SIMPLEX_TIME_S, then HiGHS's interior point (with crossover: a vertex, so an
    integral optimum is still recognised). Why: on memory-bound instances (a 70B step whose
    activations barely miss the budget) presolve ran 30 s and gave up ("not solved") and
    the simplex without it took 31 s on some, where the interior point proves
    infeasibility in about 1 s; on the other instances the simplex without presolve is
    the fastest (0.2-0.3 s on llama3-70b's vs 0.4-0.7 s with presolve, 1.1-1.4 s interior
    point). The relaxation's optimum is the same either way."""
    start = time.perf_counter()
    if solver == "highs":
        simplex_s = LP_SIMPLEX_TIME_S if time_limit_s is None else min(LP_SIMPLEX_TIME_S, time_limit_s)
        with _native_stdout_to_stderr():
            model.prob.solve(pulp.HiGHS(mip=False, msg=False, threads=1, timeLimit=simplex_s,
                                        random_seed=SOLVER_SEED, presolve="off"))
        if model.prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionInfeasible):
            log.info("LP relaxation: simplex stopped after %.2f s (%s); interior point",
                     time.perf_counter() - start, pulp.LpStatus[model.prob.status])
            left = None if time_limit_s is None else max(1.0, time_limit_s - (time.perf_counter() - start))
            with _native_stdout_to_stderr():
                model.prob.solve(pulp.HiGHS(mip=False, msg=False, threads=1, timeLimit=left,
                                            random_seed=SOLVER_SEED, solver="ipm"))
        fractional = sum(1 for xs in model.x.values() for v in xs
                         if abs((v.varValue or 0.0) - round(v.varValue or 0.0)) > INTEGRALITY_TOL)
        log.info("LP relaxation: %s in %.2f s, %d fractional choice variables",
                 pulp.LpStatus[model.prob.status], time.perf_counter() - start, fractional)
        if model.prob.sol_status == pulp.LpSolutionOptimal and not fractional:
            return pulp.LpSolutionOptimal
        if model.prob.status == pulp.LpStatusInfeasible:
            return pulp.LpSolutionInfeasible  # no relaxed plan fits, so no integral one does
        if cutoff_s is not None and model.prob.sol_status == pulp.LpSolutionOptimal:
            # i14s: the tie-break terms (1e-10 s per collective) are far below this margin
            bound_s = (pulp.value(model.prob.objective) or 0.0) / OBJECTIVE_SCALE
            if bound_s >= cutoff_s * (1 + 1e-6):
                raise CutoffExceeded(bound_s, cutoff_s)
        if time_limit_s is not None:
            time_limit_s = max(1.0, time_limit_s - (time.perf_counter() - start))
    with _native_stdout_to_stderr():
        model.prob.solve(_make_solver(solver, time_limit_s))
    return model.prob.sol_status


def _fold_separable(edges: dict[tuple[NodeId, NodeId], list[list[float | None]]],
                    node_coef: dict[NodeId, list[float]], forbidden: dict[NodeId, set[int]]
                    ) -> dict[tuple[NodeId, NodeId], tuple]:
    """Edges whose matrix has one row class (cost depends on b only) or one column class
    (on a only) are added to node costs (an infeasible entry forbids that choice); the
    rest come back as (matrix, row classes, column classes) for edge variables.
    `node_coef` and `forbidden` are this solve's own tables (updated)."""
    kept = {}
    for (a, b), matrix in sorted(edges.items()):
        rows = _classes([tuple(r) for r in matrix])
        cols = _classes([tuple(c) for c in zip(*matrix)])
        if len(rows) == 1:
            for k, c in enumerate(matrix[0]):
                if c is None:
                    forbidden.setdefault(b, set()).add(k)
                else:
                    node_coef[b][k] += c
        elif len(cols) == 1:
            for j, row in enumerate(matrix):
                if row[0] is None:
                    forbidden.setdefault(a, set()).add(j)
                else:
                    node_coef[a][j] += row[0]
        else:
            kept[(a, b)] = (matrix, rows, cols)
    return kept


class _Model:
    """The PuLP problem, built one constraint family at a time."""

    def __init__(self, name: str, red: Reduction) -> None:
        self.prob = pulp.LpProblem(name, pulp.LpMinimize)
        self.x = {o: [self.prob.add_variable(f"x_{o}_{j}", cat=pulp.LpBinary) for j in range(len(red.smap[o]))]
                  for o in red.owners}
        self.objective: dict[pulp.LpVariable, float] = {}
        """One coefficient per variable (LpAffineExpression(list) keeps only the LAST
        coefficient of a repeated variable, so terms are summed here first)."""

    def add_one_choice_constraints(self) -> None:
        for o, xs in self.x.items():
            self.prob += pulp.lpSum(xs) == 1, f"one_choice/{o}"

    def add_node_costs(self, node_coef: dict[NodeId, list[float]]) -> None:
        for o, coef in node_coef.items():
            for j, c in enumerate(coef):
                if c:
                    var = self.x[o][j]
                    self.objective[var] = self.objective.get(var, 0.0) + c * OBJECTIVE_SCALE

    def add_forbidden_constraints(self, forbidden: dict[NodeId, set[int]]) -> None:
        for o, choices in sorted(forbidden.items()):
            for j in sorted(choices):
                self.prob += self.x[o][j] == 0, f"forbid/{o}/{j}"

    def add_edge_constraints(self, edges: dict[tuple[NodeId, NodeId], tuple]) -> int:
        """Edge variables and their row/column rows; returns the number of edge variables.
        Pairs DTensor cannot reshard (None) get no variable, so the sums exclude them."""
        count = 0
        for (a, b), (matrix, rows, cols) in edges.items():
            by_row: list[list[pulp.LpVariable]] = [[] for _ in rows]
            by_col: list[list[pulp.LpVariable]] = [[] for _ in cols]
            for r, rmembers in enumerate(rows):
                for k, cmembers in enumerate(cols):
                    c = matrix[rmembers[0]][cmembers[0]]
                    if c is None:
                        continue
                    var = self.prob.add_variable(f"e_{a}_{b}_{r}_{k}", lowBound=0)
                    by_row[r].append(var)
                    by_col[k].append(var)
                    count += 1
                    if c:
                        self.objective[var] = c * OBJECTIVE_SCALE
            xa, xb = self.x[a], self.x[b]
            for r, members in enumerate(rows):
                expr = pulp.LpAffineExpression([(v, 1.0) for v in by_row[r]] + [(xa[j], -1.0) for j in members])
                self.prob += expr == 0, f"edge/{a}->{b}/row={r}"
            for k, members in enumerate(cols):
                expr = pulp.LpAffineExpression([(v, 1.0) for v in by_col[k]] + [(xb[j], -1.0) for j in members])
                self.prob += expr == 0, f"edge/{a}->{b}/col={k}"
        return count

    def memory_expr(self, coef: dict[NodeId, list[float]]) -> pulp.LpAffineExpression:
        return pulp.LpAffineExpression([(self.x[o][j], m * MEMORY_SCALE) for o, row in sorted(coef.items())
                                        for j, m in enumerate(row) if m])

    def add_memory_constraints(self, terms, budget_bytes: float) -> None:
        for t, coef in terms:
            self.prob += self.memory_expr(coef) <= budget_bytes * MEMORY_SCALE, f"memory/t={t}"


def _min_memory_bytes(red: Reduction, terms, forbidden: dict[NodeId, set[int]], solver: str,
                      time_limit_s: float | None) -> float:
    """Smallest peak memory any plan reaches at the checked points (for error messages)."""
    m = _Model("min_memory", red)
    m.add_one_choice_constraints()
    m.add_forbidden_constraints(forbidden)
    peak = m.prob.add_variable("peak_mib", lowBound=0)
    m.prob += peak
    for t, coef in terms:
        m.prob += m.memory_expr(coef) <= peak, f"memory/t={t}"
    with _native_stdout_to_stderr():
        m.prob.solve(_make_solver(solver, time_limit_s))
    return float(peak.value()) / MEMORY_SCALE


def solve_intra_op(graph: Graph, cluster: Cluster, mesh_shape: tuple[int, ...], *,
                   memory_budget_bytes: float | None = None, solver: str = "highs",
                   time_limit_s: float | None = None, nodes: tuple[NodeId, ...] | None = None,
                   keep_placeholder: PlaceholderFilter | None = None, keep_update: UpdateFilter | None = None,
                   grad_sync_weight: float = 1.0,
                   gather_free_axes: tuple[int, ...] = (), space: StrategySpace | None = None,
                   cutoff_s: float | None = None, num_microbatches: int | None = None,
                   prune_memo: dict | None = None, grads_each_microbatch: bool = False) -> IntraOpSolution:
    """Optimal per-node placements of `graph` (or the subgraph `nodes`) on a `mesh_shape` mesh.

    `keep_placeholder` restricts placeholder layouts (a forced configuration), `keep_update`
    the parameters' weight-update placements;
    `grad_sync_weight` weighs the gradient reshards per microbatch (1/m);
    `gather_free_axes` are data-parallel axes on which activations are never gathered
    (so the batch stays split there). `space` reuses
    an enumeration of the same graph and mesh. Raises InfeasiblePlanError (a ValueError)
    when no plan fits `memory_budget_bytes`, with the smallest memory any plan needs.
    `cutoff_s` (HiGHS only): raise CutoffExceeded instead of branching when the LP
    relaxation proves the per-microbatch objective is at least this (the search's pruning).
    `num_microbatches` m: a one-stage step of m microbatches; gradient edges are weighted
    1/m and the once-per-step optimizer and accumulation terms join the objective / m
    (module docstring). `prune_memo`: shares `prune_gather_free` passes between solves.
    `grads_each_microbatch` (ZeRO-2): every microbatch syncs its gradients to their update
    placements (the edges weighed 1, not 1/m) and accumulates them there: the gradient
    bytes and the accumulation are the update shard's, not the raw gradient's.
    """
    if num_microbatches is not None:
        grad_sync_weight = 1.0 / num_microbatches
    if grads_each_microbatch:
        grad_sync_weight = 1.0
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    start = time.perf_counter()
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if space is None:
        space = enumerate_strategies(graph, mesh_shape)
    if keep_placeholder is not None or keep_update is not None:
        space = restrict_placeholders(graph, space, keep_placeholder, keep_update)
    if nodes is None:
        space = prune_gather_free(graph, space, gather_free_axes, gloo=runs_gloo(cluster.hardware),
                                  memo=prune_memo)
    table = cost_table(graph, space, cluster, grads_at_update=grads_each_microbatch)
    red = reduce_graph(graph, space, table, nodes)
    pricer = ReshardPricer(table.links, gloo=runs_gloo(cluster.hardware),
                           copy_s_per_byte=bucket_copy_s_per_byte(cluster))

    node_coef: dict[NodeId, list[float]] = {o: [0.0] * len(red.smap[o]) for o in red.owners}
    for n in red.active:
        w = graph.weight(n)
        coef, costs = node_coef[red.owner[n]], table.nodes[n]
        tie = 0.0 if graph[n].role is Role.PARAMETER else MEMORY_TIE_BREAK_S_PER_BYTE
        for j, s in enumerate(red.smap[n]):
            coef[j] += w * (costs[s].compute_s + costs[s].comm_s + tie * costs[s].memory_bytes)
    if num_microbatches is not None:
        _add_step_terms(graph, space, red, node_coef, cluster, mesh_shape, num_microbatches,
                        synced=grads_each_microbatch)
    forbidden: dict[NodeId, set[int]] = {}
    _add_update_gathers(graph, space, red, pricer, node_coef, forbidden, grad_sync_weight)
    prices = None
    if prune_memo is not None:  # the search's solves: edge prices depend on the pricer and axes only
        prices = prune_memo.setdefault(("edge prices", cluster.spec, cluster.hardware, mesh_shape, gather_free_axes,
                                        grads_each_microbatch), ({}, {}, {}))
    edges = _fold_separable(_edge_matrices(graph, space, red, pricer, node_coef, forbidden,
                                           grad_sync_weight=grad_sync_weight, gather_free_axes=gather_free_axes,
                                           prices=prices),
                            node_coef, forbidden)
    terms = _memory_terms(graph, space, table, red)
    built = time.perf_counter()

    model = _Model("intra_op", red)
    model.add_one_choice_constraints()
    model.add_forbidden_constraints(forbidden)
    model.add_node_costs(node_coef)
    num_edge_vars = model.add_edge_constraints(edges)
    if memory_budget_bytes is not None:
        model.add_memory_constraints(terms, memory_budget_bytes)
    model.prob += pulp.LpAffineExpression(model.objective)
    sol_status = _solve(model, solver, time_limit_s, cutoff_s)
    need = None
    if sol_status in (pulp.LpSolutionInfeasible, pulp.LpSolutionNoSolutionFound) and memory_budget_bytes is not None \
            and pulp.LpStatus[model.prob.status] != "Not Solved":
        need = _min_memory_bytes(red, terms, forbidden, solver, time_limit_s)
    if need is not None and need > memory_budget_bytes:
        # a smallest need within the budget means the other constraints have no solution
        # (the message below), not the memory
        raise InfeasiblePlanError(
            f"No intra-op plan fits {memory_budget_bytes / 2**30:.3f} GiB/device for {graph.model.name} on "
            f"{cluster.spec} with mesh {mesh_shape}; the smallest needs {need / 2**30:.3f} GiB "
            f"(parameters, gradients and optimizer state under {graph.model.precision.name} precision plus live "
            "activations). "
            "Raise the memory budget, use more devices or a smaller batch.",
            min_memory_bytes=need)
    if sol_status == pulp.LpSolutionOptimal:
        status = "optimal"
    elif sol_status == pulp.LpSolutionIntegerFeasible:
        status = "time_limit"
    elif sol_status == pulp.LpSolutionInfeasible:
        only_replicated = ", ".join(getattr(space, "fallback_ops", ())) or "none"
        raise InfeasiblePlanError(
            f"No placement of {graph.model.name}'s ops on mesh {mesh_shape} satisfies the constraints: a forced "
            f"configuration (inputs split over dp, activations never gathered on dp, parameter placements) or a "
            f"choice forbidden by DTensor. Ops with no sharded strategy (they need whole inputs): {only_replicated}. "
            "Drop the configuration flags and let the search choose, or use another mesh")
    else:
        raise RuntimeError(f"intra-op ILP ended with {pulp.LpStatus[model.prob.status]} "
                           f"(solution status {sol_status}) after {time.perf_counter() - start:.1f} s; "
                           f"time limit {time_limit_s} s. Raise --time-limit or check the log.")
    chosen = {o: max(range(len(xs)), key=lambda j: (xs[j].value() or 0.0, -j)) for o, xs in model.x.items()}
    solution = _extract(graph, space, table, red, pricer, chosen, terms, cluster, mesh_shape, memory_budget_bytes,
                        grad_sync_weight=grad_sync_weight, status=status, solver=solver,
                        grads_each_microbatch=grads_each_microbatch,
                        num_variables=sum(len(xs) for xs in model.x.values()) + num_edge_vars,
                        num_constraints=model.prob.numConstraints(),
                        solve_time_s=time.perf_counter() - start)
    objective_s = (pulp.value(model.prob.objective) or 0.0) / OBJECTIVE_SCALE
    log.info("intra-op %s on %s: %d owners of %d nodes, %d vars, %d rows; build %.2f s, total %.2f s; "
             "objective %.6g s (extracted %.6g s), %s",
             graph.model.name, mesh_shape, len(red.owners), len(red.active), solution.num_variables,
             solution.num_constraints, built - start, solution.solve_time_s, objective_s,
             solution.cost.total_s, status)
    return solution


def layer_parameter_bytes(graph: Graph) -> dict[int | None, float]:
    """Per layer (None: outside the layer stack): the bytes of its parameters, the group
    its updated weights are gathered in (autopar/buckets.py UPDATE_PHASE) where all of them
    are update-sharded on one axis: what a parameter's share of that group's latency is
    charged against before the placements are known (`_extract` prices the same shares)."""
    out: dict[int | None, float] = defaultdict(float)
    for p, _g in graph.param_grads:
        out[graph[p].layer] += graph[p].output.size_bytes
    return dict(out)


def update_gather(pricer: ReshardPricer, meta: Any, strategy: Any, group_bytes: float
                  ) -> tuple[float, list[Any]] | None:
    """(time, collectives) of bringing a parameter's updated weights from its update
    placement back to its compute placement, once per step ((0, []) where they are the
    same; None where DTensor cannot). A gather on one axis travels in its layer's group
    (one flat all-gather, codegen/apply.py `_WeightGather`): its bandwidth term, copies and
    its share of the group's latency against `group_bytes`."""
    if strategy.update is None or strategy.update == strategy.outputs[0]:
        return 0.0, []
    steps = pricer.collectives(meta, strategy.update, strategy.outputs[0])
    if steps is None:
        return None
    share = gather_share(meta.size_bytes, group_bytes)
    return pricer.gather_time(meta, strategy.update, strategy.outputs[0], share) or 0.0, list(steps)


def _add_update_gathers(graph: Graph, space, red: Reduction, pricer: ReshardPricer,
                        node_coef: dict[NodeId, list[float]], forbidden: dict[NodeId, set[int]],
                        grad_sync_weight: float) -> None:
    """Weight-update sharding: a parameter whose update runs in another placement than its
    compute (NodeStrategy.update) gathers its updated weights back once per step: weighted
    like the gradient sync (`grad_sync_weight`, 1/m of a per-microbatch objective), plus
    TIE_BREAK_S per collective (all-reduce over reduce-scatter + all-gather where equal)."""
    group_bytes = layer_parameter_bytes(graph)
    for node, coef, w, j, s in _parameter_options(graph, red, node_coef):
        got = update_gather(pricer, node.output, space[node.id][s], group_bytes.get(node.layer, 0.0))
        if got is None:
            forbidden.setdefault(red.owner[node.id], set()).add(j)
        elif got[1]:
            coef[j] += w * (got[0] * grad_sync_weight + TIE_BREAK_S * len(got[1]))


def _parameter_options(graph: Graph, red: Reduction, node_coef: dict[NodeId, list[float]]) -> Any:
    """(parameter node, its owner's coefficient row, its multiplicity, option j of the row,
    strategy index) for every option of every active parameter: where the once-per-step
    terms of a parameter's strategy are added."""
    for n in red.active:
        node = graph[n]
        if node.role is Role.PARAMETER:
            coef, w = node_coef[red.owner[n]], graph.weight(n)
            for j, s in enumerate(red.smap[n]):
                yield node, coef, w, j, s


def _add_step_terms(graph: Graph, space, red: Reduction, node_coef: dict[NodeId, list[float]], cluster: Cluster,
                    mesh_shape: tuple[int, ...], m: int, *, synced: bool = False) -> None:
    """(optimizer step over each parameter's update shard, on the parameter's strategies) +
    (gradient accumulation into each raw gradient as the backward leaves it, on the
    gradient's strategies: before the once-per-step sync a pending sum is whole; `synced`
    (ZeRO-2): into the synced gradient, on the parameter's update shard), / m: the terms
    spmd_search.estimate adds once per step."""
    from autopar.placement import shard_factor
    from cost_model import core_share, grad_accumulation_time_s, optimizer_time_s

    share, hw = core_share(cluster), cluster.hardware
    opt_per_element = optimizer_time_s(1.0, hw) * share / m
    acc_per_byte = grad_accumulation_time_s(1.0, m, 1, hw) * share / m
    active = set(red.active)
    grad_of = {p: g for p, g in graph.param_grads}
    for node, coef, w, j, s in _parameter_options(graph, red, node_coef):
        update = shard_factor(space[node.id][s].update_placements, mesh_shape)
        coef[j] += w * opt_per_element * node.output.numel / update
        if synced and grad_of.get(node.id) in active:
            g = grad_of[node.id]
            coef[j] += graph.weight(g) * acc_per_byte * graph.grad_meta(g).size_bytes / update
    for _param, grad in graph.param_grads:
        if grad not in active or synced:
            continue
        coef, w, size = node_coef[red.owner[grad]], graph.weight(grad), graph.grad_meta(grad).size_bytes
        for j, s in enumerate(red.smap[grad]):
            coef[j] += w * acc_per_byte * size / shard_factor(space[grad][s].outputs[0], mesh_shape)


def _gradient_buckets(graph: Graph, syncs: list[tuple[NodeId, Placements, Placements]], pricer: ReshardPricer
                      ) -> tuple[list[tuple[Any, float]], list[bool], list[list[int]]]:
    """The gradient sync's buckets as the program forms them (autopar/buckets.py): the
    items (bucket key or None, bytes), whether each is in a per-layer bucket, and the
    buckets (lists of indices into `syncs`)."""
    items, per_layer = [], []
    for g, src, dst in syncs:
        meta = graph.grad_meta(g)
        steps = pricer.collectives(meta, src, dst) or ()
        key = gradient_bucket_key(pricer.bucket_key(meta, src, dst) if steps else None, graph[g].layer)
        # a per-layer bucket (autopar/buckets.py gradient_bucket_key) is one of a traced
        # layer's `weight` real layers: sized as one layer, counted `weight` times
        per_layer.append(key is not None and steps[0].kind == "reduce_scatter")
        items.append((key, meta.size_bytes * (1.0 if per_layer[-1] else graph.weight(g))))
    return items, per_layer, plan_buckets(items)


def gradient_bucket_shares(graph: Graph, syncs: list[tuple[NodeId, Placements, Placements]],
                           pricer: ReshardPricer) -> dict[NodeId, float]:
    """Per bucketed gradient: its share of its bucket's latency, its bytes over the
    bucket's, so a bucket's members pay one latency together (the program runs one
    collective per bucket), however small the bucket. Unbucketed gradients are absent."""
    items, _per_layer, buckets = _gradient_buckets(graph, syncs, pricer)
    shares: dict[NodeId, float] = {}
    for bucket in buckets:
        if items[bucket[0]][0] is None:
            continue
        size = sum(items[i][1] for i in bucket)
        for i in bucket:
            g = syncs[i][0]
            shares[g] = graph.grad_meta(g).size_bytes / size if size > 0 else 1.0
    return shares


def gradient_sync_collectives(graph: Graph, syncs: list[tuple[NodeId, Placements, Placements]],
                              pricer: ReshardPricer) -> list[PricedCollective]:
    """The collectives of the once-per-step gradient sync, bucketed as the program does it
    (autopar/buckets.py); `syncs` are (gradient node, its placement, its parameter's) in
    graph order. A traced layer's gradient stands for `weight` real layers: its bucket
    share counts that many times."""
    items, per_layer, buckets = _gradient_buckets(graph, syncs, pricer)
    out = []
    for bucket in buckets:
        first_g, src, dst = syncs[bucket[0]]
        steps = pricer.collectives(graph.grad_meta(first_g), src, dst) or ()
        if not steps:
            continue
        if len(bucket) == 1 and items[bucket[0]][0] is None:
            out.extend(PricedCollective(src=first_g, dst=first_g, kind=c.kind, axis=c.axis, bytes=c.bytes,
                                        weight=graph.weight(first_g), gradient_sync=True) for c in steps)
            continue
        weight = graph.weight(first_g) if per_layer[bucket[0]] else 1.0
        for k, step in enumerate(steps):  # one collective per step, over the whole bucket
            size = sum(pricer.collectives(graph.grad_meta(syncs[i][0]), syncs[i][1], syncs[i][2])[k].bytes
                       * (1.0 if per_layer[i] else graph.weight(syncs[i][0])) for i in bucket)
            out.append(PricedCollective(src=first_g, dst=first_g, kind=step.kind, axis=step.axis,
                                        bytes=int(size), weight=weight, gradient_sync=True))
    return out


def _update_gathers(graph: Graph, space, red: Reduction, pricer: ReshardPricer, pick: dict[NodeId, int],
                    reshard: dict[NodeId, float], grad_sync_weight: float) -> list[PricedCollective]:
    """The gathers of updated weights the chosen placements imply, once per step (charged to
    each parameter's `reshard`, weighted like the gradient sync): one flat all-gather per
    (layer, axis, dtype) group of single-axis gathers, as codegen/apply.py `_WeightGather`
    runs them; any other gather on its own. A traced layer's group stands for `weight`
    real layers' groups."""
    group_bytes = layer_parameter_bytes(graph)
    groups: dict[tuple, list[PricedCollective]] = {}
    out: list[PricedCollective] = []
    for n in red.active:
        node = graph[n]
        if node.role is not Role.PARAMETER:
            continue
        strategy = space[n][pick[n]]
        got = update_gather(pricer, node.output, strategy, group_bytes.get(node.layer, 0.0))
        assert got is not None, f"the ILP chose an update placement DTensor cannot gather for node {n}"
        reshard[n] += got[0] * grad_sync_weight
        axis = pricer.gather_axis(node.output, strategy.update, strategy.outputs[0]) if got[1] else None
        for c in got[1]:
            one = PricedCollective(src=n, dst=n, kind=c.kind, axis=c.axis, bytes=c.bytes, weight=graph.weight(n),
                                   gradient_sync=True)
            if axis is None:
                out.append(one)
            else:
                groups.setdefault(gather_group(node.layer, UPDATE_PHASE, axis, node.output.dtype), []).append(one)
    for members in groups.values():
        first = members[0]
        out.append(PricedCollective(src=first.src, dst=first.dst, kind="all_gather", axis=first.axis,
                                    bytes=sum(c.bytes for c in members), weight=first.weight, gradient_sync=True))
    return out


def _extract(graph: Graph, space, table: CostTable, red: Reduction, pricer: ReshardPricer,
             chosen: dict[NodeId, int], terms, cluster: Cluster, mesh_shape: tuple[int, ...],
             budget: float | None, *, grad_sync_weight: float, **meta) -> IntraOpSolution:
    """Per-node choices, costs and collectives recomputed from the chosen strategies (not
    from the solver's objective)."""
    active = set(red.active)
    pick = {n: red.smap[n][chosen[red.owner[n]]] for n in red.active}
    reshard: dict[NodeId, float] = defaultdict(float)
    collectives: list[PricedCollective] = []

    group_bytes = param_gather_bytes(graph)
    derived = graph.parameter_derived()
    groups: dict[tuple, dict[tuple, Any]] = {}  # gather group -> {(param, src, dst): collective}

    def edge(u: NodeId, v: NodeId, src: Placements, dst: Placements) -> float:
        meta = graph[u].output
        steps = pricer.collectives(meta, src, dst)
        assert steps is not None, f"the ILP chose an impossible reshard {src} -> {dst} on edge {u}->{v}"
        if u in derived:
            axis = pricer.gather_axis(meta, src, dst)
            if axis is not None:  # one flat all-gather per group, each parameter once in it
                members = groups.setdefault(gather_group(graph[v].layer, graph[v].phase.value, axis, meta.dtype), {})
                if (u, src, dst) in members:
                    return 0.0  # gathered once for its group: its first reader paid
                members[(u, src, dst)] = PricedCollective(src=u, dst=v, kind="all_gather", axis=axis,
                                                          bytes=steps[0].bytes, weight=graph.weight(v))
                share = gather_share(meta.size_bytes, group_bytes[(graph[v].layer, graph[v].phase.value)])
                return pricer.gather_time(meta, src, dst, share) or 0.0
        for c in steps:
            collectives.append(PricedCollective(src=u, dst=v, kind=c.kind, axis=c.axis, bytes=c.bytes,
                                                weight=graph.weight(v)))
        return pricer(meta, src, dst) or 0.0

    for v in red.active:
        for p, u in enumerate(graph[v].inputs):
            if u in active and len(graph[u].outputs) == 1:
                reshard[v] += edge(u, v, space[u][pick[u]].outputs[0], space[v][pick[v]].inputs[p])
    for buf, value in graph.buffer_updates:
        if buf in active and value in active:
            reshard[value] += edge(value, buf, space[value][pick[value]].outputs[0], space[buf][pick[buf]].outputs[0])
    for members in groups.values():
        first = next(iter(members.values()))
        collectives.append(PricedCollective(src=first.src, dst=first.dst, kind="all_gather", axis=first.axis,
                                            bytes=sum(c.bytes for c in members.values()), weight=first.weight))
    syncs = [(param, grad) for param, grad in graph.param_grads if param in active and grad in active]
    sync_items = [(g, space[g][pick[g]].outputs[0], space[p][pick[p]].update_placements) for p, g in syncs]
    shares = gradient_bucket_shares(graph, sync_items, pricer)
    for param, grad in syncs:
        t = pricer.grad_sync_time(graph.grad_meta(grad), space[grad][pick[grad]].outputs[0],
                                  space[param][pick[param]].update_placements, share=shares.get(grad)) or 0.0
        reshard[param] += t * grad_sync_weight * graph.weight(grad) / graph.weight(param)
    grad_syncs = gradient_sync_collectives(graph, sync_items, pricer)
    if meta.get("grads_each_microbatch"):  # ZeRO-2: every microbatch syncs them, as its edges
        grad_syncs = [replace(c, gradient_sync=False) for c in grad_syncs]
    collectives.extend(grad_syncs)
    collectives.extend(_update_gathers(graph, space, red, pricer, pick, reshard, grad_sync_weight))
    choices = []
    compute = comm = resh = 0.0
    for n in red.active:
        node, s, c = graph[n], space[n][pick[n]], table.nodes[n][pick[n]]
        w = graph.weight(n)
        compute += w * c.compute_s
        comm += w * c.comm_s
        resh += w * reshard[n]
        choices.append(NodeChoice(node=n, name=node.name, op=node.op, outputs=s.outputs, inputs=s.inputs,
                                  compute_s=c.compute_s, comm_s=c.comm_s, reshard_s=reshard[n],
                                  memory_bytes=c.memory_bytes, weight=w, update=s.update))
    peak = 0.0
    for _t, coef in terms:
        peak = max(peak, sum(row[chosen[o]] for o, row in coef.items()))
    cost = CostBreakdown(compute_s=compute, comm_s=comm, reshard_s=resh, total_s=compute + comm + resh,
                         peak_memory_bytes=peak)
    return IntraOpSolution(graph_fingerprint=graph.fingerprint(), cluster=cluster.spec, mesh_shape=mesh_shape,
                           choices=tuple(choices), cost=cost, memory_budget_bytes=budget,
                           collectives=tuple(collectives), grad_sync_weight=grad_sync_weight, **meta)
