"""Tracer: capture one training step (forward + backward) on fake tensors and lower it.

Where it sits: first stage of the flow. `trace(model, example_inputs)` returns the joint
forward+backward `torch.fx.GraphModule` of model + loss, captured with
`aot_export_joint_with_descriptors` under a `FakeTensorMode` on the CPU fake device (never
the meta device: the backward silently vanishes there). `lower(gm)` turns it into the
frozen, torch-free `autopar.ir.Graph` that every later stage reads. `trace_model(...)` does
both for a zoo model, building it under the fake mode so a 405B model costs no memory.

Terms: a *layer* is a child of the model's largest `nn.ModuleList` (`layers.<i>`); module
paths are recorded per node with `torch.fx.traceback.annotate` from module hooks, and
backward nodes inherit them through autograd's sequence numbers.

The optimizer is not traced: its memory and time are priced per parameter downstream.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx.traceback as fx_traceback
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.capabilities import layer_container as _find_layer_container
from autopar.ir import (ATTENTION_FWD_OPS, ATTENTION_OPS, Graph, LayerGroup, ModelInfo, Node, NodeId, Phase, Ref, Role,
                        TensorMeta, layer_signature)
from autopar.models.zoo import ModelSource

log = logging.getLogger(__name__)

LossFn = Callable[..., torch.Tensor]


class TraceError(ValueError):
    """The model cannot be traced into a training graph; the message says where and why."""


VIEW_OPS = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.t.default",
    "aten.transpose.int", "aten.permute.default", "aten.expand.default", "aten.slice.Tensor",
    "aten.select.int", "aten.split.Tensor", "aten.split_with_sizes.default", "aten.unsqueeze.default",
    "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default", "aten.alias.default",
    "aten.detach.default", "aten.unbind.int", "aten.chunk.default", "aten.as_strided.default",
    "aten.diagonal.default", "aten.view_as_real.default", "aten.view_as_complex.default",
    "getitem", "placeholder", "constant",
})


@dataclass(frozen=True, slots=True, kw_only=True)
class Traced:
    """What `trace` returns: the joint graph plus what lowering needs to know about it."""

    gm: fx.GraphModule
    layer_prefix: str
    """Module path of the repeated-layer container (`layers`), '' if none."""
    num_layers: int
    trace_time_s: float
    tied: tuple[tuple[str, str], ...] = ()
    """(alias, canonical) parameter names that share one tensor (tied embeddings)."""


# ---------------------------------------------------------------------------------------
# capture


class _LossStep(nn.Module):
    """model + loss as one module whose forward returns the scalar loss.

    With `loss_fn`, the model gets all example inputs but the last and the loss is
    `loss_fn(output, last_input)`. Without it, the model's own output must be the loss
    (or carry it as `.loss`, as Hugging Face models do when given labels).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn | None, aux_outputs: bool = False) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.aux_outputs = aux_outputs
        """The model returns (scalar loss, values that need no gradient...): a pipeline
        stage's joint graph (autopar/runtime/pipe_spmd.py). The graph's outputs follow the loss."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.aux_outputs:
            out = self.model(*args, **kwargs)
            if not (isinstance(out, tuple) and isinstance(out[0], torch.Tensor) and out[0].dim() == 0):
                raise TraceError(f"{type(self.model).__name__} must return (scalar loss, *values)")
            return out
        if self.loss_fn is not None:
            if not args:
                raise TraceError("loss_fn given but no example inputs: pass (inputs..., target)")
            out = self.loss_fn(self.model(*args[:-1], **kwargs), args[-1])
        else:
            out = self.model(*args, **kwargs)
        if not isinstance(out, torch.Tensor) and hasattr(out, "loss"):
            out = out.loss
        if not isinstance(out, torch.Tensor) or out.dim() != 0:
            what = type(out).__name__ if not isinstance(out, torch.Tensor) else f"a tensor of shape {tuple(out.shape)}"
            raise TraceError(
                f"{type(self.model).__name__}.forward returned {what}, not a scalar loss. autopar "
                "traces a training step: make forward return the loss, or pass "
                "loss_fn=lambda output, target: ... (the last example input is the target)"
            )
        return out


@contextlib.contextmanager
def _module_annotations(model: nn.Module, active: list[str]) -> Iterator[None]:
    """Tag every node created inside a submodule's forward with its module path."""
    contexts: list[Any] = []

    def pre(name: str) -> Callable[..., None]:
        def hook(_mod: nn.Module, _args: Any) -> None:
            cm = fx_traceback.annotate({"module": name})
            cm.__enter__()
            contexts.append(cm)
            active.append(name)
        return hook

    def post(_mod: nn.Module, _args: Any, _out: Any) -> None:
        contexts.pop().__exit__(None, None, None)
        active.pop()

    handles = []
    for name, mod in model.named_modules():
        if name:
            handles.append(mod.register_forward_pre_hook(pre(name)))
            handles.append(mod.register_forward_hook(post))
    try:
        yield
    finally:
        while contexts:  # a failed forward leaves its contexts open
            contexts.pop().__exit__(None, None, None)
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _hf_compiling_patch(model: nn.Module) -> Iterator[None]:
    """Hugging Face mask helpers branch on data unless they believe they are compiling."""
    if not any(type(m).__module__.startswith("transformers") for m in model.modules()):
        yield
        return
    original = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compiler.is_compiling = original  # type: ignore[assignment]


