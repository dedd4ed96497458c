"""Strategy enumeration: which placements each op of the joint graph can run in.

Where it sits: `enumerate_strategies(graph, mesh_shape) -> StrategySpace`, read by
solver/costs.py and the intra-op ILP. Torch-free.

How: every rule is written for ONE mesh axis (like DTensor's single-dim strategies): a
list of `AxisOption`s, each giving the placement of every output and every tensor input
on that axis (`Shard(dim)`, `Replicate()`, `Partial()`). An N-D mesh takes the product
of the per-axis options; a combination is kept only if every sharded dim divides evenly
by the product of the axis sizes sharding it (infeasible strategies are absent, never
priced high). The same tensor dim may be sharded by several axes (e.g. the batch over
both axes of a 2-D data-parallel mesh).

Project rules cover the ops the zoo models trace to (matmuls, embedding, elementwise
with broadcasting, reductions, norms, softmax, SDPA, views, cross-entropy and their
backward ops, getitem). Attention (one fused SDPA op) shards batch or heads. An op with
no rule is replicated, with a warning naming it.

Terms: "axis" is a mesh axis, "dim" a tensor dimension.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from typing import Callable

from autopar.ir import Graph, Node, Ref
from autopar.placement import Partial, Placement, Placements, Replicate, Shard, evenly_divisible
from autopar.sharding import NodeStrategy, StrategySpace

log = logging.getLogger(__name__)

R = Replicate()
P = Partial()
Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AxisOption:
    """Placements on one mesh axis: one per output, one per tensor input (Node.inputs order)."""

    outs: tuple[Placement, ...]
    ins: tuple[Placement, ...]


Rule = Callable[[Node, list[Shape], list[Shape]], list[AxisOption]]


def _replicated(node: Node, ins: list[Shape], outs: list[Shape]) -> AxisOption:
    return AxisOption(tuple(R for _ in outs), tuple(R for _ in ins))


def _norm_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _arg_slots(node: Node) -> list[int]:
    """For each entry of node.inputs, the index of the positional argument it came from."""
    slots = []
    for i, a in enumerate(node.args):
        if isinstance(a, Ref):
            slots.append(i)
        elif isinstance(a, tuple):
            slots.extend(i for x in a if isinstance(x, Ref))
    for _k, v in node.kwargs:  # kwargs tensors come last in Node.inputs
        if isinstance(v, Ref):
            slots.append(-1)
    return slots


# ---------------------------------------------------------------------------------------
# sources, views


def _source(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    (shape,) = outs
    return [AxisOption((R,), ())] + [AxisOption((Shard(d),), ()) for d in range(len(shape)) if shape[d] > 1]


def _view_dim_map(src: Shape, dst: Shape) -> dict[int, int]:
    """Input dim -> output dim for a reshape: a dim maps when both start at the same flat
    offset (equal prefix products); a contiguous chunk of one is then a contiguous chunk
    of the other, so Shard(i) becomes Shard(j) with no data movement."""
    out_prefix: dict[int, int] = {}
    for j in range(len(dst)):
        if dst[j] > 1:
            out_prefix.setdefault(math.prod(dst[:j]), j)
    mapping = {}
    for i in range(len(src)):
        if src[i] > 1 and math.prod(src[:i]) in out_prefix:
            mapping[i] = out_prefix[math.prod(src[:i])]
    return mapping


def _mapped(dim_map: dict[int, int], linear: bool, n_outs: int = 1) -> list[AxisOption]:
    opts = [AxisOption((R,) * n_outs, (R,))]
    opts += [AxisOption((Shard(j),) * n_outs, (Shard(i),)) for i, j in sorted(dim_map.items())]
    if linear:
        opts.append(AxisOption((P,) * n_outs, (P,)))
    return opts


def _view(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    return _mapped(_view_dim_map(ins[0], outs[0]), linear=True)


def _permute_like(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    rank = len(ins[0])
    if node.op == "aten.t.default":
        perm = list(range(rank))[::-1]
    elif node.op == "aten.transpose.int":
        a, b = _norm_dim(node.args[1], rank), _norm_dim(node.args[2], rank)
        perm = list(range(rank))
        perm[a], perm[b] = perm[b], perm[a]
    else:
        perm = [_norm_dim(d, rank) for d in node.args[1]]
    return _mapped({src: out for out, src in enumerate(perm)}, linear=True)


def _expand(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    src, dst = ins[0], outs[0]
    off = len(dst) - len(src)
    return _mapped({i: i + off for i in range(len(src)) if src[i] == dst[i + off]}, linear=True)


def _unsqueeze(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    d = _norm_dim(node.args[1], len(outs[0]))
    return _mapped({i: (i if i < d else i + 1) for i in range(len(ins[0]))}, linear=True)


def _squeeze(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    src = ins[0]
    if node.op == "aten.squeeze.default":
        gone = {i for i, s in enumerate(src) if s == 1}
    else:
        dims = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        gone = {_norm_dim(d, len(src)) for d in dims if src[_norm_dim(d, len(src))] == 1}
    kept = [i for i in range(len(src)) if i not in gone]
    return _mapped({i: k for k, i in enumerate(kept)}, linear=True)


def _slice(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    src, dst = ins[0], outs[0]
    return _mapped({i: i for i in range(len(src)) if src[i] == dst[i]}, linear=True)


def _split(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    rank = len(ins[0])
    dim = _norm_dim(node.args[2] if len(node.args) > 2 else 0, rank)
    return _mapped({i: i for i in range(rank) if i != dim}, linear=True, n_outs=len(outs))


def _cat(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    rank = len(outs[0])
    dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, rank)
    n = len(ins)
    opts = [AxisOption((R,), (R,) * n), AxisOption((P,), (P,) * n)]
    opts += [AxisOption((Shard(d),), (Shard(d),) * n) for d in range(rank) if d != dim]
    return opts


# ---------------------------------------------------------------------------------------
# elementwise and reductions

_LINEAR_UNARY = frozenset({"aten.mul.Scalar", "aten.div.Scalar", "aten.neg.default", "aten.clone.default",
                           "aten.detach.default", "aten.alias.default", "aten._to_copy.default"})
_ADDITIVE = frozenset({"aten.add.Tensor", "aten.sub.Tensor"})
_LINEAR_IN_FIRST = frozenset({"aten.div.Tensor", "aten.gelu_backward.default", "aten.silu_backward.default",
                              "aten.threshold_backward.default", "aten.tanh_backward.default",
                              "aten.sigmoid_backward.default"})


def _elementwise(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    out = outs[0]
    n = len(ins)
    opts = [AxisOption((R,), (R,) * n)]
    for d in range(len(out)):
        if out[d] <= 1:
            continue
        placements = []
        for shape in ins:
            k = d - (len(out) - len(shape))
            placements.append(Shard(k) if k >= 0 and shape[k] == out[d] else R)
        opts.append(AxisOption((Shard(d),), tuple(placements)))
    adds_constant = node.op in _ADDITIVE and not all(isinstance(a, Ref) for a in node.args[:2])
    if node.op in _LINEAR_UNARY or (node.op in _ADDITIVE and not adds_constant):
        # a sum of partial sums (or a scaled one) is still a partial sum
        opts.append(AxisOption((P,), (P,) * n))
    elif node.op == "aten.mul.Tensor" or node.op in _LINEAR_IN_FIRST:
        for k in range(n if node.op == "aten.mul.Tensor" else 1):
            opts.append(AxisOption((P,), tuple(P if i == k else R for i in range(n))))
    return opts


def _reduction(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    src, out = ins[0], outs[0]
    rank = len(src)
    dims_arg = node.args[1] if len(node.args) > 1 and node.op != "aten.sum.default" else None
    if dims_arg is None or dims_arg == ():
        reduced = set(range(rank))
    else:
        dims = dims_arg if isinstance(dims_arg, tuple) else (dims_arg,)
        reduced = {_norm_dim(d, rank) for d in dims}
    keepdim = len(out) == rank
    opts = [AxisOption((R,), (R,)), AxisOption((P,), (P,))]
    k = 0
    for i in range(rank):
        if i in reduced:
            opts.append(AxisOption((P,), (Shard(i),)))
            if keepdim:
                k += 1
            continue
        opts.append(AxisOption((Shard(k),), (Shard(i),)))
        k += 1
    return opts


def _softmax(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    rank = len(outs[0])
    dim_arg = node.args[1] if node.op in ("aten._softmax.default", "aten._log_softmax.default") else node.args[2]
    dim = _norm_dim(dim_arg, rank)
    n = len(ins)
    return [AxisOption((R,), (R,) * n)] + [
        AxisOption((Shard(d),), (Shard(d),) * n) for d in range(rank) if d != dim]


# ---------------------------------------------------------------------------------------
# matmuls, embedding, norms, attention, loss


def _mm(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    # C[m,n] = A[m,k] @ B[k,n]
    return [AxisOption((R,), (R, R)), AxisOption((Shard(0),), (Shard(0), R)),
            AxisOption((Shard(1),), (R, Shard(1))), AxisOption((P,), (Shard(1), Shard(0)))]


def _addmm(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    bias_s1 = Shard(0) if len(ins[0]) == 1 else Shard(1)
    bias_s0 = R if len(ins[0]) == 1 else Shard(0)
    # row parallel: the bias arrives Partial (Replicate -> Partial is local: one device
    # keeps it, the others add zero), so the pending sum includes it exactly once
    return [AxisOption((R,), (R, R, R)), AxisOption((Shard(0),), (bias_s0, Shard(0), R)),
            AxisOption((Shard(1),), (bias_s1, R, Shard(1))), AxisOption((P,), (P, Shard(1), Shard(0)))]


def _bmm(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    return [AxisOption((R,), (R, R)), AxisOption((Shard(0),), (Shard(0), Shard(0))),
            AxisOption((Shard(1),), (Shard(1), R)), AxisOption((Shard(2),), (R, Shard(2))),
            AxisOption((P,), (Shard(2), Shard(1)))]


def _embedding(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    # out[..., H] = weight[V, H][idx[...]]
    idx_rank = len(ins[1])
    opts = [AxisOption((R,), (R, R)), AxisOption((Shard(idx_rank),), (Shard(1), R)),
            AxisOption((P,), (Shard(0), R))]  # vocab-parallel: rows outside the shard give 0
    opts += [AxisOption((Shard(d),), (R, Shard(d))) for d in range(idx_rank)]
    return opts


def _embedding_backward(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    # grad_w[V, H] = scatter-add of grad_out[..., H] by idx[...]
    idx_rank = len(ins[1])
    opts = [AxisOption((R,), (R, R)), AxisOption((Shard(1),), (Shard(idx_rank), R)),
            AxisOption((Shard(0),), (R, R)), AxisOption((P,), (P, R))]
    opts += [AxisOption((P,), (Shard(d), Shard(d))) for d in range(idx_rank)]
    return opts


def _layer_norm(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    rank = len(ins[0])
    batch_dims = rank - len(node.args[1])
    opts = [_replicated(node, ins, outs)]
    for d in range(batch_dims):
        opts.append(AxisOption((Shard(d),) * len(outs), (Shard(d),) + (R,) * (len(ins) - 1)))
    return opts


def _layer_norm_backward(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    # args: grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask
    rank = len(ins[0])
    batch_dims = rank - len(node.args[2])
    slots = _arg_slots(node)
    opts = [_replicated(node, ins, outs)]
    for d in range(batch_dims):
        in_pl = tuple(Shard(d) if s in (0, 1, 3, 4) else R for s in slots)
        # weight/bias grads sum over the batch; absent outputs (output_mask False) are skipped
        out_pl = tuple(pl for pl, on in zip((Shard(d), P, P), _output_mask(node)) if on)
        opts.append(AxisOption(out_pl, in_pl))
    return opts


def _output_mask(node: Node) -> tuple[bool, ...]:
    mask = node.args[7] if len(node.args) > 7 and isinstance(node.args[7], tuple) else (True, True, True)
    return tuple(bool(m) for m in mask)


def output_index(producer: Node, idx: int) -> int:
    """Position in `producer.outputs` of tuple element `idx` (outputs skip None results)."""
    if producer.op == "aten.native_layer_norm_backward.default":
        return sum(_output_mask(producer)[:idx])
    return idx


def _attention(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    # project rule: fused SDPA shards the batch (dim 0) or the heads (dim 1) of every tensor
    opts = [_replicated(node, ins, outs)]
    for d in (0, 1):
        in_pl = tuple(Shard(d) if len(s) > d else R for s in ins)
        out_pl = tuple(Shard(d) if len(s) > d else R for s in outs)
        opts.append(AxisOption(out_pl, in_pl))
    return opts


def _nll_loss_forward(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    # args: self[N, C], target[N], weight, reduction, ignore_index -> (loss, total_weight)
    slots = _arg_slots(node)
    opts = [_replicated(node, ins, outs)]
    if len(ins[0]) == 2:
        opts.append(AxisOption((P,) * len(outs), tuple(Shard(0) if s in (0, 1) else R for s in slots)))
    return opts


def _nll_loss_backward(node: Node, ins: list[Shape], outs: list[Shape]) -> list[AxisOption]:
    # args: grad_output, self[N, C], target[N], weight, reduction, ignore_index, total_weight
    slots = _arg_slots(node)
    opts = [_replicated(node, ins, outs)]
    if len(ins[slots.index(1)]) == 2:
        opts.append(AxisOption((Shard(0),), tuple(Shard(0) if s in (1, 2) else R for s in slots)))
        opts.append(AxisOption((Shard(1),), tuple(Shard(1) if s == 1 else R for s in slots)))
    return opts


_VIEWS: dict[str, Rule] = {
    "aten.view.default": _view, "aten._unsafe_view.default": _view, "aten.reshape.default": _view,
    "aten.t.default": _permute_like, "aten.transpose.int": _permute_like, "aten.permute.default": _permute_like,
    "aten.expand.default": _expand, "aten.unsqueeze.default": _unsqueeze, "aten.squeeze.dim": _squeeze,
    "aten.squeeze.dims": _squeeze, "aten.squeeze.default": _squeeze, "aten.slice.Tensor": _slice,
    "aten.split.Tensor": _split, "aten.split_with_sizes.default": _split,
}
_ELEMENTWISE = (
    "add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "mul.Scalar", "div.Scalar", "add.Scalar",
    "sub.Scalar", "neg.default", "clone.default", "detach.default", "alias.default", "_to_copy.default",
    "pow.Tensor_Scalar", "rsqrt.default", "sqrt.default", "exp.default", "log.default", "tanh.default",
    "sigmoid.default", "relu.default", "gelu.default", "silu.default", "cos.default", "sin.default",
    "where.self", "gelu_backward.default", "silu_backward.default", "threshold_backward.default",
    "tanh_backward.default", "sigmoid_backward.default", "fill.Scalar", "zeros_like.default",
    "ones_like.default", "masked_fill.Scalar", "reciprocal.default",
)
ELEMENTWISE_OPS = frozenset(f"aten.{op}" for op in _ELEMENTWISE)
RULES: dict[str, Rule] = {
    **_VIEWS,
    **{f"aten.{op}": _elementwise for op in _ELEMENTWISE},
    "placeholder": _source,
    "aten.cat.default": _cat,
    "aten.sum.dim_IntList": _reduction, "aten.sum.default": _reduction, "aten.mean.dim": _reduction,
    "aten.mean.default": _reduction,
    "aten._softmax.default": _softmax, "aten._log_softmax.default": _softmax,
    "aten._softmax_backward_data.default": _softmax, "aten._log_softmax_backward_data.default": _softmax,
    "aten.mm.default": _mm, "aten.addmm.default": _addmm, "aten.bmm.default": _bmm,
    "aten.embedding.default": _embedding, "aten.embedding_dense_backward.default": _embedding_backward,
    "aten.native_layer_norm.default": _layer_norm,
    "aten.native_layer_norm_backward.default": _layer_norm_backward,
    "aten._scaled_dot_product_flash_attention_for_cpu.default": _attention,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": _attention,
    "aten._scaled_dot_product_flash_attention.default": _attention,
    "aten._scaled_dot_product_flash_attention_backward.default": _attention,
    "aten.nll_loss_forward.default": _nll_loss_forward,
    "aten.nll_loss_backward.default": _nll_loss_backward,
}


# ---------------------------------------------------------------------------------------
# N-D expansion


def _expand_to_mesh(options: list[AxisOption], ins: list[Shape], outs: list[Shape],
                    mesh_shape: tuple[int, ...]) -> tuple[NodeStrategy, ...]:
    """Product of per-axis options, keeping combinations that divide evenly.

    A size-1 axis only takes the replicated option (sharding over one device is the same
    layout and would only duplicate variables)."""
    per_axis = [options if size > 1 else options[:1] for size in mesh_shape]
    seen: dict[NodeStrategy, None] = {}
    for combo in itertools.product(*per_axis):
        out_pl = tuple(tuple(c.outs[t] for c in combo) for t in range(len(outs)))
        in_pl = tuple(tuple(c.ins[p] for c in combo) for p in range(len(ins)))
        if all(evenly_divisible(s, pl, mesh_shape) for s, pl in zip(outs, out_pl)) and all(
                evenly_divisible(s, pl, mesh_shape) for s, pl in zip(ins, in_pl)):
            seen.setdefault(NodeStrategy(outputs=out_pl, inputs=in_pl), None)
    return tuple(seen)


def _getitem_strategies(node: Node, producer_node: Node, producer: tuple[NodeStrategy, ...]) -> tuple[NodeStrategy, ...]:
    idx = output_index(producer_node, node.args[1])
    seen: dict[NodeStrategy, None] = {}
    for s in producer:
        pl: Placements = s.outputs[idx]
        seen.setdefault(NodeStrategy(outputs=(pl,), inputs=(pl,)), None)
    return tuple(seen)


def enumerate_strategies(graph: Graph, mesh_shape: tuple[int, ...]) -> StrategySpace:
    """Feasible strategies of every node on a `mesh_shape` logical mesh (1-3 axes)."""
    if not mesh_shape or any(s <= 0 for s in mesh_shape):
        raise ValueError(f"mesh shape must be positive axis sizes such as (8,) or (8, 8), got {mesh_shape}")
    strategies: list[tuple[NodeStrategy, ...]] = []
    fallback: set[str] = set()
    cache: dict[tuple, tuple[NodeStrategy, ...]] = {}
    for node in graph.nodes:
        if node.op == "getitem":
            strategies.append(_getitem_strategies(node, graph[node.inputs[0]], strategies[node.inputs[0]]))
            continue
        ins = [graph[i].outputs[0].shape if graph[i].outputs else () for i in node.inputs]
        outs = [t.shape for t in node.outputs]
        key = (node.op, tuple(ins), tuple(outs), _scalar_args(node))
        if key not in cache:
            rule = RULES.get(node.op)
            if rule is None:
                fallback.add(node.op)
                options = [_replicated(node, ins, outs)]
            else:
                options = rule(node, ins, outs)
                assert all(len(o.ins) == len(ins) and len(o.outs) == len(outs) for o in options), node.op
            cache[key] = _expand_to_mesh(options, ins, outs, mesh_shape)
        strategies.append(cache[key])
    for op in sorted(fallback):
        log.warning("no sharding rule for %s: replicated on every device", op)
    return StrategySpace(mesh_shape=tuple(mesh_shape), strategies=tuple(strategies),
                         fallback_ops=tuple(sorted(fallback)))


def _scalar_args(node: Node) -> tuple:
    """Non-tensor arguments, with tensor references replaced by their argument slot."""
    def strip(a: object) -> object:
        if isinstance(a, Ref):
            return "T"
        if isinstance(a, tuple):
            return tuple(strip(x) for x in a)
        return a
    return strip(node.args), strip(node.kwargs)
