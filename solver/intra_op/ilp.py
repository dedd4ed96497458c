"""Intra-op sharding ILP: choose every op's placements on a device mesh.

Where it sits: `solve_intra_op(graph, cluster, mesh_shape)` runs
strategies (solver/intra_op/space.py) -> prices (cost_model/table.py) -> simplification
(solver/intra_op/sharing.py) -> this ILP, and returns a frozen `IntraOpSolution`
(autopar/sharding.py) for the whole-plan search and codegen. Data, tensor, sequence and
ZeRO-3/FSDP parallelism are not special cases: they are what the minimum below picks.
This module builds the problem, one function per constraint family; around it,
restrict.py removes the strategies a forced configuration or a gather-free axis rules
out, liveness.py says which tensors the memory rows count, collective_groups.py prices
grouped weight gathers and gradient buckets, backend.py runs the solver and solution.py
reads the chosen strategies back into costs and collectives.

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
               layer's weights travel in one flat all-gather: its bandwidth term here,
               its latency once per group through y_g below, `_add_update_gathers`);
               0 for every other node
    C_ab     = sum over graph edges u->v with o(u)=a, o(v)=b of w_v reshard(u->v), plus
               for each (parameter p, gradient g) the edge g->p, priced as resharding the
               gradient into its parameter's weight-update placement (all-reduce from
               Partial = data parallel, reduce-scatter into a Shard = ZeRO-1/2 where the
               compute placement is replicated, ZeRO-3/FSDP where it is the same shard):
               forward/backward consistency is a cost, so it can never make the problem
               infeasible. An edge from a parameter-derived tensor that is one all-gather
               on one axis is a member of its gather group: C_ab holds its bandwidth
               term and copies, the group's latency is y_g's. None (the pair is not a
               plan) where an activation would be gathered on a data-parallel axis,
               except into or out of a grouped op's expert-parallel strategy (the
               dispatch and combine all-to-alls), or a weight on an axis where weights
               stay whole (ZeRO 0-2): solver/intra_op/edges.py.
    y_g      = in [0, 1], charged w_g lat(axis) in the objective: 1 where any member of
               gather group g (one flat all-gather per consumer layer, phase, axis and
               dtype, or per layer for the updated weights) gathers, by the rows
               gather/g/... (solver/intra_op/gather_rows.py: exact for one-hot x)
               Rows r and columns k are classes of identical rows/columns of the matrix.
    z_r      = in [0, 1], charged p_r: 1 where an activation read by several ops of one
               phase leaves its owner at layout s and some reader asks for layout d; the
               program reshards it once for all of them, so the readers' edges carry 0
               for that move (rows shared/r/... over the readers' edge variables,
               solver/intra_op/shared_rows.py: exact for one-hot x)

    h_p      = continuous >= 0, charged -1 in the objective, one per overlap pool p where
               rho = cost_model `grad_sync_overlap` > 0: the time of the pool's
               collectives that compute hides (solver/intra_op/overlap_rows.py). Pool
               "sync": the gradient sync, where the program overlaps it with the backward
               (a one-stage step of one microbatch, or ZeRO-2's every microbatch:
               autopar/build/one_stage.py `sync_in_step`), so the sync is charged as
               exposed = max(S_last, S - rho W) (cost_model/table.py `exposed_sync_s`);
               pools "gather/forward" and "gather/backward": the collectives of weights
               alone in a one-stage program, each issued as soon as the one before it is
               waited (codegen/prefetch.py), less the first layer's of each phase:
    overlap/p:              h_p <= the pool's charge at x (its x, e and gather-group y columns)
    overlap/window/forward: h_gather/forward <= rho W_forward(x)
    overlap/window/backward: h_sync + h_gather/backward <= rho W_backward(x)
                            W_phase: the phase's nodes' weighted compute

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
alias their base; solver/intra_op/liveness.py). T ranges over the MEMORY_POINTS times with the largest replicated
live bytes (the forward/backward boundary among them): sharding scales tensors
unevenly, so this is a heuristic for the true peak, exact at the checked points.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pulp

from autopar.cluster import Cluster
from autopar.ir import Graph, NodeId, Role
from autopar.placement import shard_factor
from autopar.sharding import InfeasiblePlanError, IntraOpSolution, StrategySpace
from cost_model import (CostTable, ReshardPricer, bucket_copy_s_per_byte, collective_latency_s, core_share,
                        cost_table, grad_accumulation_time_s, grad_sync_overlap, optimizer_time_s, runs_gloo)
from solver.intra_op.backend import OBJECTIVE_SCALE, SOLVERS, Milp, Solved, solve, solve_ilp
from solver.intra_op.collective_groups import first_weight_layers, update_gather
from solver.intra_op.gather_rows import GatherGroups
from solver.intra_op.shared_rows import SharedReshards
from solver.intra_op.edges import TIE_BREAK_S, edge_matrices
from solver.intra_op.restrict import (
    Exchange, PlaceholderFilter, UpdateFilter, exchange_nodes, prune_gather_free, restrict_placeholders)
from solver.intra_op.liveness import memory_terms
from solver.intra_op.sharing import Reduction, reduce_graph
from solver.intra_op.solution import extract_solution, last_gradient
from solver.intra_op.overlap_rows import GATHER_POOLS, POOLS, SYNC, HiddenComm
from solver.intra_op.space import enumerate_strategies

log = logging.getLogger(__name__)


MEMORY_SCALE = 1.0 / 2**20
"""Memory rows are written in MiB for the same reason."""

MEMORY_TIE_BREAK_S_PER_BYTE = 1e-19
"""Added to the objective (not to reported costs) per byte of a non-parameter tensor:
among equal-time plans prefer sharded activations and inputs (an input placeholder is
free to arrive replicated or sharded; 1 GiB weighs 1e-10 s). Parameters have none, so
that TIE_BREAK_S alone decides between data parallel and ZeRO when their times tie."""


def _classes(vectors: list[tuple[float, ...]]) -> list[list[int]]:
    groups: dict[tuple[float, ...], list[int]] = {}
    for i, vec in enumerate(vectors):
        groups.setdefault(vec, []).append(i)
    return list(groups.values())


def _fold_separable(edges: dict[tuple[NodeId, NodeId], list[list[float | None]]],
                    node_coef: dict[NodeId, list[float]], forbidden: dict[NodeId, set[int]],
                    hidden: HiddenComm | None = None, shared: SharedReshards | None = None
                    ) -> dict[tuple[NodeId, NodeId], tuple]:
    """Edges whose matrix has one row class (cost depends on b only) or one column class
    (on a only) are added to node costs (an infeasible entry forbids that choice); the
    rest come back as (matrix, row classes, column classes) for edge variables.
    `node_coef` and `forbidden` are this solve's own tables (updated), and so is `hidden`:
    a pair's hideable charges fold with it, and its classes are those of (charge, each
    pool's hideable charge) so that each edge variable has one of each; with `shared`,
    of (charge, the shared reshards the pair makes), so each edge variable makes one set."""
    kept = {}
    for (a, b), matrix in sorted(edges.items()):
        pools = hidden.pools_of(a, b) if hidden is not None else []
        parts = [hidden.edges[p][(a, b)] for p in pools]
        paired = matrix if not parts else [list(zip(r, *hs)) for r, *hs in zip(matrix, *parts)]
        marks = shared.marks.get((a, b)) if shared is not None else None
        if marks is not None:
            paired = [list(zip(r, m)) for r, m in zip(paired, marks)]
        rows = _classes([tuple(r) for r in paired])
        cols = _classes([tuple(c) for c in zip(*paired)])
        if len(rows) == 1:
            for k, c in enumerate(matrix[0]):
                if c is None:
                    forbidden.setdefault(b, set()).add(k)
                else:
                    node_coef[b][k] += c
                    for pool, part in zip(pools, parts):
                        hidden.add_node(pool, b, k, len(node_coef[b]), part[0][k])
        elif len(cols) == 1:
            for j, row in enumerate(matrix):
                if row[0] is None:
                    forbidden.setdefault(a, set()).add(j)
                else:
                    node_coef[a][j] += row[0]
                    for pool, part in zip(pools, parts):
                        hidden.add_node(pool, a, j, len(node_coef[a]), part[j][0])
        else:
            kept[(a, b)] = (matrix, rows, cols)
    return kept


class _Model:
    """The ILP (a backend.Milp), built one constraint family at a time; `x[o][j]` is the
    column of owner o's option j."""

    def __init__(self, red: Reduction) -> None:
        self.milp = Milp()
        self.x = {o: [self.milp.add_binary(f"x_{o}_{j}") for j in range(len(red.smap[o]))] for o in red.owners}
        self.edge_vars: dict[tuple[NodeId, NodeId], dict[tuple[int, int], int]] = {}
        self.objective = self.milp.cost
        """One coefficient per column (terms of one column are summed here first)."""
        self.indicators: dict[tuple, tuple[int, float]] = {}
        """Per gather group: its indicator's column and charge (`add_indicator_rows`)."""

    def add_one_choice_constraints(self) -> None:
        for o, xs in self.x.items():
            self.milp.add_row(((x, 1.0) for x in xs), 1.0, 1.0, f"one_choice/{o}")

    def add_node_costs(self, node_coef: dict[NodeId, list[float]]) -> None:
        for o, coef in node_coef.items():
            for j, c in enumerate(coef):
                if c:
                    var = self.x[o][j]
                    self.objective[var] = self.objective.get(var, 0.0) + c * OBJECTIVE_SCALE

    def add_forbidden_constraints(self, forbidden: dict[NodeId, set[int]]) -> None:
        for o, choices in sorted(forbidden.items()):
            for j in sorted(choices):
                self.milp.add_row([(self.x[o][j], 1.0)], 0.0, 0.0, f"forbid/{o}/{j}")

    def add_edge_constraints(self, edges: dict[tuple[NodeId, NodeId], tuple]) -> int:
        """Edge variables and their row/column rows; returns the number of edge variables.
        Pairs DTensor cannot reshard (None) get no variable, so the sums exclude them."""
        count = 0
        for (a, b), (matrix, rows, cols) in edges.items():
            by_row: list[list[int]] = [[] for _ in rows]
            by_col: list[list[int]] = [[] for _ in cols]
            for r, rmembers in enumerate(rows):
                for k, cmembers in enumerate(cols):
                    c = matrix[rmembers[0]][cmembers[0]]
                    if c is None:
                        continue
                    var = self.milp.add_col(f"e_{a}_{b}_{r}_{k}", 0.0, None)
                    self.edge_vars.setdefault((a, b), {})[(r, k)] = var
                    by_row[r].append(var)
                    by_col[k].append(var)
                    count += 1
                    if c:
                        self.objective[var] = c * OBJECTIVE_SCALE
            xa, xb = self.x[a], self.x[b]
            for r, members in enumerate(rows):
                self.milp.add_row([(v, 1.0) for v in by_row[r]] + [(xa[j], -1.0) for j in members], 0.0, 0.0,
                                  f"edge/{a}->{b}/row={r}")
            for k, members in enumerate(cols):
                self.milp.add_row([(v, 1.0) for v in by_col[k]] + [(xb[j], -1.0) for j in members], 0.0, 0.0,
                                  f"edge/{a}->{b}/col={k}")
        return count

    def add_indicator_rows(self, prefix: str, costs_s: dict[tuple, float], rows: dict[tuple, set]) -> int:
        """One continuous indicator in [0, 1] per group, charged `costs_s[group]`, and its
        rows `sum x - y <= -const` (gather_rows.py's gather groups; the columns are kept in
        `indicators`); returns the number of groups."""
        for number, (group, cost_s) in enumerate(sorted(costs_s.items(), key=lambda kv: repr(kv[0]))):
            y = self.milp.add_col(f"{prefix}_{number}", 0.0, 1.0)
            self.indicators[group] = (y, cost_s)
            self.objective[y] = cost_s * OBJECTIVE_SCALE
            for r, (terms, const) in enumerate(sorted(rows[group])):
                self.milp.add_row([(self.x[o][j], 1.0) for o, j in terms] + [(y, -1.0)], None, -const,
                                  f"{prefix}/{number}/{r}")
        return len(costs_s)

    def add_shared_reshard_rows(self, shared: SharedReshards, edges: dict[tuple[NodeId, NodeId], tuple]) -> int:
        """One continuous z_r per shared reshard, charged its price, and its rows over the
        readers' edge variables (shared_rows.py), after those; returns the number of z_r."""
        costs = shared.costs_s()
        for number, key in enumerate(sorted(costs, key=repr)):
            z = self.milp.add_col(f"shared_{number}", 0.0, 1.0)
            self.objective[z] = costs[key] * OBJECTIVE_SCALE
            for r, (terms, const) in enumerate(shared.rows_of(key, self.edge_vars, edges)):
                columns = [self.x[ref[0]][ref[1]] if kind == "x" else ref for kind, ref in terms]
                self.milp.add_row([(c, 1.0) for c in columns] + [(z, -1.0)], None, -const, f"shared/{number}/{r}")
        return len(costs)

    def add_overlap_rows(self, hidden: HiddenComm, edges: dict[tuple[NodeId, NodeId], tuple]) -> None:
        """The hidden time of each pool and their rows (overlap_rows.py), after the edge
        variables and the gather groups' indicators."""
        h = {}
        for pool in POOLS:
            terms = [(self.x[o][j], -c) for o, row in sorted(hidden.node[pool].items()) for j, c in enumerate(row) if c]
            for pair, part in sorted(hidden.edges[pool].items()):
                if pair not in edges:
                    continue  # folded into `hidden.node` (or no variable: one option each)
                _matrix, rows, cols = edges[pair]
                for (r, k), var in self.edge_vars.get(pair, {}).items():
                    c = part[rows[r][0]][cols[k][0]]
                    if c:
                        terms.append((var, -c))
            phase = next((ph for ph, p in GATHER_POOLS.items() if p == pool), None)
            if phase is not None:
                terms += [(y, -cost) for g, (y, cost) in sorted(self.indicators.items(), key=lambda kv: repr(kv[0]))
                          if hidden.gather_pool(g[0], g[1]) == pool]
            if not terms:
                continue
            h[pool] = self.milp.add_col(f"hidden_{pool}", 0.0, None)
            self.objective[h[pool]] = -OBJECTIVE_SCALE
            self.milp.add_row(terms + [(h[pool], 1.0)], None, 0.0, f"overlap/{pool}")
        for phase, pool in GATHER_POOLS.items():
            sharing = [h[p] for p in ((SYNC, pool) if phase == "backward" else (pool,)) if p in h]
            if not sharing:
                continue
            window = [(self.x[o][j], -hidden.rho * c) for o, row in sorted(hidden.window[phase].items())
                      for j, c in enumerate(row) if c]
            self.milp.add_row(window + [(v, 1.0) for v in sharing], None, 0.0, f"overlap/window/{phase}")

    def memory_terms(self, coef: dict[NodeId, list[float]]) -> list[tuple[int, float]]:
        return [(self.x[o][j], m * MEMORY_SCALE) for o, row in sorted(coef.items()) for j, m in enumerate(row) if m]

    def add_memory_constraints(self, terms, budget_bytes: float) -> None:
        for t, coef in terms:
            self.milp.add_row(self.memory_terms(coef), None, budget_bytes * MEMORY_SCALE, f"memory/t={t}")


