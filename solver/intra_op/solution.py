"""Reading the intra-op ILP's solution: per-node choices, costs and collectives.

Where it sits: the last step of `solve_intra_op` (solver/intra_op/ilp.py). The chosen
strategies are priced again from the cost table and the reshard pricer, not read off the
solver's objective (which carries tie-breakers and expected, not real, bucket and
gather-group sizes): what this returns is what the program runs, collective by
collective, and what the search ranks. Grouped collectives are priced against the groups
the chosen placements form: each gradient bucket and each weight-gather group pays one
latency, shared by its members in proportion to their bytes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import Any

from autopar.buckets import UPDATE_PHASE, gather_group, gather_share
from autopar.cluster import Cluster
from autopar.ir import Graph, NodeId, Phase, Role
from autopar.placement import Placements, communicates
from autopar.sharding import CostBreakdown, IntraOpSolution, NodeChoice, PricedCollective
from cost_model import CostTable, ReshardPricer, hidden_comm_s
from solver.intra_op.collective_groups import (
    first_weight_layers, gradient_bucket_shares, gradient_sync_collectives)
from solver.intra_op.sharing import Reduction


def _charge(parts: dict[tuple[NodeId, str, int], float], node: NodeId, charged: Any, factor: float = 1.0) -> None:
    """Add a pricer's split charge (cost_model `ChargePart`s, scaled by `factor` exactly as
    the time itself is) to `node`'s parts by (kind, axis)."""
    for kind, axis, seconds in charged or ():
        key = (node, kind, axis)
        parts[key] = parts.get(key, 0.0) + seconds * factor


def update_gathers(graph: Graph, space, red: Reduction, pricer: ReshardPricer, pick: dict[NodeId, int],
                   reshard: dict[NodeId, float], grad_sync_weight: float,
                   parts: dict[tuple[NodeId, str, int], float]) -> list[PricedCollective]:
    """The gathers of updated weights the chosen placements imply, once per step (charged to
    each parameter's `reshard`, weighted like the gradient sync): one flat all-gather per
    (layer, axis, dtype) group of single-axis gathers, as codegen/collectives.py
    `WeightGather` runs them, each member paying its bytes' share of that group's one
    latency (`grouped_gathers`); any other gather on its own. A traced layer's group stands
    for `weight` real layers' groups. `parts` gets the charge split by kind (`_charge`)."""
    groups: dict[tuple, dict[tuple, tuple[NodeId, NodeId, int]]] = {}
    out: list[PricedCollective] = []
    for n in red.active:
        node = graph[n]
        if node.role is not Role.PARAMETER:
            continue
        strategy = space[n][pick[n]]
        if strategy.update is None or strategy.update == strategy.outputs[0]:
            continue
        steps = pricer.collectives(node.output, strategy.update, strategy.outputs[0])
        assert steps is not None, f"the ILP chose an update placement DTensor cannot gather for node {n}"
        axis = pricer.gather_axis(node.output, strategy.update, strategy.outputs[0])
        if axis is not None:
            members = groups.setdefault(gather_group(node.layer, UPDATE_PHASE, axis, node.output.dtype), {})
            members[(n, strategy.update, strategy.outputs[0])] = (n, n, steps[0].bytes)
            continue
        reshard[n] += (pricer(node.output, strategy.update, strategy.outputs[0]) or 0.0) * grad_sync_weight
        _charge(parts, n, pricer.reshard_parts(node.output, strategy.update, strategy.outputs[0]), grad_sync_weight)
        out.extend(PricedCollective(src=n, dst=n, kind=c.kind, axis=c.axis, bytes=c.bytes, weight=graph.weight(n),
                                    gradient_sync=True) for c in steps)
    return out + grouped_gathers(graph, pricer, groups, reshard, parts, grad_sync_weight, gradient_sync=True)


