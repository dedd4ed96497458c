"""Intra-op sharding ILP: choose every op's placements on a device mesh.

Where it sits: `solve_intra_op(graph, cluster, mesh_shape)` runs
strategies (solver/strategies.py) -> prices (solver/costs.py) -> simplification
(solver/ilp_reduce.py) -> this ILP, and returns a frozen `IntraOpSolution`
(autopar/sharding.py) for the whole-plan search and codegen. Data, tensor, sequence and
ZeRO-3/FSDP parallelism are not special cases: they are what the minimum below picks.

Math. O = owner nodes (after layer sharing and following), S_o = strategies of o,
x[o,j] in {0,1} picks strategy j of o; a followed node n is at strategy smap_n(j) of its
owner o(n); w_n = graph.weight(n) (multiplicity of repeated layers).

    minimise   sum_o sum_j c[o,j] x[o,j]  +  sum_(a,b) sum_(r,k) C_ab[r,k] e_ab[r,k]

    c[o,j]   = sum_{n: o(n)=o} w_n (compute(n, smap_n(j)) + comm(n, smap_n(j)))
               + resharding on edges inside one owner (a follower chain) at j
               (the objective also carries TIE_BREAK_S per collective and
               MEMORY_TIE_BREAK_S_PER_BYTE per activation byte; reported costs do not)
    C_ab     = sum over graph edges u->v with o(u)=a, o(v)=b of w_v reshard(u->v), plus
               for each (parameter p, gradient g) the edge g->p, priced as resharding the
               gradient into its parameter's layout (all-reduce from Partial = data
               parallel, reduce-scatter into a Shard = ZeRO/FSDP): forward/backward
               consistency is a cost, so it can never make the problem infeasible.
               Rows r and columns k are classes of identical rows/columns of the matrix.

    one_choice/o:     sum_j x[o,j] = 1
    edge/a->b/row=r:  sum_k e_ab[r,k] = sum_{j in class r} x[a,j]       (Alpa-style;
    edge/a->b/col=k:  sum_r e_ab[r,k] = sum_{j in class k} x[b,j]        e continuous >= 0)
    memory/t=T:       sum_{n live at T} w_n mem(n, smap_n(j)) x[o(n),j] <= budget

The row/column sums force e_ab to the outer product of the two one-hot rows, so the
edge term is exact without McCormick rows. An edge whose matrix has one row class (or
one column class) is separable and folds into c. Memory: parameters count
STATE_BYTES_PER_PARAM per element divided by their shard factor (param, grad, AdamW
state) at every T; activations count from their producer to their last user (views
alias their base). T ranges over the MEMORY_POINTS times with the largest replicated
live bytes (the forward/backward boundary among them): sharding scales tensors
unevenly, so this is a heuristic for the true peak, exact at the checked points.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import defaultdict

import pulp

from autopar.cluster import Cluster
from autopar.ir import Graph, NodeId, Role
from autopar.placement import Partial, Placements, Replicate
from autopar.sharding import CostBreakdown, InfeasiblePlanError, IntraOpSolution, NodeChoice
from solver.costs import CostTable, ReshardPricer, price
from solver.ilp_reduce import Reduction, reduce_graph
from solver.strategies import enumerate_strategies

log = logging.getLogger(__name__)

OBJECTIVE_SCALE = 1e6
"""The ILP objective is in microseconds: second-sized coefficients (1e-9..1) sit below
the solvers' default tolerances."""

MEMORY_SCALE = 1.0 / 2**20
"""Memory rows are written in MiB for the same reason."""

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
"""An LP-relaxation value this close to 0 or 1 counts as integral."""


def _num_collectives(src: Placements, dst: Placements) -> int:
    """Axes whose change needs communication (R->anything and S->P are local)."""
    return sum(1 for a, b in zip(src, dst) if a != b and not isinstance(a, Replicate) and not isinstance(b, Partial))


