"""Graph profile: the one-time, per-graph precompute that makes pricing a config cheap.

Where it sits: `profile_graph(graph)` reads a traced `Graph` once (O(nodes)) and returns
a frozen `GraphProfile`; `analytic.step.price_profile(profile, config, cluster, ...)`
then prices any configuration in well under 10 ms. The whole-plan search builds one
profile per graph and keeps it; nothing here is global. `profile_graph` derives the
per-graph facts once (`_graph_facts`) and then each term of each segment by one function,
named below beside the term it computes.

Terms:
- segment: each node's `Node.segment` as `lower()` stamped it (autopar/ir.py): "layer"
  (profiled as the per-real-layer average over layer groups, each traced node weighted
  by `graph.weight`), "pre" (embedding, stage 0) and "post" (final norm, head and loss,
  last stage).
- item (`_op_item`, collected per segment by `_segment_ops`): one non-view op, as
  (phase, op class, FLOPs, bytes, stream, causal) at the traced batch. `stream` marks
  ops on the residual stream (output shaped batch x seq x hidden): tensor parallelism
  replicates them unless sequence parallelism is on; every other op (GEMMs, attention,
  MLP activations, vocab-sized tensors) splits over tp.
- saved (`_saved_storages`; bytes per segment: `_saved_bytes`): forward values read by
  the backward (the traced graph's liveness across the forward/backward boundary),
  deduplicated by storage (views and getitems alias their base). These are the
  activations a microbatch holds between its forward and backward.
- selective recompute (`_recomputable`) drops saved values made by memory-bound ops
  whose inputs are all saved or themselves recomputable (norm outputs, activation-
  function outputs); their forward ops are re-run in the backward. GEMM and attention
  outputs stay saved.
- full recompute (`_layer_input_bytes`) keeps only each layer's input (the residual
  stream entering it).
- parameters (`_parameter_counts`): elements split over tp or replicated (1-D hidden-sized
  norm weights), and tensors; tied head weights (`_tied_params`) are the count beyond the
  model's own.
- view ops (`_view_ops`) and weight traffic (`_fixed_bytes`: parameter reads and
  gradient writes, which do not grow with the batch).
All byte and FLOP figures are at the traced batch `graph.model.batch`; the pricer scales
per-microbatch quantities linearly by micro_batch / traced batch, which is exact for
these models (activations, FLOPs and activation traffic are linear in the batch at fixed
seq; weight reads and weight-gradient writes are kept apart as `fixed_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.ir import ATTENTION_BWD_OPS, ATTENTION_OPS, DTYPE_BYTES, SEGMENTS, Graph, Node, NodeId, Phase, Ref, Role


@dataclass(frozen=True, slots=True, kw_only=True)
class OpItem:
    phase: str
    """"forward" or "backward"."""
    op_class: str
    """"gemm", "attention" or "memory"."""
    flops: float
    bytes_moved: float
    stream: bool
    causal: bool = False
    fixed_bytes: float = 0.0
    """Part of bytes_moved that does not grow with the batch: weights read, weight
    gradients written. The rest scales with micro_batch / traced batch."""
    score_elems: float = 0.0
    """For attention: batch * heads * seq_q * seq_k (the s x s scores math attention makes)."""
    weight: float = 1.0
    """Copies per segment unit (per real layer for "layer")."""
    gemm_dims: tuple[int, int, int, int] = ()
    """For a GEMM: (B, M, N, K) of B x (M x K) @ (K x N) at the traced batch; () if unknown."""
    batch_axis: int = 1
    """Index into gemm_dims of the dimension that grows with the micro-batch (tokens)."""
    tp_axis: int = 1
    """Index into gemm_dims of the dimension tensor parallelism divides (a weight's
    output features for column-parallel layers, input features for row-parallel ones,
    the vocabulary for the head); the batch dimension of a batched GEMM over heads."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentProfile:
    items: tuple[OpItem, ...]
    recompute_items: tuple[OpItem, ...]
    """Forward ops selective recompute re-runs."""
    saved_stream_bytes: float
    saved_split_bytes: float
    """Saved activations, residual-stream part and tp-split part (bytes, traced batch)."""
    selective_stream_bytes: float
    selective_split_bytes: float
    """What stays saved under selective recompute."""
    input_bytes: float
    """Full-recompute checkpoint: the segment's residual-stream input."""
    score_elems: float
    """Attention score elements (batch * heads * s * s) of math attention."""
    params_split: float
    params_replicated: float
    """Parameter counts (elements): sharded over tp, or replicated (norm weights)."""
    largest_backward_bytes: float
    """Biggest single backward output (gradient workspace; e.g. logits grad)."""
    param_tensors: float = 0.0
    """Parameter tensors per unit (a per-tensor ZeRO-3 runtime issues one collective each)."""
    view_ops: tuple[float, float] = (0.0, 0.0)
    """View ops (forward, backward) per unit: free on a device, a host call in eager mode."""
    alternate_gemm_items: tuple[OpItem, ...] = ()
    """Every second forward GEMM of each layer in execution order (2nd, 4th, ...): what
    torchtitan's per-op selective policy re-runs besides the pointwise ops."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphProfile:
    name: str
    batch: int
    seq: int
    hidden: int
    heads: int
    kv_heads: int
    num_layers: int
    num_parameters: int
    dtype: str
    dtype_bytes: int
    model_flops_per_step: float
    """Forward+backward FLOPs of the real model at the traced batch (no recompute)."""
    layer_forward_flops: float
    """Per real layer, forward only (for the hardware-FLOP count of recomputation)."""
    pre: SegmentProfile
    layer: SegmentProfile
    post: SegmentProfile
    tied_params: float = 0.0
    """Head weights tied to the embedding: one storage when one stage holds both (pp = 1);
    with pp > 1 the last stage keeps its own copy (Megatron does the same)."""

    def segment(self, name: str) -> SegmentProfile:
        return {"pre": self.pre, "layer": self.layer, "post": self.post}[name]


def _storage(graph: Graph, nid: NodeId) -> tuple[NodeId, int]:
    """(producing node, output index) owning the memory of node `nid`'s value."""
    node = graph[nid]
    while True:
        if node.op == "getitem" and node.inputs:
            base = graph[node.inputs[0]]
            index = next((a for a in node.args[1:] if isinstance(a, int)), 0)
            if base.is_view and base.op != "placeholder" and base.inputs:
                node = graph[base.inputs[0]]
                continue
            return base.id, index
        if node.is_view and node.op != "placeholder" and node.inputs:
            node = graph[node.inputs[0]]
            continue
        return node.id, 0