def grouped_gathers(graph: Graph, pricer: ReshardPricer, groups: dict[tuple, dict[tuple, tuple[NodeId, NodeId, int]]],
                    reshard: dict[NodeId, float], parts: dict[tuple[NodeId, str, int], float], factor: float = 1.0,
                    *, gradient_sync: bool = False, charged: dict[tuple, float] | None = None) -> list[PricedCollective]:
    """Price the gather groups the program forms (autopar/buckets.py `gather_group`) and
    return one all-gather record per group. `groups`: per group, its members
    {(tensor, source, target placements): (reader, node charged, all-gather bytes)}, each
    tensor once per group as codegen/apply.py gathers it. Each member pays its bandwidth
    term, its copies and share = its bytes / the group's bytes of the one latency
    (`ReshardPricer.gather_time`), so a group's members pay exactly one latency together:
    the time function applied to the group's record. Charged to `reshard` (and `parts`)
    of the node charged, times `factor`; `charged` gets each group's weighted time."""
    out = []
    for key, members in groups.items():
        total = sum(nbytes for _reader, _to, nbytes in members.values())
        for (u, src, dst), (_reader, to, nbytes) in members.items():
            share = gather_share(nbytes, total)
            meta = graph[u].output
            t = (pricer.gather_time(meta, src, dst, share) or 0.0) * factor
            reshard[to] += t
            if charged is not None:
                charged[key] = charged.get(key, 0.0) + t * graph.weight(to)
            _charge(parts, to, pricer.gather_parts(meta, src, dst, share), factor)
        (u, src, dst), (reader, _to, _nbytes) = next(iter(members.items()))
        out.append(PricedCollective(src=u, dst=reader, kind="all_gather",
                                    axis=pricer.gather_axis(graph[u].output, src, dst), bytes=total,
                                    weight=graph.weight(reader), gradient_sync=gradient_sync))
    return out


def gradient_syncs(graph: Graph, space, pricer: ReshardPricer, pick: dict[NodeId, int], active: set[NodeId],
                   reshard: dict[NodeId, float], parts: dict[tuple[NodeId, str, int], float], grad_sync_weight: float,
                   *, each_microbatch: bool, charged: dict[NodeId, float] | None = None) -> list[PricedCollective]:
    """The gradient syncs the chosen placements imply, bucketed as the program runs them:
    each gradient's time (its share of its bucket's latency) charged to its parameter's
    `reshard`, weighted like the ILP's gradient-sync edges (`parts` gets the same split by
    kind), and the buckets' collectives. `each_microbatch` (ZeRO-2): every microbatch syncs
    them, as its edges. `charged` gets each gradient's weighted time ({gradient: seconds})."""
    syncs = [(param, grad) for param, grad in graph.param_grads if param in active and grad in active]
    sync_items = [(g, space[g][pick[g]].outputs[0], space[p][pick[p]].update_placements) for p, g in syncs]
    shares = gradient_bucket_shares(graph, sync_items, pricer)
    for param, grad in syncs:
        grad_meta, src, dst = graph.grad_meta(grad), space[grad][pick[grad]].outputs[0], \
            space[param][pick[param]].update_placements
        t = pricer.grad_sync_time(grad_meta, src, dst, share=shares.get(grad)) or 0.0
        reshard[param] += t * grad_sync_weight * graph.weight(grad) / graph.weight(param)
        if charged is not None:
            charged[grad] = t * grad_sync_weight * graph.weight(grad)
        if src != dst:
            _charge(parts, param, pricer.grad_sync_parts(grad_meta, src, dst, share=shares.get(grad)),
                    grad_sync_weight * graph.weight(grad) / graph.weight(param))
    grad_syncs = gradient_sync_collectives(graph, sync_items, pricer)
    if each_microbatch:
        grad_syncs = [replace(c, gradient_sync=False) for c in grad_syncs]
    return grad_syncs