def _min_memory_bytes(red: Reduction, terms, forbidden: dict[NodeId, set[int]], solver: str,
                      time_limit_s: float | None) -> float:
    """Smallest peak memory any plan reaches at the checked points (for error messages)."""
    m = _Model(red)
    m.add_one_choice_constraints()
    m.add_forbidden_constraints(forbidden)
    peak = m.milp.add_col("peak_mib", 0.0, None)
    m.objective[peak] = 1.0
    for t, coef in terms:
        m.milp.add_row(m.memory_terms(coef) + [(peak, -1.0)], None, 0.0, f"memory/t={t}")
    return solve_ilp(m.milp, solver, time_limit_s).value(peak) / MEMORY_SCALE


def _synced_in_step(num_microbatches: int | None, grads_each_microbatch: bool) -> bool:
    """Whether the step syncs the gradients in its backward (one microbatch of a one-stage
    step, or ZeRO-2: autopar/build/one_stage.py `sync_in_step`), so that the gradients it holds
    are the synced ones in the update placement, not the raw ones accumulated as the
    backward leaves them (cost_model/table.py strategy_cost)."""
    return grads_each_microbatch or num_microbatches == 1


def solve_intra_op(graph: Graph, cluster: Cluster, mesh_shape: tuple[int, ...], *,
                   memory_budget_bytes: float | None = None, solver: str = "highs",
                   time_limit_s: float | None = None, nodes: tuple[NodeId, ...] | None = None,
                   keep_placeholder: PlaceholderFilter | None = None, keep_update: UpdateFilter | None = None,
                   grad_sync_weight: float = 1.0,
                   gather_free_axes: tuple[int, ...] = (), space: StrategySpace | None = None,
                   cutoff_s: float | None = None, num_microbatches: int | None = None,
                   prune_memo: dict | None = None, grads_each_microbatch: bool = False,
                   weights_whole_axes: tuple[int, ...] = (), expert_moves: bool = True,
                   overlap_weights: bool = False) -> IntraOpSolution:
    """Optimal per-node placements of `graph` (or the subgraph `nodes`) on a `mesh_shape` mesh.

    `keep_placeholder` restricts placeholder layouts (a forced configuration), `keep_update`
    the parameters' weight-update placements; `grad_sync_weight` weighs the gradient
    reshards per microbatch (1/m); `gather_free_axes` are data-parallel axes on which
    activations are never gathered (so the batch stays split there). `space` reuses an
    enumeration of the same graph and mesh. Raises InfeasiblePlanError (a ValueError)
    when no plan fits `memory_budget_bytes`, with the smallest memory any plan needs.
    `cutoff_s` (HiGHS only): raise CutoffExceeded instead of branching when the LP
    relaxation proves the per-microbatch objective is at least this (the search's pruning).
    `num_microbatches` m: a one-stage step of m microbatches; gradient edges are weighted
    1/m and the once-per-step optimizer and accumulation terms join the objective / m
    (module docstring). `prune_memo`: the search's memo shared by its solves (pruning
    passes, cost table rows, reshard and edge prices).
    `grads_each_microbatch` (ZeRO-2): every microbatch syncs its gradients to their update
    placements (the edges weighed 1, not 1/m) and accumulates them there: the gradient
    bytes and the accumulation are the update shard's, not the raw gradient's.
    `weights_whole_axes` (ZeRO 0-2 over dp, solver/forced.py): no weight is gathered there
    per use (experts stored split on E are computed where they are stored). `expert_moves`:
    tokens may move over `gather_free_axes` to experts split there (restrict.py).
    `overlap_weights` (one stage): weights' collectives hidden behind compute (overlap_rows.py)."""
    grad_sync_weight = 1.0 if grads_each_microbatch else \
        grad_sync_weight if num_microbatches is None else 1.0 / num_microbatches
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    start = time.perf_counter()
    mesh_shape = tuple(int(s) for s in mesh_shape)
    space, exchange = _restricted_space(graph, cluster, mesh_shape, space, nodes, keep_placeholder, keep_update,
                                        gather_free_axes if expert_moves else (), gather_free_axes, prune_memo)
    table = cost_table(graph, space, cluster, grads_at_update=_synced_in_step(num_microbatches, grads_each_microbatch), memo=prune_memo)
    red = reduce_graph(graph, space, table, nodes)
    gloo = runs_gloo(cluster.hardware)
    shared = None if prune_memo is None else prune_memo.setdefault(("reshard prices", table.links, gloo), {})
    pricer = ReshardPricer(table.links, gloo=gloo, copy_s_per_byte=bucket_copy_s_per_byte(cluster), memo=shared)

    node_coef = _node_costs(graph, table, red)
    if num_microbatches is not None:
        _add_step_terms(graph, space, red, node_coef, cluster, mesh_shape, num_microbatches,
                        synced=grads_each_microbatch)
    forbidden: dict[NodeId, set[int]] = {}
    gathers = GatherGroups([collective_latency_s("all_gather", link) for link in table.links])
    shared = SharedReshards()
    _add_update_gathers(graph, space, red, pricer, node_coef, forbidden, grad_sync_weight, gathers)
    prices = None if prune_memo is None else prune_memo.setdefault(  # the search's solves share them:
        ("edge prices", cluster.spec, cluster.hardware, mesh_shape, gather_free_axes, grads_each_microbatch,
         weights_whole_axes), ({}, {}, {}))  # they depend on the pricer and the axes' rules only
    hidden, rho, overlapped = _hidden_comm(graph, table, red, cluster, num_microbatches, grads_each_microbatch,
                                           overlap_weights)
    edges = _fold_separable(edge_matrices(
        graph, space, red, pricer, node_coef, forbidden, gathers, grad_sync_weight=grad_sync_weight,
        gather_free_axes=gather_free_axes, prices=prices, exchange=exchange, weights_whole_axes=weights_whole_axes,
        hidden=hidden, shared=shared), node_coef, forbidden, hidden, shared)
    terms = memory_terms(graph, table, red)
    built = time.perf_counter()
    model, num_edge_vars = _build_model(red, node_coef, forbidden, edges, (gathers, shared), terms,
                                        memory_budget_bytes, hidden)
    solved = solve(model.milp, [v for xs in model.x.values() for v in xs], solver, time_limit_s, cutoff_s)
    status = _solution_status(solved, model, red, terms, forbidden, graph, cluster, space, mesh_shape,
                              memory_budget_bytes=memory_budget_bytes, solver=solver, time_limit_s=time_limit_s,
                              elapsed_s=time.perf_counter() - start)
    chosen = {o: max(range(len(xs)), key=lambda j: (solved.value(xs[j]), -j)) for o, xs in model.x.items()}
    solution = extract_solution(graph, space, table, red, pricer, chosen, terms, cluster, mesh_shape,
                                memory_budget_bytes, grad_sync_weight=grad_sync_weight, overlap=rho,
                                overlapped=overlapped, memo=prune_memo, status=status, solver=solver,
                                grads_each_microbatch=grads_each_microbatch,
                                num_variables=sum(len(xs) for xs in model.x.values()) + num_edge_vars,
                                num_constraints=model.milp.num_rows,
                                solve_time_s=time.perf_counter() - start)
    _log_solve(graph, red, solution, model, solved, built - start)
    return solution


