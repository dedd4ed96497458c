"""Lowering: a captured joint FX graph to the frozen, torch-free IR `autopar.ir.Graph`.

Where it sits: the second half of the trace stage (trace -> Graph -> strategies -> costs ->
solve -> Plan -> apply -> run). `lower(traced, ...)` reads a `Traced` from
autopar/trace/capture.py and builds the `Graph` that every later stage reads, in named
steps: the roles of the graph's inputs and outputs (from AOT's descriptors), a module path
and layer per node, one IR `Node` per FX node (op, tensors, role, phase, FLOPs, bytes
moved), the segment of each node, the groups of identical layers, and the model's summary.

Terms: a node's *role* says what it is to training (parameter, input, loss, gradient...),
its *phase* forward or backward; a *segment* is "pre", "layer" or "post" (autopar/ir.py);
a *layer group* is the layers with one signature, priced once and counted `multiplicity`
times. FLOPs count tensor-core work only (matmuls and attention); pointwise work is
priced by the bytes it moves, views move none.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import fx

from autopar import grouped_mm
from autopar.ir import (ATTENTION_FWD_OPS, ATTENTION_OPS, Graph, LayerGroup, ModelInfo, Node, NodeId, Phase, Ref, Role,
                        TensorMeta, layer_signature)
from autopar.trace.capture import TraceError, Traced

log = logging.getLogger(__name__)

VIEW_OPS = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.t.default",
    "aten.transpose.int", "aten.permute.default", "aten.expand.default", "aten.slice.Tensor",
    "aten.select.int", "aten.split.Tensor", "aten.split_with_sizes.default", "aten.unsqueeze.default",
    "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default", "aten.alias.default",
    "aten.detach.default", "aten.unbind.int", "aten.chunk.default", "aten.as_strided.default",
    "aten.diagonal.default", "aten.view_as_real.default", "aten.view_as_complex.default",
    "getitem", "placeholder", "constant",
})
"""Ops whose result aliases an input (and graph inputs): they move no bytes."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Outputs:
    """What the joint graph's outputs are, read from their AOT descriptors."""

    loss: fx.Node
    param_of_grad: dict[fx.Node, str]
    """Each parameter gradient and its parameter's name."""
    updated: tuple[tuple[str, fx.Node], ...]
    """(buffer name, its new value) of each buffer the forward updates in place."""


def lower(
    traced: Traced,
    *,
    name: str,
    batch: int,
    seq: int,
    real_layers: int | None = None,
    config: Any = None,
) -> Graph:
    """Lower a traced joint graph to the frozen IR (see autopar/ir.py)."""
    fx_nodes = [n for n in traced.gm.graph.nodes if n.op != "output"]
    ids = {n: i for i, n in enumerate(fx_nodes)}
    roles, names = _input_roles(fx_nodes)
    outs = _output_roles(next(n for n in traced.gm.graph.nodes if n.op == "output"))
    layer_of = _layer_reader(traced.layer_prefix)
    paths = _module_paths(fx_nodes, names, outs.param_of_grad, layer_of)
    nodes = _ir_nodes(fx_nodes, ids, roles, names, outs, paths, layer_of)
    nodes = [replace(nd, segment=seg) for nd, seg in zip(nodes, _segments(nodes, traced.layer_prefix))]

    param_ids = {names[n]: ids[n] for n in fx_nodes if roles.get(n) is Role.PARAMETER}
    param_grads = tuple((param_ids[outs.param_of_grad[n]], ids[n]) for n in fx_nodes
                        if n in outs.param_of_grad and outs.param_of_grad[n] in param_ids)
    traced_layers = sorted({nd.layer for nd in nodes if nd.layer is not None})
    real = real_layers if real_layers is not None else traced.num_layers
    groups = _group_layers(nodes, traced_layers, real)
    tied = tuple((param_ids[alias], param_ids[canon]) for alias, canon in traced.tied
                 if alias in param_ids and canon in param_ids)  # empty once trace() merged them
    info = _model_info(name, nodes, groups, batch, seq, real, config, {a for a, _ in tied})
    buffer_ids = {names[n]: ids[n] for n in fx_nodes if roles.get(n) is Role.BUFFER and n in names}
    buffer_updates = tuple((buffer_ids[name], ids[value]) for name, value in outs.updated if name in buffer_ids)
    graph = Graph(model=info, nodes=tuple(nodes), loss=ids[outs.loss], param_grads=param_grads,
                  layer_groups=groups, tied_params=tied, buffer_updates=buffer_updates,
                  trace_time_s=traced.trace_time_s)
    log.info("lowered %s: %d nodes, %d layer groups, %.3g FLOPs/step",
             name, len(nodes), len(groups), graph.flops_per_step)
    return graph


