"""The intra-op ILP's weight-gather groups: one latency per group the chosen placements form.

Where it sits: collected by solver/intra_op/ilp.py while it prices the edges from
parameter-derived tensors (edges.py `EdgePrices.add`) and the updated weights' gathers
(`_add_update_gathers`); its rows join the ILP (`_Model.add_indicator_rows`). The
solution is priced the same way (solver/intra_op/solution.py `grouped_gathers`).

Terms: a gather group g = (layer, phase, axis, dtype) (autopar/buckets.py `gather_group`)
is the one flat all-gather the program runs (codegen/apply.py `_gather_groups`,
codegen/collectives.py `WeightGather`) whenever at least one of its member edges
gathers a parameter-derived tensor on that axis (autopar/placement.py
`single_gather_axis`). Which edges do depends
on the placements, so the membership is not known before the solve; the latency is
charged through an indicator instead of a per-member share.

Math. Each member edge pays the all-gather's bandwidth term and its copies (share 0 of
the latency, `ReshardPricer.gather_time`); the group's latency is paid by y_g in [0, 1]:

    objective        += w_g lat(axis_g) y_g        w_g: the members' multiplicity (x grad_sync_weight
                                                   for update gathers); lat: collective_latency_s
    gather/g/e=(a,b)/P: y_g >= sum_{j in A_P} x[a,j] + sum_{k in B_P} x[b,k] - 1     (owners a != b)
    gather/g/e=(a)/F:   y_g >= sum_{j in F} x[a,j]                                  (a == b; update gathers)

For an edge u -> v whose tensor leaves owner a at layout src(j) and arrives at owner b's
layout dst(k): src -> dst is one all-gather on axis t exactly when dst[t] is Replicate and
src, with its Shard on t replaced by Replicate, equals dst (and no other axis of src shards
the same dim). So the pairs gathering on t fall into rectangles A_P x B_P, one per pattern
P = dst (A_P: the j whose src gives P, B_P: the k whose dst is P), and no two patterns of
one axis share a row or column. With one-hot x the row for P is 1 on its rectangle and
<= 0 off it: y_g is at least the indicator that some member gathers on g's axis, and the
minimisation (lat > 0) sets it to exactly that. The linearisation is exact for integer x
and adds no binaries (y is continuous); its LP relaxation is weaker than per-member
shares (a fractional x can leave y at 0), the price of charging real groups.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from autopar.buckets import UPDATE_PHASE, gather_group
from autopar.ir import NodeId
from autopar.placement import Placements, Replicate, Shard, single_gather_axis

Row = tuple[tuple[tuple[NodeId, int], ...], int]
"""One `y_g >=` row: the (owner, option) x variables summed, and the constant (0 or -1)."""


def source_patterns(src: Placements) -> list[tuple[int, Placements]]:
    """(axis t, pattern) for each axis t on which `src` could be all-gathered alone: src[t]
    a Shard of a dim no other axis shards; the pattern is src with Replicate on t."""
    out = []
    for t, p in enumerate(src):
        if isinstance(p, Shard) and not any(isinstance(q, Shard) and q.dim == p.dim
                                            for i, q in enumerate(src) if i != t):
            out.append((t, src[:t] + (Replicate(),) + src[t + 1:]))
    return out


def target_patterns(dst: Placements) -> list[tuple[int, Placements]]:
    """(axis t, dst) for each axis t on which `dst` is Replicate: the layouts an all-gather
    on t can arrive at."""
    return [(t, dst) for t, p in enumerate(dst) if isinstance(p, Replicate)]


class GatherGroups:
    """The gather groups of one solve and their rows, collected member by member."""

    def __init__(self, latency_s: Sequence[float]) -> None:
        self.latency_s = tuple(latency_s)
        """Per mesh axis: one all-gather's latency on it (collective_latency_s)."""
        self.weight: dict[tuple, float] = {}
        """Per group: the multiplicity of its collective per microbatch (the largest of its members')."""
        self.rows: dict[tuple, set[Row]] = defaultdict(set)

    def _group(self, key: tuple, weight: float) -> set[Row]:
        self.weight[key] = max(self.weight.get(key, 0.0), weight)
        return self.rows[key]

    def add_edge(self, layer: int | None, phase: str, dtype: str, a: NodeId, srcs: Sequence[Placements],
                 b: NodeId, dsts: Sequence[Placements], weight: float) -> None:
        """A member edge: its tensor leaves owner `a` at srcs[j] (option j) and arrives at owner
        `b`'s dsts[k]; read `weight` times per microbatch."""
        if a == b:
            by_axis: dict[int, list[int]] = defaultdict(list)
            for j, (s, d) in enumerate(zip(srcs, dsts)):
                t = single_gather_axis(s, d)
                if t is not None:
                    by_axis[t].append(j)
            for t, options in by_axis.items():
                self._group(gather_group(layer, phase, t, dtype), weight).add((tuple((a, j) for j in options), 0))
            return
        rows_of: dict[tuple, list[int]] = defaultdict(list)
        cols_of: dict[tuple, list[int]] = defaultdict(list)
        for j, s in enumerate(srcs):
            for key in source_patterns(s):
                rows_of[key].append(j)
        for k, d in enumerate(dsts):
            for key in target_patterns(d):
                cols_of[key].append(k)
        for key in rows_of.keys() & cols_of.keys():
            terms = tuple((a, j) for j in rows_of[key]) + tuple((b, k) for k in cols_of[key])
            self._group(gather_group(layer, phase, key[0], dtype), weight).add((terms, -1))

    def add_update(self, layer: int | None, dtype: str, owner: NodeId, options: Sequence[int], axis: int,
                   weight: float) -> None:
        """A parameter whose `options` of `owner` gather its updated weights on `axis` once
        per step (`weight`: its multiplicity x grad_sync_weight)."""
        row = (tuple((owner, j) for j in options), 0)
        self._group(gather_group(layer, UPDATE_PHASE, axis, dtype), weight).add(row)

    def costs_s(self) -> dict[tuple, float]:
        """Per group: the objective's coefficient of y_g, w_g lat(axis)."""
        return {g: w * self.latency_s[g[2]] for g, w in self.weight.items()}