def _log_solve(graph: Graph, red: Reduction, solution: IntraOpSolution, model: _Model, solved: Solved,
               build_s: float) -> None:
    objective_s = (model.milp.objective(solved.values) if solved.values is not None else 0.0) / OBJECTIVE_SCALE
    log.info("intra-op %s on %s: %d owners of %d nodes, %d vars, %d rows; build %.2f s, total %.2f s; "
             "objective %.6g s (extracted %.6g s), %s",
             graph.model.name, solution.mesh_shape, len(red.owners), len(red.active), solution.num_variables,
             solution.num_constraints, build_s, solution.solve_time_s, objective_s,
             solution.cost.total_s, solution.status)


def _hidden_comm(graph: Graph, table: CostTable, red: Reduction, cluster: Cluster, num_microbatches: int | None,
                 grads_each_microbatch: bool, overlap_weights: bool
                 ) -> tuple[HiddenComm | None, float, tuple[bool, bool]]:
    """(the hideable charges' rows, rho, (whether the sync overlaps, whether the weights'
    collectives do)): the program overlaps the gradient sync with the backward where it
    syncs in the step graph (autopar/build/one_stage.py `sync_in_step`: one microbatch, or
    ZeRO-2's every microbatch), and issues the weights' collectives ahead of their use in a
    one-stage program (`overlap_weights`, codegen/prefetch.py); where rho is 0 nothing hides."""
    sync = num_microbatches is not None and (num_microbatches == 1 or grads_each_microbatch)
    rho = grad_sync_overlap(cluster)
    active = set(red.active)
    sync = sync and any(p in active and g in active for p, g in graph.param_grads)
    if rho <= 0 or not (sync or overlap_weights):
        return None, 0.0, (False, False)
    hidden = HiddenComm(graph, table, red, rho, last_gradient=last_gradient(graph, active) if sync else None,
                        first_layers=first_weight_layers(graph, active) if overlap_weights else None)
    return hidden, rho, (sync, overlap_weights)