def _input_roles(fx_nodes: list[fx.Node]) -> tuple[dict[fx.Node, Role], dict[fx.Node, str]]:
    """(role, name) of each graph input: a parameter, buffer, tangent or batch input, and
    the parameter's or buffer's name in the model."""
    roles: dict[fx.Node, Role] = {}
    names: dict[fx.Node, str] = {}
    for n in fx_nodes:
        if n.op != "placeholder":
            continue
        desc = type(n.meta.get("desc")).__name__
        target = getattr(n.meta.get("desc"), "target", None)
        roles[n] = {"ParamAOTInput": Role.PARAMETER, "BufferAOTInput": Role.BUFFER,
                    "TangentAOTInput": Role.TANGENT}.get(desc, Role.INPUT)
        if target is not None:
            names[n] = target.removeprefix("model.")
    return roles, names


def _output_roles(output_node: fx.Node) -> _Outputs:
    """The loss, the parameter gradients and the updated buffers among the graph's outputs."""
    loss_fx: fx.Node | None = None
    param_of_grad: dict[fx.Node, str] = {}
    updated: list[tuple[str, fx.Node]] = []
    for value, desc in zip(output_node.args[0], output_node.meta.get("desc", ())):
        kind = type(desc).__name__
        if kind == "InputMutationAOTOutput" and isinstance(value, fx.Node):
            updated.append((desc.mutated_input.target.removeprefix("model."), value))
        if kind == "PlainAOTOutput" and getattr(desc, "idx", None) == 0:
            loss_fx = value
        elif kind == "GradAOTOutput" and isinstance(value, fx.Node) and hasattr(desc.grad_of, "target"):
            # (a gradient of a plain input, as a pipeline stage's joint graph has, is an activation)
            param_of_grad[value] = desc.grad_of.target.removeprefix("model.")
    if loss_fx is None:
        raise TraceError("traced graph has no loss output; the model must return a scalar loss")
    return _Outputs(loss=loss_fx, param_of_grad=param_of_grad, updated=tuple(updated))


def _layer_reader(layer_prefix: str) -> Callable[[str], int | None]:
    """A function from a module path to the index of the repeated layer it lies in
    (`<layer_prefix>.<i>...`), None outside the layers or when the model has none."""
    layer_re = re.compile(rf"^{re.escape(layer_prefix)}\.(\d+)(?:\.|$)") if layer_prefix else None

    def layer_of(path: str) -> int | None:
        match = layer_re.match(path) if layer_re is not None else None
        return int(match.group(1)) if match else None

    return layer_of


def _module_paths(fx_nodes: list[fx.Node], names: dict[fx.Node, str], param_of_grad: dict[fx.Node, str],
                  layer_of: Callable[[str], int | None]) -> dict[fx.Node, str]:
    """Module path of each node ('' if none): the one annotated at capture (backward nodes
    inherit their forward node's), the owning module's for a named input and for a
    parameter's gradient, and a layer's for a gradient accumulation add (below)."""
    paths: dict[fx.Node, str] = {}
    for n in fx_nodes:
        custom = n.meta.get("custom") or {}
        path = custom.get("module", "")
        paths[n] = path.removeprefix("model.").removeprefix("model") if path else ""
    for n, pname in names.items():
        paths[n] = pname.rpartition(".")[0]
    for n, pname in param_of_grad.items():
        paths[n] = pname.rpartition(".")[0]

    # Gradient accumulation adds carry no module: autograd's engine makes them. Each adds
    # a running gradient from later layers to a contribution of its own layer, so it
    # belongs to the lowest layer among its inputs (in backward order, the current one).
    for n in fx_nodes:
        if paths[n] or n.target is not torch.ops.aten.add.Tensor or n.meta.get("partitioner_tag") != "is_backward":
            continue
        known = [(layer_of(paths[a]), paths[a]) for a in n.all_input_nodes if paths.get(a)]
        known = [(layer, path) for layer, path in known if layer is not None]
        if known:
            paths[n] = min(known)[1]
    return paths


