"""Capture: one training step (forward + backward) of a model as a joint FX graph.

Where it sits: the first half of the trace stage (trace -> Graph -> strategies -> costs ->
solve -> Plan -> apply -> run). `trace(model, example_inputs)` returns a `Traced`: the
joint forward+backward `torch.fx.GraphModule` of model + loss, captured with
`aot_export_joint_with_descriptors` under the caller's fake mode on the CPU fake device
(never the meta device: the backward silently vanishes there), then cleaned up in place
so that lowering (autopar/trace/lowering.py) reads one input per parameter and the loss
first. The optional recomputation rewrite (autopar/recompute.py) runs here too, before
lowering.

Terms: a *layer* is a child of the model's largest `nn.ModuleList` (`layers.<i>`); module
paths are recorded per node with `torch.fx.traceback.annotate` from module hooks, and
backward nodes inherit them through autograd's sequence numbers. A *tied* parameter is one
tensor registered under several names (tied embeddings).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx.traceback as fx_traceback
from torch import fx, nn
from torch.nn.attention import SDPBackend

from autopar import grouped_mm
from autopar.batch import split
from autopar.capabilities import layer_container as _find_layer_container
from autopar.recompute import apply_recompute

log = logging.getLogger(__name__)

LossFn = Callable[..., torch.Tensor]


class TraceError(ValueError):
    """The model cannot be traced into a training graph; the message says where and why."""


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
def hf_capture_patch(model: nn.Module) -> Iterator[None]:
    """Hugging Face models as autopar captures them (the whole step, or a pipeline's cut):
    - their mask helpers branch on data unless they believe they are compiling, so they
      are told they are;
    - their experts run through autopar/grouped_mm.py's `experts_forward` (each row's
      expert beside it: the batch splits through the routing), restored after."""
    if not any(type(m).__module__.startswith("transformers") for m in model.modules()):
        yield
        return
    original = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True  # type: ignore[assignment]
    try:
        with grouped_mm.experts_for_trace(model):
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
    and inputs under a `FakeTensorMode` first (see `autopar.trace.trace_model`). Raises
    TraceError naming the module and op when the model cannot be captured.
    """
    if not isinstance(model, nn.Module):
        raise TraceError(f"trace needs an nn.Module, got {type(model).__name__}")
    if not any(True for _ in model.parameters()):
        raise TraceError(f"{type(model).__name__} has no parameters: there is nothing to train or shard")

    example_inputs, keywords = split(example_inputs)
    example_kwargs = {**keywords, **(example_kwargs or {})}
    step = _LossStep(model, loss_fn, aux_outputs)
    found_prefix, num_layers = _find_layer_container(model)
    layer_prefix = found_prefix if layer_prefix is None else layer_prefix
    active: list[str] = []
    start = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack, fx_traceback.preserve_node_meta(), \
                _module_annotations(model, active), hf_capture_patch(model), \
                torch.nn.attention.sdpa_kernel(sdpa_backends()):
            from torch._functorch.aot_autograd import aot_export_joint_with_descriptors  # lazy: aot_autograd brings dynamo and inductor, only to trace

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


def sdpa_backends() -> list[Any]:
    """The attention kernels a capture allows (`torch.nn.attention.sdpa_kernel`); a
    pipeline cut (autopar/build/chunks.py) captures under the same ones."""
    # SDPA stays one op (flash on the CPU fake device); MATH is allowed as a fallback for
    # shapes flash refuses, in which case attention appears decomposed.
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]