def _restricted_space(graph: Graph, cluster: Cluster, mesh_shape: tuple[int, ...], space: StrategySpace | None,
                      nodes: tuple[NodeId, ...] | None, keep_placeholder: PlaceholderFilter | None,
                      keep_update: UpdateFilter | None, exchange_axes: tuple[int, ...],
                      gather_free_axes: tuple[int, ...], prune_memo: dict | None) -> tuple[StrategySpace, Exchange]:
    """The strategies this solve chooses from: `space` (or a new enumeration) under the
    forced configuration's filters, pruned on the gather-free axes for a whole graph
    (solver/intra_op/restrict.py); and the grouped ops' expert-parallel strategies in it
    (`exchange_nodes` on `exchange_axes`, the gather-free axes where tokens may move to
    experts split there: the same rule for the pruning and the ILP's edges)."""
    if space is None:
        space = enumerate_strategies(graph, mesh_shape)
    if keep_placeholder is not None or keep_update is not None:
        space = restrict_placeholders(graph, space, keep_placeholder, keep_update)
    exchange = exchange_nodes(graph, space, exchange_axes)
    if nodes is None:
        pruned = prune_gather_free(graph, space, gather_free_axes, gloo=runs_gloo(cluster.hardware),
                                   memo=prune_memo, exchange=exchange)
        if pruned is not space and exchange:
            exchange = exchange_nodes(graph, pruned, exchange_axes)
        space = pruned
    return space, exchange