_DATA_DEPENDENT = re.compile(r"data.dependent|_local_scalar_dense|GuardOnDataDependent|item\(\)", re.I)
_OP_NAME = re.compile(r"aten\.[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)?")


def trace(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    loss_fn: LossFn | None = None,
    example_kwargs: dict[str, Any] | None = None,
    recompute: str = "none",
    aux_outputs: bool = False,
    layer_prefix: str | None = None,
) -> Traced:
    """Capture the joint forward+backward graph of `model` (+ `loss_fn`) on the inputs.

    `recompute` rewrites the graph for a recomputation policy (autopar/recompute.py), so
    everything downstream prices and runs the recomputed ops.

    `aux_outputs`: the model returns (scalar loss, *values needing no gradient) (see
    `_LossStep`); inputs that require grad get gradient outputs too. `layer_prefix`: the
    repeated layers' container path, where the model cannot show it (a pipeline chunk's
    flat graph, whose nodes carry their module paths in their meta: autopar/runtime/pipe_spmd.py).

    Real inputs and parameters are fine for small models; for large ones build the model
    and inputs under a `FakeTensorMode` first (see `trace_model`). Raises TraceError naming
    the module and op when the model cannot be captured.
    """
    if not isinstance(model, nn.Module):
        raise TraceError(f"trace needs an nn.Module, got {type(model).__name__}")
    if not any(True for _ in model.parameters()):
        raise TraceError(f"{type(model).__name__} has no parameters: there is nothing to train or shard")
    from autopar.batch import split

    example_inputs, keywords = split(example_inputs)
    example_kwargs = {**keywords, **(example_kwargs or {})}
    step = _LossStep(model, loss_fn, aux_outputs)
    found_prefix, num_layers = _find_layer_container(model)
    layer_prefix = found_prefix if layer_prefix is None else layer_prefix
    active: list[str] = []
    start = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack, fx_traceback.preserve_node_meta(), \
                _module_annotations(model, active), _hf_compiling_patch(model), \
                torch.nn.attention.sdpa_kernel(_sdpa_backends()):
            from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

            joint = aot_export_joint_with_descriptors(stack, step, tuple(example_inputs), example_kwargs or {})
            gm = joint.graph_module
    except TraceError:
        raise
    except Exception as exc:  # torch raises many types here; we add the where and what
        where = active[-1] if active else "<top level>"
        text = f"{type(exc).__name__}: {exc}"
        op = _OP_NAME.search(text)
        op_name = op.group(0) if op else "unknown op"
        if _DATA_DEPENDENT.search(text):
            raise TraceError(
                f"cannot trace {type(model).__name__}: data-dependent control flow in module "
                f"{where!r} (op {op_name}). autopar traces on fake tensors, so Python branches "
                "on tensor values (if x.sum() > 0, .item(), .tolist()) cannot be captured; "
                "use torch.where / torch.cond, or move the branch out of forward"
            ) from exc
        raise TraceError(
            f"cannot trace {type(model).__name__}: {op_name} in module {where!r} failed: "
            f"{text.splitlines()[0][:500]}"
        ) from exc
    tied = _tied_parameters(model)
    if tied:
        _merge_tied(gm, tied)
    _mutations_last(gm, type(model).__name__)
    _drop_empty_concat_inputs(gm)
    _drop_value_checks(gm)
    if recompute != "none":
        from autopar.recompute import apply_recompute

        copied = apply_recompute(gm, recompute, layer_prefix)
        log.info("recompute %s: %d forward ops recomputed in backward", recompute, copied)
    elapsed = time.perf_counter() - start
    log.info("traced %s: %d FX nodes in %.2f s", type(model).__name__, len(gm.graph.nodes), elapsed)
    return Traced(gm=gm, layer_prefix=layer_prefix, num_layers=num_layers, trace_time_s=elapsed, tied=tied)