def _seen(keys: set, key: tuple) -> bool:
    """Whether `key` is in `keys`; it is afterwards."""
    found = key in keys
    keys.add(key)
    return found


def last_gradient(graph: Graph, active: set[NodeId]) -> NodeId:
    """The parameter gradient the backward computes last (graph order): its bucket's sync is
    issued when no backward is left to hide it (cost_model `exposed_sync_s`'s S_last)."""
    return max(g for p, g in graph.param_grads if p in active and g in active)


def searched_fingerprint(graph: Graph, memo: dict | None) -> str:
    """`graph.fingerprint()`, kept in the search's `memo` (with the graph, so its id stays
    its own): one search solves each stage graph many times."""
    if memo is None:
        return graph.fingerprint()
    key = ("fingerprint", id(graph))
    if key not in memo:
        memo[key] = (graph, graph.fingerprint())
    return memo[key][1]


def extract_solution(graph: Graph, space, table: CostTable, red: Reduction, pricer: ReshardPricer,
             chosen: dict[NodeId, int], terms, cluster: Cluster, mesh_shape: tuple[int, ...],
             budget: float | None, *, grad_sync_weight: float, overlap: float = 0.0,
             overlapped: tuple[bool, bool] = (False, False), memo: dict | None = None, **meta) -> IntraOpSolution:
    """Per-node choices, costs and collectives recomputed from the chosen strategies (not
    from the solver's objective). `overlap`: rho; `overlapped`: whether the program overlaps
    the gradient sync, and the weights' collectives, with compute (overlap_rows.py): what
    hides is `CostBreakdown.sync_hidden_s` and `gather_hidden_s`, off `total_s`. `memo`: the
    search's memo (solve_intra_op's `prune_memo`), where the graph's fingerprint is kept:
    one search solves each stage graph many times, hashed once."""
    active = set(red.active)
    pick = {n: red.smap[n][chosen[red.owner[n]]] for n in red.active}
    reshard: dict[NodeId, float] = defaultdict(float)
    parts: dict[tuple[NodeId, str, int], float] = {}  # the same charges by (node, kind, axis)
    collectives: list[PricedCollective] = []

    derived = graph.parameter_derived()
    groups: dict[tuple, dict[tuple, tuple[NodeId, NodeId, int]]] = {}  # gather group -> members (grouped_gathers)
    resharded: set[tuple] = set()  # (activation, phase, source, target): run once, read by all
    weights: dict[tuple, float] = {}  # weighted time of the weights' collectives by (layer, phase, ...)

    def edge(u: NodeId, v: NodeId, src: Placements, dst: Placements, to: NodeId, shared: bool = True) -> float:
        """The time of edge u -> v (charged to node `to`), its collectives recorded; a
        grouped gather is recorded in its group, priced once the groups are whole; an
        activation's reshard once per phase and placement, for all its readers (`shared`:
        an input edge; shared_rows.py), charged to the first."""
        meta = graph[u].output
        if shared and u not in derived and communicates(src, dst) and _seen(resharded, (u, graph[v].phase, src, dst)):
            return 0.0
        steps = pricer.collectives(meta, src, dst)
        assert steps is not None, f"the ILP chose an impossible reshard {src} -> {dst} on edge {u}->{v}"
        if u in derived:
            axis = pricer.gather_axis(meta, src, dst)
            if axis is not None:  # one flat all-gather per group, each parameter once in it
                members = groups.setdefault(gather_group(graph[v].layer, graph[v].phase.value, axis, meta.dtype), {})
                members.setdefault((u, src, dst), (v, to, steps[0].bytes))
                return 0.0
        for c in steps:
            collectives.append(PricedCollective(src=u, dst=v, kind=c.kind, axis=c.axis, bytes=c.bytes,
                                                weight=graph.weight(v)))
        _charge(parts, to, pricer.reshard_parts(meta, src, dst))
        t = pricer(meta, src, dst) or 0.0
        if u in derived and communicates(src, dst):  # a weight's other collective: in its phase's pool
            weights[(graph[v].layer, graph[v].phase.value)] = weights.get((graph[v].layer, graph[v].phase.value), 0.0) \
                + t * graph.weight(v)
        return t

    for v in red.active:
        for p, u in enumerate(graph[v].inputs):
            if u in active and len(graph[u].outputs) == 1:
                reshard[v] += edge(u, v, space[u][pick[u]].outputs[0], space[v][pick[v]].inputs[p], v)
    for buf, value in graph.buffer_updates:
        if buf in active and value in active:
            reshard[value] += edge(value, buf, space[value][pick[value]].outputs[0], space[buf][pick[buf]].outputs[0],
                                   value, shared=False)
    collectives.extend(grouped_gathers(graph, pricer, groups, reshard, parts, charged=weights))
    synced: dict[NodeId, float] = {}
    collectives.extend(gradient_syncs(graph, space, pricer, pick, active, reshard, parts, grad_sync_weight,
                                      each_microbatch=bool(meta.get("grads_each_microbatch")), charged=synced))
    collectives.extend(update_gathers(graph, space, red, pricer, pick, reshard, grad_sync_weight, parts))
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
    hidden = _hidden(graph, table, red, pick, overlap, overlapped, synced, weights)
    peak = max((sum(row[chosen[o]] for o, row in coef.items()) for _t, coef in terms), default=0.0)
    cost = CostBreakdown(compute_s=compute, comm_s=comm, reshard_s=resh, total_s=compute + comm + resh - sum(hidden),
                         peak_memory_bytes=peak, sync_hidden_s=hidden[0], gather_hidden_s=hidden[1])
    return IntraOpSolution(graph_fingerprint=searched_fingerprint(graph, memo), cluster=cluster.spec, mesh_shape=mesh_shape,
                           choices=tuple(choices), cost=cost, memory_budget_bytes=budget,
                           collectives=tuple(collectives), grad_sync_weight=grad_sync_weight,
                           reshard_parts=tuple((n, kind, axis, t) for (n, kind, axis), t in sorted(parts.items())),
                           **meta)