def _build_model(red: Reduction, node_coef: dict[NodeId, list[float]], forbidden: dict[NodeId, set[int]],
                 edges: dict[tuple[NodeId, NodeId], tuple], groups: tuple[GatherGroups, SharedReshards], terms: list,
                 memory_budget_bytes: float | None, hidden: HiddenComm | None = None) -> tuple[_Model, int]:
    """The ILP of the module docstring, one constraint family at a time; and its number of
    edge and gather-group variables."""
    model = _Model(red)
    model.add_one_choice_constraints()
    model.add_forbidden_constraints(forbidden)
    model.add_node_costs(node_coef)
    gathers, shared = groups
    num_edge_vars = model.add_edge_constraints(edges) \
        + model.add_indicator_rows("gather", gathers.costs_s(), gathers.rows) \
        + model.add_shared_reshard_rows(shared, edges)
    if hidden is not None:
        model.add_overlap_rows(hidden, edges)
    if memory_budget_bytes is not None:
        model.add_memory_constraints(terms, memory_budget_bytes)
    return model, num_edge_vars


def _node_costs(graph: Graph, table: CostTable, red: Reduction) -> dict[NodeId, list[float]]:
    """c[o, j] before the once-per-step and edge terms: each active node's weighted compute
    and communication at its owner's option j, plus the activation-memory tie-breaker."""
    node_coef: dict[NodeId, list[float]] = {o: [0.0] * len(red.smap[o]) for o in red.owners}
    for n in red.active:
        w = graph.weight(n)
        coef, costs = node_coef[red.owner[n]], table.nodes[n]
        tie = 0.0 if graph[n].role is Role.PARAMETER else MEMORY_TIE_BREAK_S_PER_BYTE
        for j, s in enumerate(red.smap[n]):
            coef[j] += w * (costs[s].compute_s + costs[s].comm_s + tie * costs[s].memory_bytes)
    return node_coef


