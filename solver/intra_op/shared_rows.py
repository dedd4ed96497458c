"""The intra-op ILP's shared reshards: an activation read by several ops is resharded once per placement.

Where it sits: collected by solver/intra_op/edges.py while it prices the edges of
activations with two or more readers in one phase (collective_groups.py
`activation_reads`); its rows join the ILP beside the weight-gather groups'
(ilp.py `_Model.add_shared_reshard_rows`). The program runs each such reshard once and every
reader of that placement reads its result (codegen/apply.py `_Interpreter`), and the
solution prices it once (solution.py `extract_solution`): q, k and v reading one norm
output under sequence parallelism gather it once, not three times.

Terms: a shared reshard r = (activation u, phase, source layout s, target layout d) is
the one redistribution the program runs whenever u leaves its owner at s and at least
one reader of that phase asks for d, where s -> d communicates (autopar/placement.py
`communicates`; a local move, slicing a replica, runs per reader and is priced on its
edge). Its price p_r is the reshard's (cost_model ReshardPricer, the same price a lone
edge pays), times the multiplicity of u's layer.

Math. The readers' edge matrices carry 0 for every pair that moves (forbidden pairs stay
forbidden); the reshard is charged through z_r in [0, 1]:

    objective            += p_r z_r
    shared/r/e=(a,b):    z_r >= sum_{(j,k): src(j)=s, dst(k)=d} e_ab[j,k]                    (owners a != b)
    shared/r/e=(a):      z_r >= sum_{j: src(j)=s, dst(j)=d} x[a,j]                          (a follower chain)

e_ab are the edge variables of the owner pair (ilp.py: e_ab[j,k] = x[a,j] x[b,k] for
integer x, summed over classes of identical rows and columns; each pair is marked with
the reshards it makes, `marks`, and the classes keep marks apart). With one-hot x the
right side is 1 exactly when u is laid out at s and this reader asks for d, else 0;
minimisation (p_r > 0) sets z_r to the indicator that some reader asks for d: one charge
per placement asked for, however many readers ask. Exact for integer x, no binaries
added, and as tight in the LP relaxation as the edge variables themselves (rows over
x[a] + x[b] - 1 alone made the MoE search six times slower). Where an owner pair's edge
folds into node costs (no edge variables), the row is z_r >= sum_{j: src(j)=s} x[a,j] +
sum_{k: dst(k)=d} x[b,k] - 1. Twin layers (sharing.py: the same owners) form the same
rows; their reshards are merged into one z_r whose price sums theirs, since each layer
runs its own.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

from autopar.ir import NodeId
from autopar.placement import Placements, communicates

Row = tuple[tuple[tuple[NodeId, int], ...], int]
"""One `z_r >=` row: the (owner, option) x variables summed, and the constant (0 or -1)."""


class SharedReshards:
    """The shared reshards of one solve, their prices and rows, collected edge by edge."""

    def __init__(self) -> None:
        self.price: dict[tuple, float] = {}
        """Per reshard (twin key, phase, source, target): its price per read layer."""
        self.layers: dict[tuple, dict[NodeId, float]] = defaultdict(dict)
        """Per reshard: the activations (one per twin layer) it stands for, each its multiplicity."""
        self.rows: dict[tuple, set[Row]] = defaultdict(set)
        """Per reshard: its rows over x alone (a follower chain's)."""
        self.pairs: dict[tuple, set[tuple]] = defaultdict(set)
        """Per reshard: (a, b, options of a at s, options of b asking d), one per reader edge."""
        self.marks: dict[tuple[NodeId, NodeId], list[list[frozenset]]] = {}
        """Per owner pair: per (j_a, j_b), the reshards that pair makes."""

    def _reshard(self, key: tuple, u: NodeId, weight: float, price: float) -> set[Row]:
        self.price[key] = price
        layers = self.layers[key]
        layers[u] = max(layers.get(u, 0.0), weight)
        return self.rows[key]

    def add_edge(self, twin: tuple, u: NodeId, a: NodeId, srcs: Sequence[Placements], b: NodeId,
                 dsts: Sequence[Placements], unit: list[list[float | None]], weight: float
                 ) -> list[list[float | None]]:
        """A reader's edge u -> v between owners a != b: `unit[j][k]` prices moving u from
        srcs[j] (a's option j) to dsts[k] (b's option k), None where not allowed. Every
        priced move joins its shared reshard; returns the matrix the edge keeps (0 for
        those moves, None kept)."""
        rows_of: dict[Placements, list[int]] = defaultdict(list)
        cols_of: dict[Placements, list[int]] = defaultdict(list)
        for j, s in enumerate(srcs):
            rows_of[s].append(j)
        for k, d in enumerate(dsts):
            cols_of[d].append(k)
        marks = self.marks.setdefault((a, b), [[frozenset()] * len(dsts) for _ in srcs])
        kept = [list(row) for row in unit]
        for s, js in rows_of.items():
            for d, ks in cols_of.items():
                price = next((unit[j][k] for j in js for k in ks if unit[j][k] is not None), None)
                if not price or not communicates(s, d):  # a grouped op's edge may allow a move at some options only
                    continue
                key = (twin, s, d)
                self._reshard(key, u, weight, price)
                self.pairs[key].add((a, b, tuple(js), tuple(ks)))
                for j in js:
                    for k in ks:
                        marks[j][k] = marks[j][k] | {key}
                        kept[j][k] = None if unit[j][k] is None else 0.0
        return kept

    def add_within(self, twin: tuple, u: NodeId, a: NodeId, srcs: Sequence[Placements],
                   dsts: Sequence[Placements], row: Sequence[float | None], weight: float) -> list[float | None]:
        """A reader's edge inside owner a: at a's option j it moves u from srcs[j] to dsts[j]
        at price row[j]. Returns the row the node costs keep (0 for the shared moves)."""
        options: dict[tuple[Placements, Placements], list[int]] = defaultdict(list)
        for j, (s, d, c) in enumerate(zip(srcs, dsts, row)):
            if c and communicates(s, d):
                options[(s, d)].append(j)
        shared = set()
        for (s, d), js in options.items():
            self._reshard((twin, s, d), u, weight, row[js[0]]).add((tuple((a, j) for j in js), 0))
            shared.update(js)
        return [0.0 if j in shared else c for j, c in enumerate(row)]

    def rows_of(self, key: tuple, edge_vars: dict, edges: dict) -> list[tuple[list[tuple[str, Any]], int]]:
        """The rows of reshard `key`: (terms, constant) with terms ("x", (owner, option)) or
        ("e", edge variable), over the edge variables where its owner pair has them
        (`edge_vars[(a, b)]`: {(row class, column class): variable}; `edges[(a, b)]`:
        (matrix, row classes, column classes)), else over x."""
        out: list[tuple[list[tuple[str, Any]], int]] = [
            ([("x", t) for t in terms], const) for terms, const in sorted(self.rows[key])]
        for a, b, js, ks in sorted(self.pairs[key]):
            found = edge_vars.get((a, b))
            if found is None:
                out.append(([("x", (a, j)) for j in js] + [("x", (b, k)) for k in ks], -1))
                continue
            marks, (_matrix, rows, cols) = self.marks[(a, b)], edges[(a, b)]
            out.append(([("e", var) for (r, c), var in sorted(found.items())
                         if key in marks[rows[r][0]][cols[c][0]]], 0))
        return out

    def costs_s(self) -> dict[tuple, float]:
        """Per shared reshard: the objective's coefficient of z_r (its price times the
        multiplicities of the twin layers it stands for)."""
        return {r: price * sum(self.layers[r].values()) for r, price in self.price.items()}