def _ir_nodes(fx_nodes: list[fx.Node], ids: dict[fx.Node, NodeId], roles: dict[fx.Node, Role],
              names: dict[fx.Node, str], outs: _Outputs, paths: dict[fx.Node, str],
              layer_of: Callable[[str], int | None]) -> list[Node]:
    """One IR Node per FX node, in graph order (a node's id is its index): its op, tensors,
    role, phase, FLOPs, bytes moved, module path and layer."""
    nodes: list[Node] = []
    for n in fx_nodes:
        op = _op_name(n)
        outputs = _meta(n.meta.get("val"))
        input_ids = tuple(ids[a] for a in _flat_nodes(n.args) + _flat_nodes(tuple(n.kwargs.values())))
        in_meta = [nodes[i].outputs[0] if len(nodes[i].outputs) == 1 else None for i in input_ids]
        tensor_in = [m for m in in_meta if m is not None]
        role, phase = _role_and_phase(n, roles, outs)
        is_view = op in VIEW_OPS
        flops = _flops(op, tensor_in, outputs) if len(tensor_in) == len(input_ids) else 0
        moved = 0 if is_view else sum(m.size_bytes for m in {id(x): x for x in tensor_in}.values()) + sum(
            t.size_bytes for t in outputs)
        path = paths.get(n, "")
        nodes.append(Node(
            id=ids[n], name=n.name, op=op, inputs=input_ids,
            args=tuple(_convert_arg(a, ids) for a in n.args),
            kwargs=tuple(sorted((k, _convert_arg(v, ids)) for k, v in n.kwargs.items())),
            outputs=outputs, output_slots=_output_slots(n.meta.get("val")), role=role, phase=phase,
            flops=flops, bytes_moved=moved,
            is_view=is_view, module_path=path, layer=layer_of(path),
            param_name=names.get(n) or outs.param_of_grad.get(n),
        ))
    return nodes


def _role_and_phase(n: fx.Node, roles: dict[fx.Node, Role], outs: _Outputs) -> tuple[Role, Phase]:
    """A node's role and phase: an input's role comes from its descriptor (tangents are the
    backward's inputs); any other node's phase from the partitioner's tag."""
    phase = Phase.BACKWARD if n.meta.get("partitioner_tag") == "is_backward" else Phase.FORWARD
    if n.op == "placeholder":
        role = roles[n]
        return role, Phase.BACKWARD if role is Role.TANGENT else Phase.FORWARD
    if n.op == "get_attr":
        return Role.BUFFER, phase
    if n is outs.loss:
        return Role.LOSS, phase
    if n in outs.param_of_grad:
        return Role.GRADIENT, phase
    return Role.ACTIVATION, phase


def _meta(value: Any) -> tuple[TensorMeta, ...]:
    if isinstance(value, torch.Tensor):
        shape = tuple(int(d) for d in value.shape)
        stride = tuple(int(s) for s in value.stride())
        contiguous = TensorMeta(shape=shape, dtype="").strides
        return (TensorMeta(shape=shape, dtype=str(value.dtype).removeprefix("torch."),
                           stride=() if stride == contiguous else stride),)
    if isinstance(value, (list, tuple)):
        return tuple(m for v in value for m in _meta(v) if isinstance(v, torch.Tensor))
    return ()


def _output_slots(value: Any) -> tuple[int, ...]:
    """Result positions of the tensors of a multi-output value (see Node.output_slots)."""
    if isinstance(value, (list, tuple)) and any(not isinstance(v, torch.Tensor) for v in value):
        return tuple(i for i, v in enumerate(value) if isinstance(v, torch.Tensor))
    return ()


def _convert_arg(arg: Any, ids: dict[fx.Node, NodeId]) -> Any:
    if isinstance(arg, fx.Node):
        return Ref(ids[arg])
    if isinstance(arg, (list, tuple)):
        return tuple(_convert_arg(a, ids) for a in arg)
    if isinstance(arg, (int, float, bool, str)) or arg is None:
        return arg
    return str(arg).removeprefix("torch.")


def _op_name(node: fx.Node) -> str:
    if node.op == "placeholder":
        return "placeholder"
    if node.op == "get_attr":
        return "constant"
    if node.target is getattr(__import__("operator"), "getitem"):
        return "getitem"
    return str(node.target)


