"""FX pass: replace memory-bound ATen patterns in a per-rank forward graph with fused ops.

Where it sits: codegen, on each rank's ATen forward graph (make_fx / aot forward output),
before the graph runs or goes to torch.compile. `fuse_graph(gm, target=...)` returns a new
GraphModule; the input is never modified. Fusion is on for `target="cuda"` (Triton kernels
beat eager there) and off on CPU, where torch.compile/inductor C++ already fuses these
chains and Triton only runs in its slow interpreter; `force=True` turns it on anywhere
(tests; the fused ops then run their reference path on CPU).

Patterns (ATen, as traced from autopar's zoo models):
- rms_norm:  mul(mul(x, rsqrt(add(mean(pow(x, 2), [-1], keepdim), eps))), w)
- layer_norm: getitem(native_layer_norm(x, [n], w, b, eps), 0) with mean/rstd unused
- swiglu:    mul(silu(a), b)
- bias_gelu: gelu(view(addmm(bias, x, w)), approximate="tanh") -> bias_gelu(view(mm(x, w)), bias)
- cross_entropy: getitem(nll_loss_forward(_log_softmax(view*(mm(h, t(W))), 1), y, mean), 0)
  -> vocab_parallel_ce(h, W, y) (chunked over tokens, never materialising the logits)

A match is replaced only if the pattern's intermediate values have no users outside it.
In a joint forward+backward graph the backward reads those intermediates, so nothing is
replaced there: fuse the forward graph and let the fused ops' autograd produce the
backward, or swap modules (`modules.swap_fused_modules`) for a runtime that runs
nn.Modules.
"""

from __future__ import annotations

import copy
import logging
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx

# importing cross_entropy (which imports ops) registers every autopar:: op used below
from codegen.kernels.cross_entropy import DEFAULT_CHUNK_TOKENS

log = logging.getLogger(__name__)

aten = torch.ops.aten
FUSED_TARGETS = ("cuda",)
"""Device types on which fusion is on by default (Triton compiles there)."""

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


@dataclass(frozen=True, slots=True, kw_only=True)
class FusedGraph:
    gm: fx.GraphModule
    counts: tuple[tuple[str, int], ...]
    """(pattern, number replaced), sorted by pattern; empty when fusion was off."""


def should_fuse(target: str, *, force: bool = False) -> bool:
    """Whether `fuse_graph` rewrites for this device type ("cuda", "cpu", ...)."""
    return force or target in FUSED_TARGETS


