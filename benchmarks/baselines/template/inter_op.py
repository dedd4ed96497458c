"""Inter-op planning: how much work each pipeline stage gets, and where to cut the layers.

Where it sits: benchmarks/baselines/template/, called by the template grid (search.py here)
for every pipeline degree it tries; the product cuts stages in solver/stage_dp.py.
Reads the frozen Graph only; returns new frozen values.

Terms: the model is  pre (embedding) | L repeated layers | post (final norm, head, loss),
each node's part as `lower()` stamped it (`Node.segment`, autopar/ir.py).
A *cut* `n = (n_0, ..., n_{p-1})` gives stage k the next n_k >= 1 layers; stage 0 also
runs pre and stage p-1 runs post. A model without a repeated layer stack (L = 0: a plain
MLP of distinct layers, a small CNN) is all pre and post: one stage holds everything, and
its only cut is (0,). Work is in FLOPs per sequence (forward + backward,
plus one more layer forward with full recomputation).

Math (min-max stage time, the pipeline's critical path; exact, not a heuristic):

    minimise   T = max_k  w * n_k + a * [k = 0] + c * [k = p-1]
    subject to sum_k n_k = L,  n_k >= 1 integer

where w is a layer's work and a, c the pre and post work. For a target T, stage k can
hold at most cap_k(T) = floor((T - extra_k) / w) layers, so T is feasible iff every
cap_k(T) >= 1 and sum_k cap_k(T) >= L. Feasibility is monotone in T and the optimum is
one of the values w * n + extra_k, so a binary search over those candidate values finds
the smallest feasible T exactly (tests/unit/test_inter_op.py checks it against brute
force over all compositions). Surplus capacity is then taken away from the earliest
stages first: under 1F1B stage k keeps p - k microbatches in flight, so stage 0 holds the
most activations and is the one to lighten (memory balance at no cost in T).

With uniform layers and no pre/post work this reduces to Megatron's even split; when the
embedding and head are heavy (large vocabularies) the end stages get fewer layers.
The interleaved schedule needs L divisible by p * v and keeps the even split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from autopar.ir import SEGMENTS, Graph, Phase, Role


@dataclass(frozen=True, slots=True, kw_only=True)
class StageWork:
    """Per-sequence work and parameter counts of the model's three parts."""

    num_layers: int
    layer_flops: float
    """Forward + backward FLOPs of one real layer for one sequence."""
    layer_forward_flops: float
    pre_flops: float
    post_flops: float
    layer_params: int
    pre_params: int
    post_params: int

    @property
    def num_parameters(self) -> int:
        return self.layer_params * self.num_layers + self.pre_params + self.post_params

    def layer_work(self, recompute: str) -> float:
        """Layer FLOPs per sequence including the recomputed forward (full recompute)."""
        return self.layer_flops + (self.layer_forward_flops if recompute == "full" else 0.0)

    def stage_flops(self, cuts: Sequence[int], index: int, recompute: str) -> float:
        flops = cuts[index] * self.layer_work(recompute)
        if index == 0:
            flops += self.pre_flops
        if index == len(cuts) - 1:
            flops += self.post_flops
        return flops

    def stage_params(self, cuts: Sequence[int], index: int) -> int:
        params = cuts[index] * self.layer_params
        if index == 0:
            params += self.pre_params
        if index == len(cuts) - 1:
            params += self.post_params
        return params