def _drop_empty_concat_inputs(gm: fx.GraphModule) -> None:
    """`cat([empty, x])` (Hugging Face caches start from an empty tensor) is `x`: drop empty
    inputs of a concatenation, so its layout follows the real input's (an empty tensor
    of another rank has no sharded layout and would pin the concatenation replicated)."""
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.target is not torch.ops.aten.cat.default or not isinstance(node.args[0], (list, tuple)):
            continue
        parts = list(node.args[0])
        kept = [p for p in parts if not (isinstance(p, fx.Node) and p.meta.get("val") is not None
                                         and p.meta["val"].numel() == 0)]
        if len(kept) == len(parts) or not kept:
            continue
        changed = True
        if len(kept) == 1:
            with graph.inserting_before(node):
                clone = graph.call_function(torch.ops.aten.clone.default, (kept[0],))
            clone.meta = dict(node.meta)
            node.replace_all_uses_with(clone)
            graph.erase_node(node)
        else:
            node.args = (kept,) + tuple(node.args[1:])
    if changed:
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()


_VALUE_CHECKS = (torch.ops.aten._assert_async.default, torch.ops.aten._assert_async.msg)


def _drop_value_checks(gm: fx.GraphModule) -> None:
    """Drop runtime value checks and the ops only they read: F.one_hot traces to a
    comparison with arange plus `_assert_async(all(index >= 0))` and
    `_assert_async(all(index < num_classes))`. DTensor runs `all` over a sharded tensor as a
    pending product, a placement the strategy space leaves out, so each check would pin its
    index tensor whole on every device: no data parallelism for a model that one-hots
    anything batch-derived (mixture-of-experts routing, label smoothing). The checks return
    nothing; the eager model (and the single-process reference) still runs them."""
    graph = gm.graph
    checks = [n for n in graph.nodes if n.op == "call_function" and n.target in _VALUE_CHECKS]
    if not checks:
        return
    pending = list(checks)
    while pending:
        node = pending.pop()
        inputs = [a for a in node.all_input_nodes if a.op == "call_function"]
        graph.erase_node(node)
        pending.extend(a for a in inputs if not a.users and not a.is_impure())
    graph.lint()
    gm.recompile()


def _merge_tied(gm: fx.GraphModule, tied: tuple[tuple[str, str], ...]) -> None:
    """Make each tied parameter one graph input with one gradient (in place).

    The joint graph has an input and a gradient per parameter *name*; a tied embedding is
    one tensor under two names. The alias input is replaced by the canonical one and the
    canonical gradient becomes the sum of both, so every later stage (strategies, memory,
    the optimizer, the per-rank program) sees one parameter with one placement."""
    graph = gm.graph
    inputs = {getattr(n.meta.get("desc"), "target", "").removeprefix("model."): n
              for n in graph.nodes if n.op == "placeholder"}
    output = next(n for n in graph.nodes if n.op == "output")
    values, descs = list(output.args[0]), list(output.meta.get("desc", ()))
    grad_pos = {d.grad_of.target.removeprefix("model."): i for i, d in enumerate(descs)
                if type(d).__name__ == "GradAOTOutput" and hasattr(d.grad_of, "target")}  # not inputs' grads
    drop = []
    for alias, canon in tied:
        if alias not in inputs or canon not in inputs:
            continue
        inputs[alias].replace_all_uses_with(inputs[canon])
        ga, gc = grad_pos.get(alias), grad_pos.get(canon)
        if ga is not None and gc is not None and values[ga] is not None:
            if values[gc] is None:
                # only the alias was read (BERT's head bias: registered first on the head,
                # used through its decoder): its gradient is the parameter's whole gradient
                values[gc] = values[ga]
            else:
                with graph.inserting_before(output):
                    total = graph.call_function(torch.ops.aten.add.Tensor, (values[gc], values[ga]))
                total.meta["val"] = values[gc].meta["val"] + values[ga].meta["val"]
                total.meta["partitioner_tag"] = "is_backward"
                values[gc] = total
        if ga is not None:
            drop.append(ga)
        graph.erase_node(inputs[alias])
    keep = [i for i in range(len(values)) if i not in set(drop)]
    output.args = ([values[i] for i in keep],) + tuple(output.args[1:])
    output.meta["desc"] = [descs[i] for i in keep]
    graph._codegen = fx.graph.CodeGen()  # flat inputs and outputs: the export's pytree specs no longer fit
    graph.lint()
    gm.recompile()