def _is(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _only_used_by(node: fx.Node, *users: fx.Node) -> bool:
    return all(u in users for u in node.users)


def _last_dim(node: fx.Node, dims: Any) -> bool:
    val = node.meta.get("val")
    ndim = val.dim() if isinstance(val, torch.Tensor) else None
    return list(dims) == [-1] or (ndim is not None and list(dims) == [ndim - 1])


def _match_rms_norm(out: fx.Node) -> list[Any] | None:
    if not _is(out, aten.mul.Tensor):
        return None
    for normed, w in (out.args, out.args[::-1]):
        if not _is(normed, aten.mul.Tensor) or not isinstance(w, fx.Node):
            continue
        for x, r in (normed.args, normed.args[::-1]):
            if not _is(r, aten.rsqrt.default) or not _is(r.args[0], aten.add.Tensor):
                continue
            add = r.args[0]
            mean, eps = add.args
            if not _is(mean, aten.mean.dim) or not isinstance(eps, float):
                continue
            if len(mean.args) < 3 or not mean.args[2] or not _last_dim(x, mean.args[1]):
                continue
            sq = mean.args[0]
            if not _is(sq, aten.pow.Tensor_Scalar) or sq.args != (x, 2):
                continue
            chain = [(normed, out), (r, normed), (add, r), (mean, add), (sq, mean)]
            if all(_only_used_by(n, user) for n, user in chain):
                return [x, w, eps]
    return None


def _match_layer_norm(out: fx.Node) -> list[Any] | None:
    if not (out.op == "call_function" and out.target is operator.getitem and out.args[1] == 0):
        return None
    ln = out.args[0]
    if not _is(ln, aten.native_layer_norm.default) or not _only_used_by(ln, out):
        return None
    x, shape, w, b, eps = ln.args
    if len(shape) != 1 or w is None:
        return None
    return [x, w, b, eps]


def _match_swiglu(out: fx.Node) -> list[Any] | None:
    if not _is(out, aten.mul.Tensor):
        return None
    for act, up in (out.args, out.args[::-1]):
        if _is(act, aten.silu.default) and _only_used_by(act, out) and isinstance(up, fx.Node):
            gate = act.args[0]
            if _same_shape(gate, up):
                return [gate, up]
    return None


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape


def _match_bias_gelu(out: fx.Node) -> list[Any] | None:
    """On a match, also inserts the bias-free mm (and view) whose output the fused op takes."""
    if not _is(out, aten.gelu.default) or out.kwargs.get("approximate") != "tanh":
        return None
    view = out.args[0]
    addmm = view.args[0] if _is(view, *_VIEWS) else view
    if not _is(addmm, aten.addmm.default) or addmm.kwargs or not _only_used_by(addmm, out, view):
        return None
    if view is not addmm and not _only_used_by(view, out):
        return None
    bias, x, w = addmm.args
    bias_val = bias.meta.get("val") if isinstance(bias, fx.Node) else None
    if not isinstance(bias_val, torch.Tensor) or bias_val.dim() != 1:
        return None
    graph = out.graph
    with graph.inserting_before(out):
        mm = graph.call_function(aten.mm.default, (x, w))
        pre = mm if view is addmm else graph.call_function(view.target, (mm, *view.args[1:]))
    return [pre, bias]


def _match_cross_entropy(out: fx.Node, chunk_tokens: int) -> list[Any] | None:
    if not (out.op == "call_function" and out.target is operator.getitem and out.args[1] == 0):
        return None
    nll = out.args[0]
    if not _is(nll, aten.nll_loss_forward.default) or not _only_used_by(nll, out):
        return None
    logp, target, weight, reduction, ignore_index = nll.args
    mean_reduction = 1
    if weight is not None or reduction != mean_reduction or not _is(logp, aten._log_softmax.default):
        return None
    if logp.args[1] not in (1, -1) or not _only_used_by(logp, nll):
        return None
    chain, node = [logp], logp.args[0]
    while _is(node, *_VIEWS) or (_is(node, aten._to_copy.default) and node.kwargs.get("dtype") == torch.float32):
        chain.append(node)
        node = node.args[0]
    if not _is(node, aten.mm.default) or not _is(node.args[1], aten.t.default):
        return None
    chain.append(node)
    hidden, weight_t = node.args
    if not all(_only_used_by(child, parent) for child, parent in zip(chain[1:], chain)):
        return None
    if not _only_used_by(weight_t, node) or out.meta.get("val", torch.empty(())).dtype != torch.float32:
        return None
    return [hidden, weight_t.args[0], target, 0, chunk_tokens, ignore_index, ""]


def _fake_val(target: Any, args: list[Any]) -> Any:
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in args]
    fake_mode = torch._guards.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if fake_mode is None or any(isinstance(a, fx.Node) and v is None for a, v in zip(args, vals)):
        return None
    with fake_mode:
        return target(*vals)


def fuse_graph(gm: fx.GraphModule, *, target: str, force: bool = False,
               chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> FusedGraph:
    """A copy of `gm` with the patterns above replaced by autopar:: fused ops.

    target: the device type the graph will run on ("cuda", "cpu"); force: fuse even where
    fusion is off by default. Returns the copy and how many of each pattern were replaced.
    """
    new_gm = copy.deepcopy(gm)
    if not should_fuse(target, force=force):
        return FusedGraph(gm=new_gm, counts=())
    graph = new_gm.graph
    graph.eliminate_dead_code()  # make_fx leaves dead detach() users that would block matches
    patterns: list[tuple[str, Callable[[fx.Node], Any], Any]] = [
        ("rms_norm", _match_rms_norm, torch.ops.autopar.rms_norm.default),
        ("layer_norm", _match_layer_norm, torch.ops.autopar.layer_norm.default),
        ("swiglu", _match_swiglu, torch.ops.autopar.swiglu.default),
        ("bias_gelu", _match_bias_gelu, torch.ops.autopar.bias_gelu.default),
        ("cross_entropy", lambda n: _match_cross_entropy(n, chunk_tokens),
         torch.ops.autopar.vocab_parallel_ce.default),
    ]
    counts: Counter[str] = Counter()
    for node in list(graph.nodes):
        for name, match, op in patterns:
            args = match(node)
            if args is None:
                continue
            with graph.inserting_before(node):
                fused = graph.call_function(op, tuple(args))
                fused.meta["val"] = _fake_val(op, args)
                single_output = op is torch.ops.autopar.swiglu.default or op is torch.ops.autopar.bias_gelu.default
                result = fused if single_output else graph.call_function(operator.getitem, (fused, 0))
                if "val" in node.meta:
                    result.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(result)
            counts[name] += 1
            break
    graph.eliminate_dead_code()
    graph.lint()
    new_gm.recompile()
    log.info("fused %s", dict(sorted(counts.items())) or "nothing")
    return FusedGraph(gm=new_gm, counts=tuple(sorted(counts.items())))