def _op_class(node: Node) -> str:
    if node.op in ATTENTION_OPS:
        return "attention"
    return "gemm" if node.flops > 0 else "memory"


def _score_elems(graph: Graph, node: Node) -> float:
    refs = [a for a in node.args if isinstance(a, Ref)]
    offset = 1 if node.op in ATTENTION_BWD_OPS else 0  # backward starts with grad_out
    q = graph[refs[offset].node].outputs[0].shape
    k = graph[refs[offset + 1].node].outputs[0].shape
    return float(q[0] * q[1] * q[2] * k[2])


def _is_transpose_view(graph: Graph, nid: NodeId) -> bool:
    node = graph[nid]
    return node.is_view and any(k in node.op for k in (".t.", "transpose", "permute"))


def _gemm_dims(graph: Graph, node: Node, grad_roots: frozenset[NodeId],
               hidden: int) -> tuple[tuple[int, int, int, int], int, int]:
    """(B, M, N, K), batch axis, tp axis of an mm / addmm / bmm node (see OpItem).

    Weight GEMMs (one operand is a parameter): forward x @ W^T and input-gradient dy @ W
    have the tokens in M; the weight-gradient GEMM dy^T @ x (its output becomes a
    gradient) reduces over the tokens (K). Tensor parallelism divides the weight dimension
    that is not the hidden size (qkv/ffn/vocab), or the output features of a square one.
    Other GEMMs (attention's batched products) grow and split along the batch of heads."""
    operands = [i for i in node.inputs if graph[i].outputs and len(graph[i].outputs[0].shape) >= 2][-2:]
    if len(operands) != 2:
        return (), 1, 1
    a, b = (graph[i].outputs[0].shape for i in operands)
    batch = a[0] if len(a) == 3 else 1
    m, k, n = a[-2], a[-1], b[-1]
    dims = (batch, m, n, k)
    is_param = [graph[_storage(graph, i)[0]].role is Role.PARAMETER for i in operands]
    if len(a) == 3:
        return dims, 0, 0
    if is_param[1] or is_param[0]:
        weight_axes = (3, 2) if is_param[1] else (1, 3)  # (K, N) of b, or (M, K) of a
        batch_axis = 1 if is_param[1] else 2
        non_hidden = [ax for ax in weight_axes if dims[ax] != hidden]
        if non_hidden:
            tp_axis = max(non_hidden, key=lambda ax: dims[ax])
        else:  # square weight: the output features (N of x @ W^T, K of dy @ W)
            tp_axis = 3 if _is_transpose_view(graph, operands[1]) is False and is_param[1] else 2
        return dims, batch_axis, tp_axis
    if node.id in grad_roots:  # weight gradient: output dims are the weight's, K the tokens
        non_hidden = [ax for ax in (1, 2) if dims[ax] != hidden]
        tp_axis = max(non_hidden, key=lambda ax: dims[ax]) if non_hidden else 1
        return dims, 3, tp_axis
    return dims, 1, 1