def _mutations_last(gm: fx.GraphModule, model_name: str) -> None:
    """Move the new values of buffers the forward updates in place (AOT's input-mutation
    outputs, which come first) behind the loss and the gradients (in place), so every
    stage reads the loss first; lower() records them as Graph.buffer_updates. A forward
    that mutates a parameter or a batch input in place is refused: the optimizer alone
    changes parameters, and the batch is data."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values, descs = list(output.args[0]), list(output.meta.get("desc", ()))
    moved = [i for i, d in enumerate(descs) if type(d).__name__ == "InputMutationAOTOutput"]
    if not moved:
        return
    for i in moved:
        target = descs[i].mutated_input
        if type(target).__name__ != "BufferAOTInput":
            what = getattr(target, "target", None) or "a batch input"
            raise TraceError(f"cannot train {model_name}: its forward modifies {what} in place; autopar changes "
                             "parameters only through the optimizer and never writes to the batch. Compute on a "
                             "copy (x = x.clone()), or keep running state in a buffer (register_buffer)")
    order = [i for i in range(len(values)) if i not in set(moved)] + moved
    output.args = ([values[i] for i in order],) + tuple(output.args[1:])
    output.meta["desc"] = [descs[i] for i in order]
    gm.graph._codegen = fx.graph.CodeGen()  # flat outputs: the export's pytree spec no longer fits
    gm.graph.lint()
    gm.recompile()


def updated_buffers(gm: fx.GraphModule) -> tuple[str, ...]:
    """Names of the buffers a traced step's forward updates in place (its input-mutation
    outputs): BatchNorm's running statistics, counters."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return tuple(d.mutated_input.target.removeprefix("model.") for d in output.meta.get("desc", ())
                 if type(d).__name__ == "InputMutationAOTOutput")


def _tied_parameters(model: nn.Module) -> tuple[tuple[str, str], ...]:
    """Parameters registered under several names; the joint graph has one input per name."""
    first: dict[int, str] = {}
    tied = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied.append((name, first[id(param)]))
        else:
            first[id(param)] = name
    return tuple(tied)


def _sdpa_backends() -> list[Any]:
    from torch.nn.attention import SDPBackend

    # SDPA stays one op (flash on the CPU fake device); MATH is allowed as a fallback for
    # shapes flash refuses, in which case attention appears decomposed.
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def with_precision(graph: Graph, precision: Any) -> Graph:
    """`graph` recording the master and reduction dtypes of `precision` (an
    autopar.precision.Precision whose compute dtype is the graph's): what the cost model
    charges the weights, optimizer state and gradient syncs in."""
    from dataclasses import replace

    if graph.model.dtype != precision.compute:
        raise ValueError(f"the step was traced in {graph.model.dtype}, but the precision policy computes in "
                         f"{precision.compute}")
    return replace(graph, model=replace(graph.model, master_dtype=precision.master, reduce_dtype=precision.reduce))


def to_compute_dtype(model: nn.Module, microbatch: Sequence[Any], dtype: str) -> tuple[Any, ...]:
    """`autopar.precision.cast_parameters(model, dtype)`, and `microbatch` with its
    floating-point tensors cast to `dtype` (what the step computes in: FSDP2's
    `cast_forward_inputs`); integer tensors (tokens, labels, counters) are unchanged."""
    from autopar.batch import map_tensors
    from autopar.precision import cast_parameters

    cast_parameters(model, dtype)
    target = getattr(torch, dtype)
    return tuple(map_tensors(lambda t: t.to(target) if t.is_floating_point() else t, microbatch))


