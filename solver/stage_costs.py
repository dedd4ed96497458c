"""Pipeline stage costs from the intra-op ILP: pre, one layer and post on a submesh.

Where it sits: solver/, between the intra-op ILP (solver/intra_op/ilp.py) and the inter-op
DP (solver/stage_dp.py); called by solver/pipeline_search.py. Input: the traced step at
one global microbatch (a few layers standing for all: layer sharing), a submesh shape
(dp, tp) and the microbatch count m; output: frozen per-piece costs that the DP turns
into one `StageOption` per (recompute policy), memoised by the caller per
(submesh, microbatch, ZeRO layout). The ILP runs once per key on the whole traced
graph; cutting never re-solves it: a stage of any layer range is priced from the pieces.

Terms: a node's *piece* is "layer" (inside a repeated layer), "pre" (the modules whose
forward runs before the first layer: the embedding; and their backward) or "post" (the
rest: final norm, head, loss). With w_n the node's multiplicity and L the real depth:

    layer_s   = sum_{n in layer} w_n (compute + comm + reshard)_n / L   (one real layer)
    pre_s, post_s likewise without the division; gradient-sync edges carry the ILP's
    1/m weight, and the optimizer step over the piece's local parameters and the
    microbatches' gradient accumulation into its raw gradients
    (cost_model.grad_accumulation_time_s, as one-stage plans pay it) are added / m, so the
    critical stage's m t pays them once per step (stage_dp.py).

Memory per device (bytes): state = sum over parameters of w_n x their state bytes under
their placements and the precision policy (the ILP's memory of a parameter node,
cost_model/memory.py `parameter_state_bytes`); saved = activations the backward
reads (the base tensor of every forward value a backward node uses, at its chosen
placement, w-weighted). Recompute policies follow autopar/recompute.py's definitions:
"full" keeps only the layer's input (the boundary activation) and re-runs the layer's
forward; "selective" keeps the outputs of matmuls and attention (EXPENSIVE_OPS)
and re-runs the other forward ops. Pre and post are never recomputed. The transient
workspace is one layer's full saved set (two under full recompute: the recomputed copy).

A pipeline boundary passes every value that crosses it, each its own message
(`_boundary_messages`: the residual stream and its gradient back; a llama's rotary tables
and the labels forward only), at the placement its first consumer reads; full recompute
keeps the largest (the residual stream).

`lower_bound_s` bounds any plan's per-microbatch compute on D devices from below (every
op's FLOPs and bytes split perfectly over D devices, no communication) and
`memory_lower_bound_bytes` its peak memory: the pipeline search solves candidates in order
of the time bound, stops when it passes the best, and skips one-stage candidates whose
memory bound exceeds the budget.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import cost_model
from autopar.cluster import Cluster
from autopar.ir import ATTENTION_FWD_OPS, ATTENTION_OPS, GEMM_OPS, Graph, NodeId, Phase, Role
from autopar.placement import boundary_placements, shard_factor
from autopar.sharding import IntraOpSolution, parameter_placement_text, raw_gradient_bytes
from cost_model import compiled_scale, compute_time_s, core_share
from solver.intra_op.liveness import live_copies, live_intervals
from solver.stage_dp import StageOption

PIECES = ("pre", "layer", "post")
RECOMPUTE_POLICIES = ("none", "selective", "full")


@dataclass(frozen=True, slots=True, kw_only=True)
class PieceCost:
    time_s: float
    """Per microbatch: compute + resharding + gradient sync / m + optimizer / m."""
    forward_s: float
    """Forward compute (re-run by full recompute)."""
    cheap_forward_s: float
    """Forward compute of the ops selective recompute re-runs."""
    state_bytes: float
    saved_bytes: float
    """Activations kept for the backward with no recompute, per microbatch."""
    selective_saved_bytes: float
    local_params: float


@dataclass(frozen=True, slots=True, kw_only=True)
class SubmeshCosts:
    """One ILP solution, split into pieces (layer: one real layer)."""

    mesh: tuple[int, int]
    microbatch: int
    """Sequences per global microbatch."""
    num_microbatches: int
    zero: int
    """0: parameter placements free; 3: parameters forced to shard over dp (ZeRO-3/FSDP)."""
    ep: int = 1
    """dp: the routed experts stored split over dp (ParallelConfig.ep); 1: as `zero` says."""
    pieces: tuple[PieceCost, PieceCost, PieceCost]
    boundary_bytes: float
    """Per device: the largest activation one pipeline boundary passes per microbatch (what
    full recompute keeps)."""
    boundary_messages: tuple[tuple[float, bool], ...] = ()
    """Every value a pipeline boundary passes forward per microbatch: (bytes per device,
    whether its gradient comes back). `_boundary_messages`."""
    solution: IntraOpSolution
    graph: Graph

    def piece(self, name: str) -> PieceCost:
        return self.pieces[PIECES.index(name)]

    def option(self, recompute: str, p2p_s: float, key: object, call_s: float = 0.0) -> StageOption:
        """The DP's view of this submesh under a recompute policy; `call_s` the host time of
        one chunk call (cost_model.pipeline_call_time_s: a pipeline's stages pay it)."""
        pre, layer, post = self.pieces
        layer_s = layer.time_s + {"none": 0.0, "selective": layer.cheap_forward_s, "full": layer.forward_s}[recompute]
        act = {"none": layer.saved_bytes, "selective": layer.selective_saved_bytes,
               "full": self.boundary_bytes}[recompute]
        temp = layer.saved_bytes * (2 if recompute == "full" else 1)
        return StageOption(key=key, pre_s=pre.time_s, layer_s=layer_s, post_s=post.time_s, p2p_s=p2p_s,
                           pre_state_bytes=pre.state_bytes, layer_state_bytes=layer.state_bytes,
                           post_state_bytes=post.state_bytes, pre_act_bytes=pre.saved_bytes, layer_act_bytes=act,
                           post_act_bytes=post.saved_bytes, temp_bytes=temp, call_s=call_s)


def node_pieces(graph: Graph) -> tuple[str, ...]:
    """The piece of every node (module docstring); inputs and tangents go with their first user."""
    first_layer = next((n.id for n in graph.nodes if n.layer is not None and n.phase is Phase.FORWARD),
                       len(graph.nodes))
    pre_modules = {n.module_path.split(".")[0] for n in graph.nodes[:first_layer]
                   if n.phase is Phase.FORWARD and n.module_path}
    out: list[str] = []
    for node in graph.nodes:
        if node.layer is not None:
            out.append("layer")
            continue
        top = (node.param_name or node.module_path).split(".")[0]
        out.append("pre" if top and top in pre_modules else "post")
    for node in graph.nodes:
        if node.role in (Role.INPUT, Role.TANGENT) and graph.users(node.id):
            out[node.id] = out[graph.users(node.id)[0]]
    return tuple(out)


def _base(graph: Graph, nid: NodeId) -> NodeId:
    node = graph[nid]
    while (node.is_view or node.op == "getitem") and node.inputs and node.op != "placeholder":
        node = graph[node.inputs[0]]
    return node.id


EXPENSIVE_OPS = GEMM_OPS | ATTENTION_FWD_OPS
"""What selective recompute keeps: the matmuls and the fused attention forward (as
autopar/recompute.py's policy, from the same autopar/ir.py sets)."""


def split_solution(graph: Graph, solution: IntraOpSolution, cluster: Cluster, *, microbatch: int,
                   num_microbatches: int, zero: int, ep: int = 1) -> SubmeshCosts:
    """Per-piece costs of one whole-graph ILP solution on the stage's (dp, tp) submesh
    (module docstring): its gradient syncs (and, under ZeRO, parameter gathers) are the
    ILP's own collectives."""
    pieces = node_pieces(graph)
    L = max(1, graph.model.num_layers)
    mesh = solution.mesh_shape
    by_node = {c.node: c for c in solution.choices}
    derived = graph.parameter_derived()
    aliases = {alias for alias, _ in graph.tied_params}
    expensive = EXPENSIVE_OPS
    reduce_bytes = graph.model.precision.bytes("reduce")  # gradients sync in the policy's reduction dtype
    acc = {p: dict(time=0.0, fwd=0.0, cheap=0.0, state=0.0, saved=0.0, sel=0.0, params=0.0, tensors=0.0, grad_bytes=0.0,
                   raw_grad_bytes=0.0, sync=0.0, gather=0.0) for p in PIECES}
    for c in solution.choices:
        node, w = graph[c.node], c.weight
        a = acc[pieces[c.node]]
        a["time"] += w * (c.compute_s + c.comm_s + c.reshard_s)
        if node.phase is Phase.FORWARD and node.role is not Role.PARAMETER:
            a["fwd"] += w * c.compute_s
            if node.op not in expensive:
                a["cheap"] += w * c.compute_s
        if node.role is Role.GRADIENT:  # the raw gradient held over the microbatches (0 under ZeRO-2,
            a["state"] += w * c.memory_bytes  # whose parameter charges its accumulated shard)
        if node.role is Role.PARAMETER and c.node not in aliases:
            a["state"] += w * c.memory_bytes
            update = c.outputs[0] if c.update is None else c.update  # the optimizer steps the update shard
            a["params"] += w * node.output.numel / shard_factor(update, mesh)
            a["tensors"] += w
            a["grad_bytes"] += w * node.output.numel * reduce_bytes / shard_factor(update, mesh)
    # what a rank accumulates over the microbatches: each raw gradient as the backward leaves
    # it (its own placement), as spmd_search prices it
    for grad, nbytes in raw_gradient_bytes(graph, solution).items():
        acc[pieces[grad]]["raw_grad_bytes"] += nbytes
    saved: set[NodeId] = set()
    for node in graph.nodes:
        if node.phase is not Phase.BACKWARD or node.id not in by_node:
            continue
        for u in node.inputs:
            b = _base(graph, u)
            src = graph[b]
            if src.phase is Phase.FORWARD and b not in derived and b in by_node \
                    and src.role in (Role.ACTIVATION, Role.INPUT):
                saved.add(b)
    for b in saved:
        c = by_node[b]
        a = acc[pieces[b]]
        a["saved"] += c.weight * c.memory_bytes
        op = graph[b].op
        if op in expensive or graph[b].role is Role.INPUT:
            a["sel"] += c.weight * c.memory_bytes
    m = num_microbatches
    optimizer = {p: cost_model.optimizer_time_s(acc[p]["params"], cluster.hardware, tensors=acc[p]["tensors"])
                 * core_share(cluster) for p in PIECES}
    # the microbatches' gradient accumulation, once per step like the optimizer (the same
    # term one-stage plans pay: spmd_search.estimate, cost_model.grad_accumulation_time_s)
    for p in PIECES:
        acc[p]["time"] += cost_model.grad_accumulation_time_s(acc[p]["raw_grad_bytes"], m, 1, cluster.hardware) \
            * core_share(cluster) / m
    out = []
    for p in PIECES:
        a, div = acc[p], (L if p == "layer" else 1)
        out.append(PieceCost(time_s=(a["time"] + optimizer[p] / m) / div, forward_s=a["fwd"] / div,
                             cheap_forward_s=a["cheap"] / div, state_bytes=a["state"] / div,
                             saved_bytes=a["saved"] / div, selective_saved_bytes=a["sel"] / div,
                             local_params=a["params"] / div))
    messages = _boundary_messages(graph, solution.mesh_shape, derived, microbatch)
    boundary = max((b for b, _ in messages), default=0.0)
    # selective keeps the layer input too (it is what the recomputed ops start from)
    layer = out[1]
    out[1] = PieceCost(time_s=layer.time_s, forward_s=layer.forward_s, cheap_forward_s=layer.cheap_forward_s,
                       state_bytes=layer.state_bytes, saved_bytes=layer.saved_bytes,
                       selective_saved_bytes=layer.selective_saved_bytes + boundary, local_params=layer.local_params)
    return SubmeshCosts(mesh=(int(mesh[0]), int(mesh[1])), microbatch=microbatch, num_microbatches=m, zero=zero, ep=ep,
                        pieces=(out[0], out[1], out[2]), boundary_bytes=boundary, boundary_messages=messages,
                        solution=solution, graph=graph)


def _boundary_messages(graph: Graph, mesh: tuple[int, ...], derived: frozenset[NodeId],
                       rows: int) -> tuple[tuple[float, bool], ...]:
    """The values that cross a pipeline boundary between two layers, each sent forward as
    its own message in the layout the runtime sends it (`autopar.placement.
    boundary_placements`: split over dp where its first dim is the microbatch's `rows`,
    whole over tp), with its gradient sent back where it depends on a parameter:

    - what a layer reads from outside it: the residual stream (its gradient comes back)
      and, in a llama, the rotary cos and sin tables (computed from buffers: forward only);
    - what the head and loss (computed from the layers' output) read from before the
      layers: a model's labels, fed to the first stage with the tokens, ride through every
      boundary to the last. (Not node_pieces' "post": that also holds ops before the layers
      outside any module, such as GPT's sum of token and position embeddings.)

    Parameters and what is computed from them alone stay on their stage. Checked against
    the runtime's sends (the CPU sweep's S llama, pp2: per microbatch the first
    stage sends the stream, cos, sin and the labels and receives the stream's gradient)."""
    if not graph.layer_groups:
        return ()
    layer = set(graph.layer_groups[0].nodes[0])
    depends: set[NodeId] = set()  # on a parameter: its gradient comes back
    after: set[NodeId] = set()  # in a layer or computed from one: behind the cut
    for node in graph.nodes:  # topological order
        if node.role is Role.PARAMETER or any(i in depends for i in node.inputs):
            depends.add(node.id)
        if node.phase is Phase.FORWARD and (node.layer is not None or any(i in after for i in node.inputs)):
            after.add(node.id)
    sizes: dict[NodeId, float] = {}
    readers = [nid for nid in graph.layer_groups[0].nodes[0]] + \
        [nid for nid in sorted(after) if graph[nid].layer is None]  # the layers', then head and loss
    for nid in readers:
        node = graph[nid]
        if node.phase is not Phase.FORWARD:
            continue
        for v in node.inputs:
            u = _base(graph, v)  # a view (labels.reshape(-1)) is taken after the boundary: its base travels
            if u in sizes or u in layer or u in after or u in derived or len(graph[u].outputs) != 1:
                continue
            out = graph[u].output
            dp = mesh[0] if len(mesh) > 1 else 1
            sizes[u] = out.size_bytes / shard_factor(boundary_placements(out.shape, rows, dp)[:len(mesh)], mesh)
    return tuple((size, u in depends) for u, size in sizes.items())


def lower_bound_s(graph: Graph, cluster: Cluster, devices: int, scale: float = 1.0) -> dict[str, float]:
    """Per piece (layer: one real layer), a lower bound of any plan's per-microbatch compute
    on `devices` devices for a microbatch of `scale` x the traced one (any scale >= 1/batch):
    an op's FLOPs and the bytes of its activation operands are linear in the batch, the
    bytes of parameter-derived operands (weights) are not, so each part is scaled apart."""
    pieces = node_pieces(graph)
    derived = graph.parameter_derived()
    L = max(1, graph.model.num_layers)
    out = {p: 0.0 for p in PIECES}
    share = core_share(cluster)
    fused = compiled_scale(graph, cluster)  # a compiled program's memory-bound ops (cost_model/table.py)
    dtype = graph.model.dtype
    for node in graph.nodes:
        if node.role is Role.PARAMETER or node.is_view or (node.bytes_moved == 0 and node.flops == 0):
            continue
        operands = {u: graph[u].output.size_bytes for u in node.inputs if len(graph[u].outputs) == 1}
        if node.id in derived:  # a cast or transpose of a weight: no batch in it
            flops, moved = float(node.flops), float(sum(operands.values()) + node.output_bytes)
        else:
            fixed = sum(b for u, b in operands.items() if u in derived)
            flops = node.flops * scale
            moved = fixed + scale * (sum(operands.values()) - fixed + node.output_bytes)
        cls = "gemm" if node.op in GEMM_OPS else "attention" if node.op in ATTENTION_OPS else "memory"
        t = compute_time_s(flops / devices, moved / devices, cluster.hardware, dtype,
                           op_class=cls, causal=node.is_causal)
        out[pieces[node.id]] += graph.weight(node.id) * t * share * (fused if cls == "memory" else 1.0)
    out["layer"] /= L
    return out


def placement_summary(graph: Graph, solution: IntraOpSolution,
                      pieces: tuple[str, ...] = PIECES) -> tuple[tuple[str, str], ...]:
    """(parameter inside a layer group or outside, its (dp, tp) placement), one per name, for
    the parameters of `pieces`: the layers' once per layer group (layer sharing gives each
    group one choice)."""
    by_node = {c.node: c for c in solution.choices}
    of = node_pieces(graph)
    out: dict[str, str] = {}
    for node in graph.by_role(Role.PARAMETER):
        if of[node.id] not in pieces:
            continue
        name = node.param_name or node.name
        if node.layer is not None:
            name = re.sub(r"\.\d+\.", ".*.", name, count=1)
        if node.id in by_node:
            out.setdefault(name, parameter_placement_text(by_node[node.id]))
    return tuple(out.items())


def memory_lower_bound_bytes(graph: Graph, devices: int, scale: float = 1.0, doubled: Graph | None = None) -> float:
    """Per device, a lower bound of any one-stage plan's peak on `devices` devices for a
    microbatch of `scale` x the traced one: the intra-op ILP's memory row at the time of
    the largest live bytes (solver/intra_op/ilp.py: every parameter's state, its
    bytes per element under the graph's precision policy, plus every tensor live then, the same liveness
    and copies per traced layer, liveness.py `live_copies`),
    with every tensor split evenly over all devices, which no layout beats. Activations
    scale with the batch, weights and their casts do not. Under a recompute policy the
    graph holds the recomputed copies, so the peak inside a layer's backward is counted.

    `doubled`: the same step traced at twice the rows. Then every tensor's size at `scale`
    is the line through its two traced sizes (s1 + (scale - 1)(s2 - s1)): tensors of a
    weight's size in the backward (weight gradients before they are reduced) stay fixed
    instead of scaling with the batch (MPT-760m at 768 sequences: the plain scaling said
    94.9 GiB where a 74.3 GiB plan exists). Without it (or if the graphs differ in
    shape), every activation scales with `scale`."""
    aliases = {alias for alias, _ in graph.tied_params}
    derived = graph.parameter_derived()
    static, live, end = live_intervals(graph, range(len(graph)))
    copies = live_copies(graph, range(len(graph)), live, end)
    per_element = sum(cost_model.parameter_state_bytes(1.0, 1.0, 1.0, precision=graph.model.precision))
    state = sum(graph.weight(n) * graph[n].output.numel * per_element for n in static if n not in aliases)
    pair = doubled if doubled is not None and len(doubled) == len(graph) and all(
        a.op == b.op for a, b in zip(graph.nodes, doubled.nodes)) else None
    scaled: dict[int, float] = {}
    fixed: dict[int, float] = {}
    for n in live:
        size = copies[n] * graph[n].output.size_bytes
        delta = fixed if n in derived else scaled
        if pair is not None and n not in derived:
            # linear in the rows: the fixed part counts once, the per-row part scales
            grow = copies[n] * pair[n].output.size_bytes - size
            fixed[n] = fixed.get(n, 0.0) + size - grow
            fixed[end[n] + 1] = fixed.get(end[n] + 1, 0.0) - (size - grow)
            size = grow
        delta[n] = delta.get(n, 0.0) + size
        delta[end[n] + 1] = delta.get(end[n] + 1, 0.0) - size
    peak = running_scaled = running_fixed = 0.0
    for t in range(len(graph)):
        running_scaled += scaled.get(t, 0.0)
        running_fixed += fixed.get(t, 0.0)
        peak = max(peak, scale * running_scaled + running_fixed)
    return (state + peak) / devices