def _solution_status(solved: Solved, model: _Model, red: Reduction, terms: list, forbidden: dict[NodeId, set[int]],
                     graph: Graph, cluster: Cluster, space: StrategySpace, mesh_shape: tuple[int, ...], *,
                     memory_budget_bytes: float | None, solver: str, time_limit_s: float | None,
                     elapsed_s: float) -> str:
    """The solution's status ("optimal", or "time_limit": feasible, not proven optimal), or the
    error saying why there is none: the memory (with the smallest need of any plan), the
    other constraints, or the solver."""
    need, sol_status = None, solved.sol_status
    if sol_status in (pulp.LpSolutionInfeasible, pulp.LpSolutionNoSolutionFound) and memory_budget_bytes is not None \
            and solved.status != pulp.LpStatusNotSolved:
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
        return "optimal"
    if sol_status == pulp.LpSolutionIntegerFeasible:
        return "time_limit"
    if sol_status == pulp.LpSolutionInfeasible:
        only_replicated = ", ".join(getattr(space, "fallback_ops", ())) or "none"
        raise InfeasiblePlanError(
            f"No placement of {graph.model.name}'s ops on mesh {mesh_shape} satisfies the constraints: a forced "
            f"configuration (inputs split over dp, activations never gathered on dp, parameter placements) or a "
            f"choice forbidden by DTensor. Ops with no sharded strategy (they need whole inputs): {only_replicated}. "
            "Drop the configuration flags and let the search choose, or use another mesh")
    raise RuntimeError(f"intra-op ILP ended with {pulp.LpStatus[solved.status]} "
                       f"(solution status {sol_status}) after {elapsed_s:.1f} s; "
                       f"time limit {time_limit_s} s. Raise --time-limit or check the log.")