def trace_model(
    source: ModelSource,
    *,
    batch: int,
    dtype: str = "float32",
    layers_traced: int | None = None,
    recompute: str = "none",
    captured: dict[tuple[int, str, int], Traced] | None = None,
) -> Graph:
    """Trace a zoo model on fake tensors and lower it.

    `layers_traced` traces only that many layers and scales the layer group to the real
    depth (costs of a uniform model are per-layer sums, so this is exact for them).
    `recompute` rewrites the step for that policy, as the runtime traces it.
    `captured`: the caller's memo of the policy-free captures by (batch, dtype, depth);
    each policy is rewritten on a copy of the memoised capture
    (autopar/recompute.py `recompute_copy`).
    """
    if source.config is None:
        assert source.factory is not None
        model, inputs = source.factory()
        traced = trace(model, inputs, recompute=recompute)
        return lower(traced, name=source.name, batch=_batch_of(inputs), seq=_seq_of(inputs))
    if batch <= 0:
        raise ValueError(f"global batch must be a positive integer, got {batch}")
    cfg = source.config
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use float32 or bfloat16")
    depth = cfg.layers if layers_traced is None else max(1, min(layers_traced, cfg.layers))
    from autopar.precision import cast_parameters

    key = (batch, dtype, depth)
    if captured is None or key not in captured:
        with FakeTensorMode():
            # built as the ranks build it (float32), then its parameters cast to `dtype`, as the
            # runtime casts them (`cast_parameters`): the same traced step, node for node
            model = source.build(layers=depth)
            cast_parameters(model, dtype)
            tokens, labels = source.example_inputs(batch)
        if captured is None:
            traced = trace(model, (tokens, labels), recompute=recompute)
            return lower(traced, name=source.name, batch=batch, seq=cfg.seq, real_layers=cfg.layers, config=cfg)
        captured[key] = trace(model, (tokens, labels))
    from autopar.recompute import recompute_copy

    traced = recompute_copy(captured[key], recompute)
    return lower(traced, name=source.name, batch=batch, seq=cfg.seq, real_layers=cfg.layers, config=cfg)


def trace_step(model: nn.Module, microbatch: Sequence[Any], *, loss_fn: LossFn | None = None,
               recompute: str = "none", precision: Any = None) -> tuple[Any, Graph]:
    """Trace and lower the training step of `model` on one global microbatch, rewritten
    for the recomputation policy (autopar/recompute.py). With a `precision` policy
    (autopar.precision.Precision) the model and the microbatch's floating-point tensors are
    first cast to its compute dtype, in place (`to_compute_dtype`), and the graph records
    the policy."""
    from autopar.batch import batch_size, seq_len

    if precision is not None:
        microbatch = to_compute_dtype(model, microbatch, precision.compute)
    traced = trace(model, tuple(microbatch), loss_fn=loss_fn, recompute=recompute)
    batch, seq = batch_size(microbatch), seq_len(microbatch)
    graph = lower(traced, name=type(model).__name__, batch=batch, seq=seq, config=getattr(model, "cfg", None))
    if precision is not None:
        graph = with_precision(graph, precision)
    return traced, graph



def _batch_of(inputs: Sequence[Any]) -> int:
    from autopar.batch import batch_size

    return batch_size(inputs)


def _seq_of(inputs: Sequence[Any]) -> int:
    from autopar.batch import seq_len

    return seq_len(inputs)