def _hidden(graph: Graph, table: CostTable, red: Reduction, pick: dict[NodeId, int], rho: float,
            overlapped: tuple[bool, bool], synced: dict[NodeId, float], weights: dict[tuple, float]
            ) -> tuple[float, float]:
    """(sync hidden, weights' collectives hidden) of the chosen placements, as the ILP's
    overlap rows take them (overlap_rows.py, cost_model `hidden_comm_s`): per phase, the
    hideable collectives (the sync but the last gradient's; the weights' collectives but
    those of the phase's first layer reading weights) less what rho x the phase's compute
    hides. `weights`: the weighted time of the weights' collectives, keyed by (layer,
    phase, ...)."""
    sync_on, weights_on = overlapped
    if rho <= 0 or not (sync_on or weights_on):
        return 0.0, 0.0
    active = set(red.active)
    window = {ph.value: 0.0 for ph in Phase}
    for n in red.active:
        window[graph[n].phase.value] += graph.weight(n) * table.nodes[n][pick[n]].compute_s
    sync = sum(synced.values()) - synced[last_gradient(graph, active)] if sync_on and synced else 0.0
    gathers = {ph.value: 0.0 for ph in Phase}
    if weights_on:
        first = first_weight_layers(graph, active)
        for (layer, phase, *_rest), t in weights.items():
            if phase in gathers and first.get(phase, object()) != layer:
                gathers[phase] += t
    sync_hidden = hidden_comm_s(sync, window["backward"], rho)  # the backward's window: the sync's first
    gather_hidden = hidden_comm_s(gathers["forward"], window["forward"], rho) \
        + hidden_comm_s(sync + gathers["backward"], window["backward"], rho) - sync_hidden
    return sync_hidden, gather_hidden