@dataclass(frozen=True, slots=True, kw_only=True)
class _GraphFacts:
    """What every term below reads: derived once per graph by `_graph_facts`."""
    graph: Graph
    num_layers: int
    """Real layers (at least 1 when the graph has layer groups; the model's count otherwise)."""
    stream_numel: int
    """Elements of a residual-stream value (batch * seq * hidden); -1 without a hidden size."""
    segment: tuple[str, ...]
    """Per node: its `Node.segment` ("pre", "layer" or "post")."""
    unit: tuple[float, ...]
    """Per node: copies per segment unit (graph.weight / num_layers in "layer", else 1)."""
    saved: tuple[tuple[NodeId, int], ...]
    """Storages (producer, output index) of forward values read by the backward, in graph
    order of the first forward node aliasing each."""
    recomputable: frozenset[NodeId]
    """Saved producers selective recompute re-runs instead of keeping."""
    grad_roots: frozenset[NodeId]
    """Storages of the values that become parameter gradients."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _SavedBytes:
    """Saved activations of one segment unit, split residual stream / tp-split (bytes)."""
    stream: float
    split: float
    selective_stream: float
    selective_split: float


@dataclass(frozen=True, slots=True, kw_only=True)
class _ParameterCounts:
    """Parameter elements of one segment unit: tp-sharded, replicated, and tensor count."""
    split: float
    replicated: float
    tensors: float


@dataclass(frozen=True, slots=True, kw_only=True)
class _SegmentOps:
    """The op items of one segment unit and what is summed over them."""
    items: tuple[OpItem, ...]
    recompute_items: tuple[OpItem, ...]
    alternate_gemm_items: tuple[OpItem, ...]
    score_elems: float
    largest_backward_bytes: float
    forward_flops: float
    """Forward FLOPs of the unit (the per-layer figure is GraphProfile.layer_forward_flops)."""


def _saved_storages(graph: Graph) -> tuple[tuple[NodeId, int], ...]:
    """Liveness across the forward/backward boundary: the storages of forward values with
    a backward user (parameters and buffers excluded), deduplicated by storage."""
    saved: dict[tuple[NodeId, int], None] = {}
    for n in graph.nodes:
        if n.phase is not Phase.FORWARD or n.role in (Role.PARAMETER, Role.BUFFER):
            continue
        if any(graph[u].phase is Phase.BACKWARD for u in graph.users(n.id)):
            key = _storage(graph, n.id)
            if graph[key[0]].role not in (Role.PARAMETER, Role.BUFFER):
                saved[key] = None
    return tuple(saved)


def _recomputable(graph: Graph, saved: tuple[tuple[NodeId, int], ...]) -> frozenset[NodeId]:
    """Selective recompute: saved memory-bound forward producers whose activation inputs
    are all saved (or themselves recomputable: producers are visited in topological order)."""
    recomputable: set[NodeId] = set()
    saved_nodes = {k[0] for k in saved}
    for pid in sorted(saved_nodes):
        p = graph[pid]
        if p.op == "placeholder" or _op_class(p) != "memory" or p.phase is not Phase.FORWARD:
            continue
        ok = True
        for src in p.inputs:
            s_node = graph[_storage(graph, src)[0]]
            if s_node.op == "placeholder" or s_node.role in (Role.PARAMETER, Role.BUFFER, Role.INPUT):
                continue
            ok = ok and s_node.id in saved_nodes
        if ok:
            recomputable.add(pid)
    return frozenset(recomputable)


def _graph_facts(graph: Graph) -> _GraphFacts:
    m = graph.model
    # 0 for a model without a repeated layer stack: everything is pre/post, one stage holds it
    num_layers = max(1, sum(g.multiplicity for g in graph.layer_groups)) if graph.layer_groups else m.num_layers
    segment = tuple(n.segment for n in graph.nodes)
    assert all(segment), "profile_graph needs a graph from autopar.trace.lower (it stamps Node.segment)"
    saved = _saved_storages(graph)
    return _GraphFacts(
        graph=graph, num_layers=num_layers, stream_numel=m.batch * m.seq * m.hidden if m.hidden else -1,
        segment=segment,
        unit=tuple(graph.weight(nid) / num_layers if segment[nid] == "layer" else 1.0 for nid in range(len(graph))),
        saved=saved, recomputable=_recomputable(graph, saved),
        grad_roots=frozenset(_storage(graph, n.id)[0] for n in graph.nodes if n.role is Role.GRADIENT))


def _storage_bytes(graph: Graph, key: tuple[NodeId, int]) -> float:
    outs = graph[key[0]].outputs
    return float(outs[key[1]].size_bytes) if key[1] < len(outs) else 0.0


def _saved_bytes(facts: _GraphFacts, seg: str) -> _SavedBytes:
    """Saved activations of one unit of `seg`: sum over its saved storages of size * unit,
    residual-stream values (numel = b*s*h, last dim h) apart from tp-split ones; the
    selective figures leave out the recomputable producers' storages."""
    graph, hidden = facts.graph, facts.graph.model.hidden
    stream_b = split_b = keep_stream = keep_split = 0.0
    for key in facts.saved:
        pid = key[0]
        if facts.segment[pid] != seg:
            continue
        size = _storage_bytes(graph, key) * facts.unit[pid]
        out = graph[pid].outputs[key[1]]
        stream = out.numel == facts.stream_numel and out.shape[-1] == hidden
        if stream:
            stream_b += size
        else:
            split_b += size
        if pid not in facts.recomputable:
            if stream:
                keep_stream += size
            else:
                keep_split += size
    return _SavedBytes(stream=stream_b, split=split_b, selective_stream=keep_stream, selective_split=keep_split)


