"""The intra-op ILP's overlapped gradient sync: the part of it hidden behind the backward.

Where it sits: collected by solver/intra_op/edges.py while it prices the gradient edges
(`EdgePrices.add`; ilp.py `_fold_separable`); its rows join the ILP (`_Model.add_sync_overlap_rows`).
The solution is priced the same way (solver/intra_op/solution.py `extract_solution`, with
cost_model/table.py `exposed_sync_s`, whose docstring has the formula and its sources).

Terms: the program overlaps the gradient sync where it syncs inside the step graph (one
microbatch per step, or ZeRO-2's every microbatch: autopar/build/one_stage.py
`sync_in_step`): each bucket's collective is issued where its last gradient is computed
and waited at the end of the step (codegen/collectives.py `GradSync`). S(x) is the
gradient edges' charge (as the objective already holds it, exposed), S_last(x) the
charge of the edge of the gradient computed last (`solution.last_gradient`), W(x) the
backward compute of the microbatch.

Math. One continuous h >= 0, the sync time hidden:

    objective             -= h
    sync_overlap/window:  h <= rho W(x)             W(x) = sum_o sum_j b[o,j] x[o,j],
                                                    b = the backward nodes' weighted compute
    sync_overlap/sync:    h <= S(x) - S_last(x)     = the other gradient edges' charge, on
                                                    their x (folded edges) and e variables

So the objective charges S - h = max(S_last, S - rho W) = `exposed_sync_s` at the optimum
(minimising raises h to the smaller bound), exactly for one-hot x; no binary is added.
The edge classes of a pair holding gradient edges are taken over (charge, hideable
charge), so every e variable has one hideable coefficient.
"""

from __future__ import annotations

from autopar.ir import Graph, NodeId, Phase
from cost_model import CostTable
from solver.intra_op.sharing import Reduction


class HiddenSync:
    """The hideable gradient edges' charges, collected as the ILP prices them: per owner and
    option for edges folded into node costs (`node`), per owner pair as a matrix over
    (j_a, j_b) for edges with variables (`edges`); the backward compute per option
    (`backward`), and rho."""

    def __init__(self, graph: Graph, table: CostTable, red: Reduction, last_gradient: NodeId, rho: float) -> None:
        self.rho, self.last = rho, last_gradient
        self.node: dict[NodeId, list[float]] = {}
        self.edges: dict[tuple[NodeId, NodeId], list[list[float]]] = {}
        self.backward: dict[NodeId, list[float]] = {}
        for n in red.active:
            if graph[n].phase is not Phase.BACKWARD:
                continue
            w, costs = graph.weight(n), table.nodes[n]
            row = self.backward.setdefault(red.owner[n], [0.0] * len(red.smap[red.owner[n]]))
            for j, s in enumerate(red.smap[n]):
                row[j] += w * costs[s].compute_s

    def hideable(self, grad_node: NodeId) -> bool:
        """Whether the edge of `grad_node`'s gradient is in S - S_last."""
        return grad_node != self.last

    def add_node(self, owner: NodeId, j: int, num_options: int, seconds: float) -> None:
        self.node.setdefault(owner, [0.0] * num_options)[j] += seconds

    def add_matrix(self, a: NodeId, b: NodeId, unit: list[list[float | None]], weight: float) -> None:
        matrix = self.edges.setdefault((a, b), [[0.0] * len(unit[0]) for _ in unit])
        for row, unit_row in zip(matrix, unit):
            for k, c in enumerate(unit_row):
                if c:
                    row[k] += weight * c
