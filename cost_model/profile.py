"""Graph profile: the one-time, per-graph precompute that makes pricing a config cheap.

Where it sits: `profile_graph(graph)` reads a traced `Graph` once (O(nodes)) and returns
a frozen `GraphProfile`; `cost_model.step.price_profile(profile, config, cluster, ...)`
then prices any configuration in well under 10 ms. The whole-plan search builds one
profile per graph and keeps it; nothing here is global.

Terms:
- segment: "layer" (the per-real-layer average over layer groups, each traced node
  weighted by `graph.weight`), "pre" (embedding, stage 0) and "post" (final norm, head
  and loss, last stage). Non-layer nodes belong to "pre" when their module was first
  seen before the first layer in forward order, else to "post".
- item: one non-view op, as (phase, op class, FLOPs, bytes, stream, causal) at the
  traced batch. `stream` marks ops on the residual stream (output shaped batch x seq x
  hidden): tensor parallelism replicates them unless sequence parallelism is on; every
  other op (GEMMs, attention, MLP activations, vocab-sized tensors) splits over tp.
- saved: forward values read by the backward (the traced graph's liveness across the
  forward/backward boundary), deduplicated by storage (views and getitems alias their
  base). These are the activations a microbatch holds between its forward and backward.
- selective recompute drops saved values made by memory-bound ops whose inputs are all
  saved or themselves recomputable (norm outputs, activation-function outputs); their
  forward ops are re-run in the backward. GEMM and attention outputs stay saved.
- full recompute keeps only each layer's input (the residual stream entering it).
All byte and FLOP figures are at the traced batch `graph.model.batch`; the pricer scales
per-microbatch quantities linearly by micro_batch / traced batch, which is exact for
these models (activations, FLOPs and activation traffic are linear in the batch at fixed
seq; weight reads and weight-gradient writes are kept apart as `fixed_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.ir import ATTENTION_BWD_OPS, ATTENTION_OPS, DTYPE_BYTES, Graph, Node, NodeId, Phase, Ref, Role

SEGMENTS = ("pre", "layer", "post")


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


def _gemm_dims(graph: Graph, node: Node, grad_roots: set[NodeId],
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


def profile_graph(graph: Graph) -> GraphProfile:
    """Precompute everything `price_profile` needs from a traced graph (see module doc)."""
    m = graph.model
    # 0 for a model without a repeated layer stack: everything is pre/post, one stage holds it
    num_layers = max(1, sum(g.multiplicity for g in graph.layer_groups)) if graph.layer_groups else m.num_layers
    stream_numel = m.batch * m.seq * m.hidden if m.hidden else -1

    def is_stream(node: Node) -> bool:
        out = node.outputs[0] if node.outputs else None
        return out is not None and out.numel == stream_numel and out.shape[-1] == m.hidden

    # segment of each node
    first_layer = next((n.id for n in graph.nodes if n.layer is not None), len(graph))
    pre_paths = {n.module_path.split(".")[0] for n in graph.nodes[:first_layer] if n.module_path}
    segment: list[str] = []
    for n in graph.nodes:
        if n.layer is not None:
            segment.append("layer")
        elif n.role is Role.LOSS:
            segment.append("post")
        else:
            segment.append("pre" if (n.module_path.split(".")[0] in pre_paths or n.id < first_layer) else "post")
    unit = {nid: graph.weight(nid) / num_layers if segment[nid] == "layer" else 1.0 for nid in range(len(graph))}

    # liveness across the forward/backward boundary, by storage
    saved: dict[tuple[NodeId, int], None] = {}
    for n in graph.nodes:
        if n.phase is not Phase.FORWARD or n.role in (Role.PARAMETER, Role.BUFFER):
            continue
        if any(graph[u].phase is Phase.BACKWARD for u in graph.users(n.id)):
            key = _storage(graph, n.id)
            if graph[key[0]].role not in (Role.PARAMETER, Role.BUFFER):
                saved[key] = None

    def storage_bytes(key: tuple[NodeId, int]) -> float:
        outs = graph[key[0]].outputs
        return float(outs[key[1]].size_bytes) if key[1] < len(outs) else 0.0

    # selective: memory-bound producers whose activation inputs are saved or recomputable
    recomputable: set[NodeId] = set()
    saved_nodes = {k[0] for k in saved}
    saved_producers = sorted(saved_nodes)
    for pid in saved_producers:
        p = graph[pid]
        if p.op == "placeholder" or _op_class(p) != "memory" or p.phase is not Phase.FORWARD:
            continue
        ok = True
        for src in p.inputs:
            s_node = graph[_storage(graph, src)[0]]
            if s_node.op == "placeholder" or s_node.role in (Role.PARAMETER, Role.BUFFER, Role.INPUT):
                continue
            ok = ok and s_node.id in saved_nodes  # saved, or itself recomputable (topological order)
        if ok:
            recomputable.add(pid)

    # weight traffic: inputs whose storage is a parameter, outputs that become gradients
    grad_roots = {_storage(graph, n.id)[0] for n in graph.nodes if n.role is Role.GRADIENT}

    def fixed_bytes(n: Node) -> float:
        moved = 0.0
        for src in dict.fromkeys(n.inputs):
            root = graph[_storage(graph, src)[0]]
            if root.role in (Role.PARAMETER, Role.BUFFER) and len(graph[src].outputs) == 1:
                moved += graph[src].outputs[0].size_bytes
        if n.id in grad_roots:
            moved += n.output_bytes
        return min(moved, float(n.bytes_moved))

    seg_data = {s: dict(items=[], rec=[], ss=0.0, sp=0.0, ks=0.0, kp=0.0, inp=0.0, scores=0.0,
                        pspl=0.0, prep=0.0, bwd=0.0, ntens=0.0, alt=[], vf=0.0, vb=0.0) for s in SEGMENTS}
    gemms_in_layer: dict[int, int] = {}
    for key in saved:
        pid = key[0]
        seg = seg_data[segment[pid]]
        size = storage_bytes(key) * unit[pid]
        out = graph[pid].outputs[key[1]]
        stream = out.numel == stream_numel and out.shape[-1] == m.hidden
        seg["ss" if stream else "sp"] += size
        if pid not in recomputable:
            seg["ks" if stream else "kp"] += size
    layer_fwd_flops = 0.0
    for n in graph.nodes:
        seg = seg_data[segment[n.id]]
        w = unit[n.id]
        if n.role is Role.PARAMETER:
            numel = n.outputs[0].numel
            replicated = len(n.outputs[0].shape) == 1 and n.outputs[0].shape[0] == m.hidden
            seg["prep" if replicated else "pspl"] += numel * w
            seg["ntens"] += w
            continue
        if n.is_view and n.op != "placeholder" and n.op != "getitem":
            seg["vf" if n.phase is Phase.FORWARD else "vb"] += w
        if n.is_view or n.op == "placeholder" or (n.flops == 0 and n.bytes_moved == 0):
            continue
        cls = _op_class(n)
        dims, batch_axis, tp_axis = _gemm_dims(graph, n, grad_roots, m.hidden) if cls == "gemm" else ((), 1, 1)
        item = OpItem(phase=n.phase.value, op_class=cls, flops=float(n.flops), bytes_moved=float(n.bytes_moved),
                      fixed_bytes=fixed_bytes(n),
                      stream=is_stream(n) and cls == "memory", causal=cls == "attention" and n.is_causal,
                      score_elems=_score_elems(graph, n) if cls == "attention" else 0.0, weight=w,
                      gemm_dims=dims, batch_axis=batch_axis, tp_axis=tp_axis)
        seg["items"].append(item)
        if n.phase is Phase.FORWARD:
            if segment[n.id] == "layer":
                layer_fwd_flops += n.flops * w
            if n.id in recomputable:
                seg["rec"].append(item)
            if cls == "gemm" and n.layer is not None:
                count = gemms_in_layer[n.layer] = gemms_in_layer.get(n.layer, 0) + 1
                if count % 2 == 0:
                    seg["alt"].append(item)
            if cls == "attention":
                seg["scores"] += item.score_elems * w
        else:
            seg["bwd"] = max(seg["bwd"], float(n.output_bytes))
    # full-recompute checkpoint: residual-stream values entering a layer from outside it
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
                        if out.numel == stream_numel:
                            entering[key] = None
            seg_data["layer"]["inp"] += sum(storage_bytes(k) for k in entering) * group.scale / num_layers
    for s in ("pre", "post"):
        seg_data[s]["inp"] = seg_data[s]["ks"] + seg_data[s]["kp"]

    def seg_profile(s: str) -> SegmentProfile:
        d = seg_data[s]
        return SegmentProfile(items=tuple(d["items"]), recompute_items=tuple(d["rec"]), saved_stream_bytes=d["ss"],
                              saved_split_bytes=d["sp"], selective_stream_bytes=d["ks"],
                              selective_split_bytes=d["kp"], input_bytes=d["inp"], score_elems=d["scores"],
                              params_split=d["pspl"], params_replicated=d["prep"], largest_backward_bytes=d["bwd"],
                              param_tensors=d["ntens"], alternate_gemm_items=tuple(d["alt"]),
                              view_ops=(d["vf"], d["vb"]))

    pre, layer, post = seg_profile("pre"), seg_profile("layer"), seg_profile("post")
    counted = sum(x.params_split + x.params_replicated for x in (pre, post)) + num_layers * (
        layer.params_split + layer.params_replicated)
    tied = min(post.params_split, max(0.0, counted - m.num_parameters))
    return GraphProfile(
        name=m.name, batch=m.batch, seq=m.seq, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads,
        num_layers=num_layers, num_parameters=m.num_parameters, dtype=m.dtype,
        dtype_bytes=DTYPE_BYTES.get(m.dtype, 4), model_flops_per_step=float(graph.flops_per_step),
        layer_forward_flops=layer_fwd_flops, pre=pre, layer=layer, post=post, tied_params=round(tied),
    )