def _parameter_counts(facts: _GraphFacts, seg: str) -> _ParameterCounts:
    """Parameters of one unit of `seg`: sum of numel * unit, a 1-D hidden-sized weight (a
    norm) counted as replicated over tp, every other as split; tensors: sum of unit."""
    split = replicated = tensors = 0.0
    for n in facts.graph.nodes:
        if n.role is not Role.PARAMETER or facts.segment[n.id] != seg:
            continue
        w = facts.unit[n.id]
        out = n.outputs[0]
        if len(out.shape) == 1 and out.shape[0] == facts.graph.model.hidden:
            replicated += out.numel * w
        else:
            split += out.numel * w
        tensors += w
    return _ParameterCounts(split=split, replicated=replicated, tensors=tensors)


def _view_ops(facts: _GraphFacts, seg: str) -> tuple[float, float]:
    """View ops of one unit of `seg` that are an op call (not a tuple index, an input slot or
    a constant: cost_model/table.py `HOSTLESS_VIEWS`, the views the ILP charges), (forward,
    backward), each weighted by unit."""
    from cost_model.table import HOSTLESS_VIEWS

    forward = backward = 0.0
    for n in facts.graph.nodes:
        if n.role is Role.PARAMETER or facts.segment[n.id] != seg:
            continue
        if n.is_view and n.op not in HOSTLESS_VIEWS:
            if n.phase is Phase.FORWARD:
                forward += facts.unit[n.id]
            else:
                backward += facts.unit[n.id]
    return forward, backward