def _edge_matrices(graph: Graph, space, red: Reduction, pricer: ReshardPricer,
                   node_coef: dict[NodeId, list[float]]) -> dict[tuple[NodeId, NodeId], list[list[float]]]:
    """Resharding cost per owner pair (a, b) as a matrix over (j_a, j_b); folds same-owner edges."""
    active = set(red.active)
    edges: dict[tuple[NodeId, NodeId], list[list[float]]] = {}
    # Layer-shared edges repeat the same (tensor, placements) matrix, and placements repeat
    # within one: price each distinct pair once, keyed by small ints (hashing placement
    # dataclasses dominated the build).
    intern: dict[Placements, int] = {}
    pair_cost: dict[tuple, float] = {}
    matrices: dict[tuple, list[list[float]]] = {}

    def priced(meta, s: Placements, d: Placements) -> float:
        i, k = intern.setdefault(s, len(intern)), intern.setdefault(d, len(intern))
        if i == k:
            return 0.0
        key = (meta.shape, meta.dtype, i, k)
        c = pair_cost.get(key)
        if c is None:
            c = pair_cost[key] = pricer(meta, s, d) + TIE_BREAK_S * _num_collectives(s, d)
        return c

    def add(u: NodeId, v: NodeId, meta, src_of, dst_of, weight: float) -> None:
        a, b = red.owner[u], red.owner[v]
        if a == b:
            coef = node_coef[a]
            for j in range(len(coef)):
                coef[j] += weight * priced(meta, src_of(red.smap[u][j]), dst_of(red.smap[v][j]))
            return
        src = tuple(src_of(j) for j in red.smap[u])
        dst = tuple(dst_of(j) for j in red.smap[v])
        key = (meta.shape, meta.dtype, src, dst)
        unit = matrices.get(key)
        if unit is None:
            unit = matrices[key] = [[priced(meta, s, d) for d in dst] for s in src]
        matrix = edges.get((a, b))
        if matrix is None:
            edges[(a, b)] = [[weight * c for c in row] for row in unit]
            return
        for row, unit_row in zip(matrix, unit):
            for jb, c in enumerate(unit_row):
                if c:
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
            add(grad, param, graph[grad].output, lambda j, g=grad: space[g][j].outputs[0],
                lambda j, q=param: space[q][j].outputs[0], graph.weight(grad))
    return edges


def _classes(vectors: list[tuple[float, ...]]) -> list[list[int]]:
    groups: dict[tuple[float, ...], list[int]] = {}
    for i, vec in enumerate(vectors):
        groups.setdefault(vec, []).append(i)
    return list(groups.values())


def _memory_terms(graph: Graph, space, table: CostTable, red: Reduction) -> list[tuple[int, dict[NodeId, list[float]]]]:
    """Per checked time point T: coefficients mem[o][j] of the live bytes at T."""
    active = set(red.active)
    end = {n: n for n in red.active}
    base: dict[NodeId, NodeId] = {}
    for n in red.active:  # views alias their base tensor; the base lives until the last alias use
        node = graph[n]
        if node.is_view and node.op not in ("getitem", "placeholder") and node.inputs and node.inputs[0] in active:
            base[n] = base.get(node.inputs[0], node.inputs[0])
        else:
            base[n] = n
        for u in node.inputs:
            if u in active:
                end[base[u]] = max(end[base[u]], n)
    static, live = [], []
    for n in red.active:
        node = graph[n]
        if node.role is Role.PARAMETER:
            static.append(n)
        elif base[n] == n and node.role is not Role.GRADIENT and len(node.outputs) == 1 \
                and node.op != "placeholder" or node.role in (Role.INPUT, Role.TANGENT):
            live.append(n)
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


def _solve(model: "_Model", solver: str, time_limit_s: float | None) -> int:
    """Solve `model`, returning PuLP's solution status.

    HiGHS first solves the LP relaxation: the Alpa-style edge rows make it tight, and on
    the zoo models its optimum is usually integral, which proves it optimal for the ILP
    without MIP presolve and heuristics (about half the time on llama3-8b). Otherwise
    (or with CBC) the ILP is solved with branch and bound."""
    start = time.perf_counter()
    if solver == "highs":
        model.prob.solve(pulp.HiGHS(mip=False, msg=False, threads=1, timeLimit=time_limit_s,
                                    random_seed=SOLVER_SEED))
        fractional = sum(1 for xs in model.x.values() for v in xs
                         if abs((v.varValue or 0.0) - round(v.varValue or 0.0)) > INTEGRALITY_TOL)
        log.info("LP relaxation: %s in %.2f s, %d fractional choice variables",
                 pulp.LpStatus[model.prob.status], time.perf_counter() - start, fractional)
        if model.prob.sol_status == pulp.LpSolutionOptimal and not fractional:
            return pulp.LpSolutionOptimal
        if time_limit_s is not None:
            time_limit_s = max(1.0, time_limit_s - (time.perf_counter() - start))
    model.prob.solve(_make_solver(solver, time_limit_s))
    return model.prob.sol_status