def stage_work(graph: Graph) -> StageWork:
    """Split the traced graph's FLOPs and parameters into pre / per-layer / post, by each
    node's `Node.segment` (stamped once by `lower()`, autopar/ir.py)."""
    batch = max(1, graph.model.batch)
    num_layers = graph.model.num_layers
    per_layer = max(1, num_layers)  # L = 0: no layer nodes, every per-layer sum below is 0
    aliases = {alias for alias, _ in getattr(graph, "tied_params", ())}

    flops = dict.fromkeys(SEGMENTS, 0.0)
    params = dict.fromkeys(SEGMENTS, 0)
    layer_fwd = 0.0
    for node in graph.nodes:
        assert node.segment in SEGMENTS, f"node {node.name} has no segment: the graph was not built by lower()"
        weight = graph.weight(node.id)
        if node.role is Role.PARAMETER:
            if node.id not in aliases:
                numel = sum(t.numel for t in node.outputs)
                params[node.segment] += int(round(numel * weight)) if node.segment == "layer" else numel
            continue
        flops[node.segment] += node.flops * weight
        if node.segment == "layer" and node.phase is Phase.FORWARD:
            layer_fwd += node.flops * weight
    return StageWork(
        num_layers=num_layers,
        layer_flops=flops["layer"] / per_layer / batch,
        layer_forward_flops=layer_fwd / per_layer / batch,
        pre_flops=flops["pre"] / batch, post_flops=flops["post"] / batch,
        layer_params=params["layer"] // per_layer, pre_params=params["pre"], post_params=params["post"],
    )


def uniform_cuts(num_layers: int, pp: int) -> tuple[int, ...]:
    """Megatron's split: L // p each, the remainder to the middle stages (end stages lighter)."""
    if pp < 1 or num_layers < pp:
        raise ValueError(f"cannot cut {num_layers} layers into {pp} pipeline stages; use pp <= {num_layers}")
    base, extra = divmod(num_layers, pp)
    cuts = [base] * pp
    # middle-out so the embedding and head stages are the ones left with `base`
    order = sorted(range(pp), key=lambda k: (min(k, pp - 1 - k) == 0, abs(2 * k - (pp - 1)), k))
    for k in order[:extra]:
        cuts[k] += 1
    return tuple(cuts)


def _capacities(target: float, pp: int, layer_cost: float, extras: Sequence[float]) -> list[int]:
    # a tiny relative slack so T computed as w * n + extra is not lost to float rounding
    slack = 1e-12 * max(target, 1.0)
    return [int((target - extras[k] + slack) // layer_cost) for k in range(pp)]


def balanced_cuts(num_layers: int, pp: int, layer_cost: float, first_extra: float = 0.0,
                  last_extra: float = 0.0) -> tuple[int, ...]:
    """The exact min-max cut (module docstring); ties lighten the earliest stages."""
    if pp < 1 or num_layers < pp:
        raise ValueError(f"cannot cut {num_layers} layers into {pp} pipeline stages; use pp <= {num_layers}")
    if layer_cost <= 0:
        return uniform_cuts(num_layers, pp)
    extras = [0.0] * pp
    extras[0] += first_extra
    extras[-1] += last_extra

    def feasible(target: float) -> bool:
        caps = _capacities(target, pp, layer_cost, extras)
        return min(caps) >= 1 and sum(caps) >= num_layers

    values = sorted({layer_cost * n + e for n in range(1, num_layers + 1) for e in set(extras)})
    target = values[_first_true(values, feasible)]
    caps = _capacities(target, pp, layer_cost, extras)
    surplus = sum(caps) - num_layers
    while surplus > 0:  # take layers from the earliest stages first, round-robin
        progressed = False
        for k in range(pp):
            if surplus and caps[k] > 1:
                caps[k] -= 1
                surplus -= 1
                progressed = True
        assert progressed, "surplus left but every stage has one layer"
    return tuple(caps)


def _first_true(values: Sequence[float], pred: Callable[[float], bool]) -> int:
    """Index of the first value where the monotone predicate holds (binary search)."""
    lo, hi = 0, len(values) - 1
    assert pred(values[hi]), "the largest candidate must be feasible"
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(values[mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def cut_candidates(work: StageWork, pp: int, *, recompute: str, interleave: int = 1) -> tuple[tuple[int, ...], ...]:
    """Stage cuts worth pricing for one pipeline degree: the even split and the balanced one."""
    L = work.num_layers
    if pp == 1:
        return ((L,),)
    if interleave > 1:
        if L % (pp * interleave):
            return ()
        return (tuple([L // pp] * pp),)
    even = uniform_cuts(L, pp)
    balanced = balanced_cuts(L, pp, work.layer_work(recompute), work.pre_flops, work.post_flops)
    return (even,) if balanced == even else (even, balanced)
