"""Grouped collectives, priced the way the program runs them: weight gathers and gradient buckets.

Where it sits: shared by the two halves of solver/intra_op: the ILP's objective
(solver/intra_op/ilp.py), which must charge a collective before the placements are
known, and the reading of the chosen solution (solver/intra_op/solution.py), which
prices the collectives the program will run. Both use these functions so that the
objective and the reported cost group collectives alike. The gather groups' latency in
the objective is solver/intra_op/gather_rows.py's (exact: one per group formed).

Terms: a *gather group* is the set of parameter-derived tensors that the program gathers
in one flat all-gather (autopar/buckets.py `gather_group`: one per consumer layer, phase,
mesh axis and dtype); a *bucket* is a set of gradients synced by one collective
(autopar/buckets.py `plan_buckets`). A member of either pays its share of the one
latency, its bytes over the group's.
"""

from __future__ import annotations

from typing import Any

from autopar.buckets import LayerBucket, gradient_bucket_key, plan_buckets
from autopar.ir import Graph, NodeId
from autopar.placement import Placements
from autopar.sharding import PricedCollective
from cost_model import ReshardPricer


def expected_bucket_bytes(graph: Graph) -> dict[NodeId, tuple[float, float]]:
    """Per gradient: the bytes of the bucket it is expected to travel in, as an all-reduce
    and as a reduce-scatter: the buckets autopar/buckets.py forms (the same items and order
    as `gradient_sync_collectives`: all-reduces fill DDP-sized buckets over the whole
    model, reduce-scatters one uncapped bucket per layer of the stack and DDP-sized ones
    outside it) if every gradient is synced the same way.
    What the ILP's objective charges a gradient's share of a bucket's latency against,
    before the placements (and so the real buckets) are known; where every gradient does
    sync one way (a 1-D data-parallel mesh, say) it is the real bucket. A small model's
    gradients fill one bucket, which still runs one collective."""
    grads = [g for _p, g in graph.param_grads]
    expected: dict[NodeId, list[float]] = {g: [0.0, 0.0] for g in grads}

    def per_layer(g: NodeId) -> Any:  # gradient_bucket_key's: a layer's bucket is uncapped
        layer = graph[g].layer
        return ("reduce_scatter", None) if layer is None else LayerBucket(("reduce_scatter",), layer)

    for k, (key_of, weighted) in enumerate(((lambda g: "all", True), (per_layer, False))):
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


def first_weight_layers(graph: Graph, active: set[NodeId]) -> dict[str, int | None]:
    """Per phase: the layer of its first node (graph order, the program's) that reads a
    parameter-derived tensor. Its gather groups (autopar/buckets.py `gather_group`) and
    other weight collectives are the phase's first: nothing runs before them to hide
    them (solver/intra_op/overlap_rows.py; codegen/prefetch.py issues each later one as
    soon as the one before it is waited)."""
    derived = graph.parameter_derived()
    first: dict[str, int | None] = {}
    for v in sorted(active):
        node = graph[v]
        if node.phase.value not in first and any(u in derived and len(graph[u].outputs) == 1 for u in node.inputs):
            first[node.phase.value] = node.layer
    return first


def activation_reads(graph: Graph, active: set[NodeId]) -> dict[tuple[NodeId, str], int]:
    """Per (activation, phase): how many input edges among `active` nodes read it in that
    phase. Where two or more do, the program runs each communicating reshard of it once per
    (phase, target placement) and every reader of that placement reads the one result
    (codegen/apply.py `_Interpreter.arg`, solution.py `extract_solution`): q, k and v
    reading one norm output gather it once; the ILP charges it once through one indicator
    (shared_rows.py). Parameter-derived tensors travel in gather groups instead
    (`param_gather_uses`)."""
    derived = graph.parameter_derived()
    reads: dict[tuple[NodeId, str], int] = {}
    for v in active:
        node = graph[v]
        for u in node.inputs:
            if u in active and u not in derived and len(graph[u].outputs) == 1:
                key = (u, node.phase.value)
                reads[key] = reads.get(key, 0) + 1
    return reads


def update_gather(pricer: ReshardPricer, meta: Any, strategy: Any, share: float) -> tuple[float, list[Any]] | None:
    """(time, collectives) of bringing a parameter's updated weights from its update
    placement back to its compute placement, once per step ((0, []) where they are the
    same; None where DTensor cannot). A gather on one axis travels in its layer's group
    (one flat all-gather, codegen/collectives.py `WeightGather`): its bandwidth term, copies
    and `share` of the group's latency (the ILP passes 0 and charges the group's latency
    once, solver/intra_op/gather_rows.py)."""
    if strategy.update is None or strategy.update == strategy.outputs[0]:
        return 0.0, []
    steps = pricer.collectives(meta, strategy.update, strategy.outputs[0])
    if steps is None:
        return None
    return pricer.gather_time(meta, strategy.update, strategy.outputs[0], share) or 0.0, list(steps)


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