def _fold_separable(edges: dict[tuple[NodeId, NodeId], list[list[float]]],
                    node_coef: dict[NodeId, list[float]]) -> dict[tuple[NodeId, NodeId], tuple]:
    """Edges whose matrix has one row class (cost depends on b only) or one column class
    (on a only) are added to node costs; the rest come back as (matrix, row classes,
    column classes) for edge variables. `node_coef` is this solve's own table (updated)."""
    kept = {}
    for (a, b), matrix in sorted(edges.items()):
        rows = _classes([tuple(r) for r in matrix])
        cols = _classes([tuple(c) for c in zip(*matrix)])
        if len(rows) == 1:
            for k, c in enumerate(matrix[0]):
                node_coef[b][k] += c
        elif len(cols) == 1:
            for j, row in enumerate(matrix):
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

    def add_edge_constraints(self, edges: dict[tuple[NodeId, NodeId], tuple]) -> int:
        """Edge variables and their row/column rows; returns the number of edge variables."""
        count = 0
        for (a, b), (matrix, rows, cols) in edges.items():
            e = [[self.prob.add_variable(f"e_{a}_{b}_{r}_{k}", lowBound=0) for k in range(len(cols))]
                 for r in range(len(rows))]
            count += len(rows) * len(cols)
            for r, members in enumerate(rows):
                self.prob += pulp.lpSum(e[r]) == pulp.lpSum(self.x[a][j] for j in members), f"edge/{a}->{b}/row={r}"
            for k, members in enumerate(cols):
                self.prob += pulp.lpSum(e[r][k] for r in range(len(rows))) == pulp.lpSum(
                    self.x[b][j] for j in members), f"edge/{a}->{b}/col={k}"
            for r, rmembers in enumerate(rows):
                for k, cmembers in enumerate(cols):
                    c = matrix[rmembers[0]][cmembers[0]]
                    if c:
                        self.objective[e[r][k]] = c * OBJECTIVE_SCALE
        return count

    def memory_expr(self, coef: dict[NodeId, list[float]]) -> pulp.LpAffineExpression:
        return pulp.LpAffineExpression([(self.x[o][j], m * MEMORY_SCALE) for o, row in sorted(coef.items())
                                        for j, m in enumerate(row) if m])

    def add_memory_constraints(self, terms, budget_bytes: float) -> None:
        for t, coef in terms:
            self.prob += self.memory_expr(coef) <= budget_bytes * MEMORY_SCALE, f"memory/t={t}"


def _min_memory_bytes(red: Reduction, terms, solver: str, time_limit_s: float | None) -> float:
    """Smallest peak memory any plan reaches at the checked points (for error messages)."""
    m = _Model("min_memory", red)
    m.add_one_choice_constraints()
    peak = m.prob.add_variable("peak_mib", lowBound=0)
    m.prob += peak
    for t, coef in terms:
        m.prob += m.memory_expr(coef) <= peak, f"memory/t={t}"
    m.prob.solve(_make_solver(solver, time_limit_s))
    return float(peak.value()) / MEMORY_SCALE