def _fixed_bytes(facts: _GraphFacts, n: Node) -> float:
    """Weight traffic of an op (does not grow with the batch): its inputs whose storage is
    a parameter or buffer, plus its output when that becomes a gradient; at most bytes_moved."""
    graph = facts.graph
    moved = 0.0
    for src in dict.fromkeys(n.inputs):
        root = graph[_storage(graph, src)[0]]
        if root.role in (Role.PARAMETER, Role.BUFFER) and len(graph[src].outputs) == 1:
            moved += graph[src].outputs[0].size_bytes
    if n.id in facts.grad_roots:
        moved += n.output_bytes
    return min(moved, float(n.bytes_moved))


def _op_item(facts: _GraphFacts, n: Node) -> OpItem:
    """One op as the pricer reads it: class, FLOPs, bytes (fixed part apart), whether it is
    on the residual stream (memory-bound ops only), causal flag and score elements
    (attention), GEMM shape and axes (gemm), weight = unit."""
    graph, hidden = facts.graph, facts.graph.model.hidden
    cls = _op_class(n)
    dims, batch_axis, tp_axis = _gemm_dims(graph, n, facts.grad_roots, hidden) if cls == "gemm" else ((), 1, 1)
    out = n.outputs[0] if n.outputs else None
    is_stream = out is not None and out.numel == facts.stream_numel and out.shape[-1] == hidden
    return OpItem(phase=n.phase.value, op_class=cls, flops=float(n.flops), bytes_moved=float(n.bytes_moved),
                  fixed_bytes=_fixed_bytes(facts, n),
                  stream=is_stream and cls == "memory", causal=cls == "attention" and n.is_causal,
                  score_elems=_score_elems(graph, n) if cls == "attention" else 0.0, weight=facts.unit[n.id],
                  gemm_dims=dims, batch_axis=batch_axis, tp_axis=tp_axis)


def _segment_ops(facts: _GraphFacts, seg: str) -> _SegmentOps:
    """Op items of one unit of `seg` (non-view ops that compute or move something) and
    their sums: forward FLOPs (sum of flops * unit), attention score elements (sum of
    score_elems * unit), the largest backward output; the forward items selective
    recompute re-runs (recomputable producers) and every second forward GEMM of each layer."""
    items: list[OpItem] = []
    recompute: list[OpItem] = []
    alternate: list[OpItem] = []
    scores = largest_backward = forward_flops = 0.0
    gemms_in_layer: dict[int, int] = {}
    for n in facts.graph.nodes:
        if n.role is Role.PARAMETER or facts.segment[n.id] != seg:
            continue
        if n.is_view or n.op == "placeholder" or (n.flops == 0 and n.bytes_moved == 0):
            continue
        item = _op_item(facts, n)
        items.append(item)
        if n.phase is Phase.FORWARD:
            forward_flops += n.flops * facts.unit[n.id]
            if n.id in facts.recomputable:
                recompute.append(item)
            if item.op_class == "gemm" and n.layer is not None:
                count = gemms_in_layer[n.layer] = gemms_in_layer.get(n.layer, 0) + 1
                if count % 2 == 0:
                    alternate.append(item)
            if item.op_class == "attention":
                scores += item.score_elems * facts.unit[n.id]
        else:
            largest_backward = max(largest_backward, float(n.output_bytes))
    return _SegmentOps(items=tuple(items), recompute_items=tuple(recompute), alternate_gemm_items=tuple(alternate),
                       score_elems=scores, largest_backward_bytes=largest_backward, forward_flops=forward_flops)