# ---------------------------------------------------------------------------------------
# lowering


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
    return 0


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
    gm = traced.gm
    fx_nodes = [n for n in gm.graph.nodes if n.op != "output"]
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    ids = {n: i for i, n in enumerate(fx_nodes)}

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
    loss_fx: fx.Node | None = None
    param_of_grad: dict[fx.Node, str] = {}
    updated: list[tuple[str, fx.Node]] = []  # (buffer name, its new value)
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

    # module path per node: forward nodes carry it; unannotated backward nodes take it
    # from their users (which come later), then from their inputs.
    paths: dict[fx.Node, str] = {}
    for n in fx_nodes:
        custom = n.meta.get("custom") or {}
        path = custom.get("module", "")
        paths[n] = path.removeprefix("model.").removeprefix("model") if path else ""
    for n, pname in names.items():
        paths[n] = pname.rpartition(".")[0]
    for n, pname in param_of_grad.items():
        paths[n] = pname.rpartition(".")[0]

    layer_re = re.compile(rf"^{re.escape(traced.layer_prefix)}\.(\d+)(?:\.|$)") if traced.layer_prefix else None

    def layer_of(path: str) -> int | None:
        match = layer_re.match(path) if layer_re is not None else None
        return int(match.group(1)) if match else None

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

    nodes: list[Node] = []
    param_grads: list[tuple[NodeId, NodeId]] = []
    param_ids = {names[n]: ids[n] for n in fx_nodes if roles.get(n) is Role.PARAMETER}
    for n in fx_nodes:
        op = _op_name(n)
        outputs = _meta(n.meta.get("val"))
        input_ids = tuple(ids[a] for a in _flat_nodes(n.args) + _flat_nodes(tuple(n.kwargs.values())))
        in_meta = [nodes[i].outputs[0] if len(nodes[i].outputs) == 1 else None for i in input_ids]
        tensor_in = [m for m in in_meta if m is not None]
        phase = Phase.BACKWARD if n.meta.get("partitioner_tag") == "is_backward" else Phase.FORWARD
        if n.op == "placeholder":
            role = roles[n]
            phase = Phase.BACKWARD if role is Role.TANGENT else Phase.FORWARD
        elif n.op == "get_attr":
            role = Role.BUFFER
        elif n is loss_fx:
            role = Role.LOSS
        elif n in param_of_grad:
            role = Role.GRADIENT
        else:
            role = Role.ACTIVATION
        is_view = op in VIEW_OPS
        flops = _flops(op, tensor_in, outputs) if len(tensor_in) == len(input_ids) else 0
        moved = 0 if is_view else sum(m.size_bytes for m in {id(x): x for x in tensor_in}.values()) + sum(
            t.size_bytes for t in outputs)
        path = paths.get(n, "")
        layer = layer_of(path)
        nodes.append(Node(
            id=ids[n], name=n.name, op=op, inputs=input_ids,
            args=tuple(_convert_arg(a, ids) for a in n.args),
            kwargs=tuple(sorted((k, _convert_arg(v, ids)) for k, v in n.kwargs.items())),
            outputs=outputs, output_slots=_output_slots(n.meta.get("val")), role=role, phase=phase,
            flops=flops, bytes_moved=moved,
            is_view=is_view, module_path=path, layer=layer,
            param_name=names.get(n) or param_of_grad.get(n),
        ))
        if n in param_of_grad and param_of_grad[n] in param_ids:
            param_grads.append((param_ids[param_of_grad[n]], ids[n]))

    nodes = [replace(nd, segment=seg) for nd, seg in zip(nodes, _segments(nodes, traced.layer_prefix))]
    traced_layers = sorted({nd.layer for nd in nodes if nd.layer is not None})
    real = real_layers if real_layers is not None else traced.num_layers
    groups = _group_layers(nodes, traced_layers, real)
    tied = tuple((param_ids[alias], param_ids[canon]) for alias, canon in traced.tied
                 if alias in param_ids and canon in param_ids)  # empty once trace() merged them
    info = _model_info(name, nodes, groups, batch, seq, real, config, {a for a, _ in tied})
    buffer_ids = {names[n]: ids[n] for n in fx_nodes if roles.get(n) is Role.BUFFER and n in names}
    buffer_updates = tuple((buffer_ids[name], ids[value]) for name, value in updated if name in buffer_ids)
    graph = Graph(model=info, nodes=tuple(nodes), loss=ids[loss_fx], param_grads=tuple(param_grads),
                  layer_groups=groups, tied_params=tied, buffer_updates=buffer_updates,
                  trace_time_s=traced.trace_time_s)
    log.info("lowered %s: %d nodes, %d layer groups, %.3g FLOPs/step",
             name, len(nodes), len(groups), graph.flops_per_step)
    return graph


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
