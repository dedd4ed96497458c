"""The intra-op ILP's overlapped collectives: the part of them hidden behind compute.

Where it sits: collected by solver/intra_op/edges.py while it prices the edges
(`EdgePrices.add`; ilp.py `_fold_separable`); its rows join the ILP
(`_Model.add_overlap_rows`). The solution is priced the same way
(solver/intra_op/solution.py `extract_solution`, with cost_model/table.py
`exposed_sync_s` and `hidden_comm_s`, whose docstrings have the formulas and sources).

Two kinds of collectives run beside compute in the program, each in a pool of charges:
- **the gradient sync** (pool "sync"), where the program syncs inside the step graph (one
  microbatch per step, or ZeRO-2's every microbatch: autopar/build/one_stage.py
  `sync_in_step`): each bucket's collective is issued where its last gradient is computed
  and waited at the end of the step (codegen/collectives.py `GradSync`). S(x) is the
  gradient edges' charge, less that of the gradient computed last
  (`solution.last_gradient`), which nothing is left to hide;
- **the weights' collectives** (pools "gather/forward" and "gather/backward"), in a
  one-stage program (codegen/prefetch.py): each collective of weights alone is issued as
  soon as the one before it is waited, so it runs beside the compute between that wait
  and its own first use (FSDP's prefetch of the next unit's all-gather). G_p(x) is the
  charge of the edges from parameter-derived tensors into phase p's nodes, and of their
  gather groups' latencies (gather_rows.py), less those of the first layer that reads
  weights in phase p (collective_groups.py `first_weight_layers`): its collectives are
  the phase's first, with nothing before them to hide behind.

W_p(x) is the compute of phase p's nodes at their options, rho = cost_model
`grad_sync_overlap` (the fitted share of a collective's time that compute hides, times
the hardware's `comm_overlap`: 0 on the cpu profile).

Math. One continuous variable >= 0 per pool, the time hidden of it, each charged -1:

    objective                  -= h_sync + h_f + h_b
    overlap/sync:              h_sync <= S(x)           S on their x (folded edges) and e variables
    overlap/gather/forward:    h_f <= G_forward(x)      G on x, e and the groups' y_g
    overlap/gather/backward:   h_b <= G_backward(x)
    overlap/window/forward:    h_f <= rho W_forward(x)
    overlap/window/backward:   h_sync + h_b <= rho W_backward(x)    (the sync and the
                                                        backward's gathers share its window)

So the objective charges, per phase, the collectives less min(hideable, rho W): exactly,
for one-hot x (minimising raises the h to their bounds); no binary is added. The edge
classes of a pair holding hideable edges are taken over (charge, each pool's charge), so
every e variable has one coefficient per pool. The bound is the aggregate one: a
collective hides behind the compute before its own use, and a phase whose collectives
are bunched where little compute runs hides less than the bound says (the same
approximation as the baseline's prefetch term, benchmarks/baselines/analytic/zero3.py).
"""

from __future__ import annotations

from typing import Any

from autopar.ir import Graph, NodeId, Phase
from cost_model import CostTable
from solver.intra_op.sharing import Reduction

SYNC = "sync"
GATHER_POOLS = {Phase.FORWARD.value: "gather/forward", Phase.BACKWARD.value: "gather/backward"}
POOLS = (SYNC, *GATHER_POOLS.values())
_NOT_GIVEN = object()


class HiddenComm:
    """The hideable charges, collected as the ILP prices them: per pool, per owner and
    option for edges folded into node costs (`node`) and per owner pair as a matrix over
    (j_a, j_b) for edges with variables (`edges`); the compute per phase, owner and option
    (`window`), and rho. `last_gradient` None: the sync is not overlapped; `first_layers`
    None: the weights' collectives are not ({phase: the first layer reading weights})."""

    def __init__(self, graph: Graph, table: CostTable, red: Reduction, rho: float, *,
                 last_gradient: NodeId | None, first_layers: dict[str, Any] | None) -> None:
        self.rho, self.last, self.first = rho, last_gradient, first_layers
        self.node: dict[str, dict[NodeId, list[float]]] = {p: {} for p in POOLS}
        self.edges: dict[str, dict[tuple[NodeId, NodeId], list[list[float]]]] = {p: {} for p in POOLS}
        self.window: dict[str, dict[NodeId, list[float]]] = {p: {} for p in GATHER_POOLS}
        for n in red.active:
            w, costs = graph.weight(n), table.nodes[n]
            row = self.window[graph[n].phase.value].setdefault(red.owner[n], [0.0] * len(red.smap[red.owner[n]]))
            for j, s in enumerate(red.smap[n]):
                row[j] += w * costs[s].compute_s

    def sync_pool(self, grad_node: NodeId) -> str | None:
        """The pool of the edge of `grad_node`'s gradient: "sync" if it is in S."""
        return SYNC if self.last is not None and grad_node != self.last else None

    def gather_pool(self, layer: Any, phase: str) -> str | None:
        """The pool of a weight's edge (or gather group) read by `layer` in `phase`."""
        if self.first is None or phase not in GATHER_POOLS or self.first.get(phase, _NOT_GIVEN) == layer:
            return None
        return GATHER_POOLS[phase]

    def pools_of(self, a: NodeId, b: NodeId) -> list[str]:
        """The pools that hold a matrix of owner pair (a, b), in POOLS order."""
        return [p for p in POOLS if (a, b) in self.edges[p]]

    def add_node(self, pool: str, owner: NodeId, j: int, num_options: int, seconds: float) -> None:
        self.node[pool].setdefault(owner, [0.0] * num_options)[j] += seconds

    def add_matrix(self, pool: str, a: NodeId, b: NodeId, unit: list[list[float | None]], weight: float) -> None:
        matrix = self.edges[pool].setdefault((a, b), [[0.0] * len(unit[0]) for _ in unit])
        for row, unit_row in zip(matrix, unit):
            for k, c in enumerate(unit_row):
                if c:
                    row[k] += weight * c