def _flops(op: str, inputs: list[TensorMeta], outputs: tuple[TensorMeta, ...]) -> int:
    """Tensor-core FLOPs (matmuls and attention). Pointwise work is priced by bytes moved."""
    if op == "aten.mm.default":
        (m, k), (_, n) = inputs[0].shape, inputs[1].shape
        return 2 * m * k * n
    if op == "aten.addmm.default":
        (m, k), (_, n) = inputs[1].shape, inputs[2].shape
        return 2 * m * k * n
    if op in ("aten.bmm.default", "aten.baddbmm.default"):
        a, b = (inputs[0], inputs[1]) if op == "aten.bmm.default" else (inputs[1], inputs[2])
        bs, m, k = a.shape
        return 2 * bs * m * k * b.shape[2]
    if op in ATTENTION_OPS:
        q, k = (inputs[0], inputs[1]) if op in ATTENTION_FWD_OPS else (inputs[1], inputs[2])
        b, h, sq, d = q.shape
        sk = k.shape[2]
        fwd = 4 * b * h * sq * sk * d
        return fwd if op in ATTENTION_FWD_OPS else 2 * fwd
    return grouped_mm.grouped_mm_flops(op, inputs[0].shape, inputs[1].shape) if len(inputs) >= 2 else 0


def _segments(nodes: list[Node], layer_prefix: str) -> list[str]:
    """Segment of each node (autopar/ir.py module doc): "layer" inside the repeated layers,
    "post" for the loss; otherwise "pre" when the node precedes the first layer node or its
    module key was seen before it, else "post". A module's key is its path down to one
    component below the common prefix with the layer container's path, so a wrapper
    module around the whole model (Hugging Face's `hf.`) does not make everything "pre"."""
    container = layer_prefix.split(".") if layer_prefix else []

    def key(path: str) -> str:
        parts = path.split(".")
        common = 0
        while common < min(len(parts), len(container)) and parts[common] == container[common]:
            common += 1
        return ".".join(parts[:common + 1])

    first_layer = next((n.id for n in nodes if n.layer is not None), len(nodes))
    pre_keys = {key(n.module_path) for n in nodes[:first_layer] if n.module_path}
    segments: list[str] = []
    for n in nodes:
        if n.layer is not None:
            segments.append("layer")
        elif n.role is Role.LOSS:
            segments.append("post")
        else:
            segments.append("pre" if (key(n.module_path) in pre_keys or n.id < first_layer) else "post")
    return segments


def _flat_nodes(args: Any) -> tuple[fx.Node, ...]:
    out: list[fx.Node] = []
    for a in args:
        if isinstance(a, fx.Node):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(_flat_nodes(a))
    return tuple(out)


def _group_layers(nodes: list[Node], traced_layers: list[int], real_layers: int) -> tuple[LayerGroup, ...]:
    if not traced_layers:
        return ()
    members: dict[int, list[NodeId]] = {layer: [] for layer in traced_layers}
    for nd in nodes:
        if nd.layer is not None:
            members[nd.layer].append(nd.id)
    by_sig: dict[str, list[int]] = {}
    for layer in traced_layers:
        by_sig.setdefault(layer_signature(nodes, members[layer]), []).append(layer)
    scale = real_layers / len(traced_layers) if real_layers else 1.0
    groups = []
    for index, (sig, layers) in enumerate(sorted(by_sig.items(), key=lambda kv: kv[1][0])):
        multiplicity = int(round(len(layers) * scale))
        groups.append(LayerGroup(index=index, signature=sig, layers=tuple(layers),
                                 nodes=tuple(tuple(members[layer]) for layer in layers),
                                 multiplicity=max(multiplicity, len(layers))))
    return tuple(groups)


def _model_info(name: str, nodes: list[Node], groups: tuple[LayerGroup, ...], batch: int, seq: int,
                real_layers: int, config: Any, aliases: set[NodeId]) -> ModelInfo:
    weights = {nid: g.scale for g in groups for layer_nodes in g.nodes for nid in layer_nodes}
    num_params = sum(nd.output.numel * weights.get(nd.id, 1.0) for nd in nodes
                     if nd.role is Role.PARAMETER and nd.id not in aliases)
    dtype = next((nd.output.dtype for nd in nodes if nd.role is Role.PARAMETER), "float32")
    extra: dict[str, Any] = {}
    if config is not None:
        extra = dict(family="gpt" if hasattr(config, "bias") else "llama", hidden=config.hidden,
                     heads=config.heads, kv_heads=getattr(config, "num_kv_heads", config.heads),
                     vocab=config.vocab, ffn=config.ffn_hidden)
    return ModelInfo(name=name, num_parameters=int(round(num_params)), num_layers=real_layers,
                     batch=batch, seq=seq, dtype=dtype, **extra)