def _add_update_gathers(graph: Graph, space, red: Reduction, pricer: ReshardPricer,
                        node_coef: dict[NodeId, list[float]], forbidden: dict[NodeId, set[int]],
                        grad_sync_weight: float, gathers: GatherGroups) -> None:
    """Weight-update sharding: a parameter whose update runs in another placement than its
    compute (NodeStrategy.update) gathers its updated weights back once per step: weighted
    like the gradient sync (`grad_sync_weight`, 1/m of a per-microbatch objective), plus
    TIE_BREAK_S per collective (all-reduce over reduce-scatter + all-gather where equal).
    A gather on one axis travels in its layer's group: its bandwidth term and copies here,
    the group's latency through `gathers` (gather_rows.py)."""
    grouped: dict[tuple[NodeId, int], list[int]] = {}
    for node, coef, w, j, s in _parameter_options(graph, red, node_coef):
        strategy = space[node.id][s]
        got = update_gather(pricer, node.output, strategy, 0.0)
        if got is None:
            forbidden.setdefault(red.owner[node.id], set()).add(j)
        elif got[1]:
            coef[j] += w * (got[0] * grad_sync_weight + TIE_BREAK_S * len(got[1]))
            axis = pricer.gather_axis(node.output, strategy.update, strategy.outputs[0])
            if axis is not None:
                grouped.setdefault((node.id, axis), []).append(j)
    for (n, axis), options in grouped.items():
        gathers.add_update(graph[n].layer, graph[n].output.dtype, red.owner[n], options, axis,
                           graph.weight(n) * grad_sync_weight)


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