def _layer_input_bytes(facts: _GraphFacts) -> float:
    """Full-recompute checkpoint of the average layer: the saved residual-stream values
    entering each traced layer from outside it, sum over groups of bytes * scale / num_layers."""
    graph = facts.graph
    saved = set(facts.saved)
    total = 0.0
    for group in graph.layer_groups:
        for layer_nodes in group.nodes:
            members = set(layer_nodes)
            entering: dict[tuple[NodeId, int], None] = {}
            for nid in layer_nodes:
                if graph[nid].phase is not Phase.FORWARD:
                    continue
                for src in graph[nid].inputs:
                    key = _storage(graph, src)
                    if key[0] not in members and key in saved:
                        out = graph[key[0]].outputs[key[1]]
                        if out.numel == facts.stream_numel:
                            entering[key] = None
            total += sum(_storage_bytes(graph, k) for k in entering) * group.scale / facts.num_layers
    return total


def _segment_profile(facts: _GraphFacts, seg: str, ops: _SegmentOps) -> SegmentProfile:
    """One segment unit: its op items, saved bytes, checkpoint input (the layer's entering
    residual stream; for pre/post, which are never recomputed, everything they keep),
    parameters and view ops."""
    saved = _saved_bytes(facts, seg)
    params = _parameter_counts(facts, seg)
    input_bytes = (_layer_input_bytes(facts) if seg == "layer"
                   else saved.selective_stream + saved.selective_split)
    return SegmentProfile(items=ops.items, recompute_items=ops.recompute_items, saved_stream_bytes=saved.stream,
                          saved_split_bytes=saved.split, selective_stream_bytes=saved.selective_stream,
                          selective_split_bytes=saved.selective_split, input_bytes=input_bytes,
                          score_elems=ops.score_elems, params_split=params.split,
                          params_replicated=params.replicated, largest_backward_bytes=ops.largest_backward_bytes,
                          param_tensors=params.tensors, alternate_gemm_items=ops.alternate_gemm_items,
                          view_ops=_view_ops(facts, seg))


def _tied_params(pre: SegmentProfile, layer: SegmentProfile, post: SegmentProfile, num_layers: int,
                 num_parameters: int) -> float:
    """Head weights tied to the embedding: the parameters counted beyond the model's own
    count (pre + post + num_layers * layer - num_parameters), at most the head's split ones."""
    counted = sum(x.params_split + x.params_replicated for x in (pre, post)) + num_layers * (
        layer.params_split + layer.params_replicated)
    return min(post.params_split, max(0.0, counted - num_parameters))


def profile_graph(graph: Graph) -> GraphProfile:
    """Precompute everything `price_profile` needs from a traced graph (see module doc)."""
    m = graph.model
    facts = _graph_facts(graph)
    ops = {seg: _segment_ops(facts, seg) for seg in SEGMENTS}
    pre, layer, post = (_segment_profile(facts, seg, ops[seg]) for seg in SEGMENTS)
    return GraphProfile(
        name=m.name, batch=m.batch, seq=m.seq, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads,
        num_layers=facts.num_layers, num_parameters=m.num_parameters, dtype=m.dtype,
        dtype_bytes=DTYPE_BYTES.get(m.dtype, 4), model_flops_per_step=float(graph.flops_per_step),
        layer_forward_flops=ops["layer"].forward_flops, pre=pre, layer=layer, post=post,
        tied_params=round(_tied_params(pre, layer, post, facts.num_layers, m.num_parameters)),
    )