def solve_intra_op(graph: Graph, cluster: Cluster, mesh_shape: tuple[int, ...], *,
                   memory_budget_bytes: float | None = None, solver: str = "highs",
                   time_limit_s: float | None = None, nodes: tuple[NodeId, ...] | None = None
                   ) -> IntraOpSolution:
    """Optimal per-node placements of `graph` (or the subgraph `nodes`) on a `mesh_shape` mesh.

    Raises InfeasiblePlanError (a ValueError) when no plan fits `memory_budget_bytes`,
    with the smallest memory any plan needs.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    start = time.perf_counter()
    mesh_shape = tuple(int(s) for s in mesh_shape)
    space = enumerate_strategies(graph, mesh_shape)
    table = price(graph, space, cluster)
    red = reduce_graph(graph, space, table, nodes)
    pricer = ReshardPricer(table.links)

    node_coef: dict[NodeId, list[float]] = {o: [0.0] * len(red.smap[o]) for o in red.owners}
    for n in red.active:
        w = graph.weight(n)
        coef, costs = node_coef[red.owner[n]], table.nodes[n]
        tie = 0.0 if graph[n].role is Role.PARAMETER else MEMORY_TIE_BREAK_S_PER_BYTE
        for j, s in enumerate(red.smap[n]):
            coef[j] += w * (costs[s].compute_s + costs[s].comm_s + tie * costs[s].memory_bytes)
    edges = _fold_separable(_edge_matrices(graph, space, red, pricer, node_coef), node_coef)
    terms = _memory_terms(graph, space, table, red)
    built = time.perf_counter()

    model = _Model("intra_op", red)
    model.add_one_choice_constraints()
    model.add_node_costs(node_coef)
    num_edge_vars = model.add_edge_constraints(edges)
    if memory_budget_bytes is not None:
        model.add_memory_constraints(terms, memory_budget_bytes)
    model.prob += pulp.LpAffineExpression(model.objective)
    sol_status = _solve(model, solver, time_limit_s)
    if sol_status in (pulp.LpSolutionInfeasible, pulp.LpSolutionNoSolutionFound) and memory_budget_bytes is not None \
            and pulp.LpStatus[model.prob.status] != "Not Solved":
        need = _min_memory_bytes(red, terms, solver, time_limit_s)
        raise InfeasiblePlanError(
            f"No intra-op plan fits {memory_budget_bytes / 2**30:.3f} GiB/device for {graph.model.name} on "
            f"{cluster.spec} with mesh {mesh_shape}; the smallest needs {need / 2**30:.3f} GiB "
            f"(parameters, gradients and optimizer state at {16} bytes/param plus live activations). "
            "Raise the memory budget, use more devices or a smaller batch.",
            min_memory_bytes=need)
    if sol_status == pulp.LpSolutionOptimal:
        status = "optimal"
    elif sol_status == pulp.LpSolutionIntegerFeasible:
        status = "time_limit"
    else:
        raise RuntimeError(f"intra-op ILP ended with {pulp.LpStatus[model.prob.status]} "
                           f"(solution status {sol_status}) after {time.perf_counter() - start:.1f} s; "
                           f"time limit {time_limit_s} s. Raise --time-limit or check the log.")
    chosen = {o: max(range(len(xs)), key=lambda j: (xs[j].value() or 0.0, -j)) for o, xs in model.x.items()}
    solution = _extract(graph, space, table, red, pricer, chosen, terms, cluster, mesh_shape, memory_budget_bytes,
                        status=status, solver=solver,
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


def _extract(graph: Graph, space, table: CostTable, red: Reduction, pricer: ReshardPricer,
             chosen: dict[NodeId, int], terms, cluster: Cluster, mesh_shape: tuple[int, ...],
             budget: float | None, **meta) -> IntraOpSolution:
    """Per-node choices and costs recomputed from the chosen strategies (not from the solver)."""
    active = set(red.active)
    pick = {n: red.smap[n][chosen[red.owner[n]]] for n in red.active}
    reshard: dict[NodeId, float] = defaultdict(float)
    for v in red.active:
        for p, u in enumerate(graph[v].inputs):
            if u in active and len(graph[u].outputs) == 1:
                reshard[v] += pricer(graph[u].output, space[u][pick[u]].outputs[0], space[v][pick[v]].inputs[p])
    for param, grad in graph.param_grads:
        if param in active and grad in active:
            reshard[param] += pricer(graph[grad].output, space[grad][pick[grad]].outputs[0],
                                     space[param][pick[param]].outputs[0]) * graph.weight(grad) / graph.weight(param)
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
                                  memory_bytes=c.memory_bytes, weight=w))
    peak = 0.0
    for _t, coef in terms:
        peak = max(peak, sum(row[chosen[o]] for o, row in coef.items()))
    cost = CostBreakdown(compute_s=compute, comm_s=comm, reshard_s=resh, total_s=compute + comm + resh,
                         peak_memory_bytes=peak)
    return IntraOpSolution(graph_fingerprint=graph.fingerprint(), cluster=cluster.spec, mesh_shape=mesh_shape,
                           choices=tuple(choices), cost=cost, memory_budget_bytes=budget, **meta)
