"""Rule tables: how a known model family is cut into pipeline chunks and split for TP.

Where it sits: benchmarks/baselines/template/, read by stages.py (pipeline chunks) and
tp.py (tensor parallel) here, for the module-level template baseline
(benchmarks/baselines/template_program.py) and its source (emit.py here). Everything
family-specific lives here as data. Nothing on the execution path reads it (DESIGN: the
plan is the program; tests/unit/test_layering.py checks that no product module imports
benchmarks/).

Terms: a *chunk* is one pipeline stage's module (a contiguous run of layers, plus the
embedding on the first chunk and the head on the last); *tp* is the tensor-parallel
degree; *SP* is sequence parallelism (norm activations sharded over the sequence, dim 1).
A TP rule's `path` is relative to one repeated layer (`layers.<i>`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.gpt import GPT
from autopar.models.llama import Llama

# TP styles a rule can name (tp.py here maps them to torch.distributed.tensor.parallel):
#   colwise      weight rows sharded (output features); input replicated
#   rowwise      weight columns sharded (input features); output summed (all-reduce), or
#                reduce-scattered over the sequence with SP
#   norm         a norm: replicated without SP, sequence-sharded with SP
#   region       entry of a TP region (attention / MLP): with SP, all-gather the sequence
STYLES = ("colwise", "rowwise", "norm", "region")


@dataclass(frozen=True, slots=True, kw_only=True)
class TPRule:
    path: str
    style: str
    num_inputs: int = 1
    """Positional inputs of a `region` module; only the first (the activation) is sharded."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadCount:
    """A module attribute counting heads that becomes per-rank (divided by tp) under TP."""

    path: str
    attr: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Permutation:
    """A fused parameter whose rows must be regrouped so a contiguous TP shard is meaningful.

    GPT's qkv weight is [q; k; v] stacked over rows; a plain row split would give rank 0
    all of q. `to_tp(t, tp)` regroups to [q_0; k_0; v_0; q_1; ...] so rank r's shard is
    (q_r, k_r, v_r); `from_tp` undoes it (for comparisons and full state dicts).
    """

    path: str
    to_tp: Callable[[torch.Tensor, int], torch.Tensor]
    from_tp: Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True, slots=True, kw_only=True)
class FamilyRules:
    name: str
    embed: tuple[str, ...]
    """Top-level modules on the first chunk."""
    head: tuple[str, ...]
    """Top-level modules on the last chunk (norm, then output projection)."""
    tied: tuple[str, str] | None
    """(embedding weight, head weight) FQNs when the model may tie them."""
    layer_extra_buffers: tuple[str, ...]
    """Model buffers every layer needs (RoPE tables); every chunk keeps them."""
    tp_rules: tuple[TPRule, ...]
    head_counts: tuple[HeadCount, ...]
    permutations: tuple[Permutation, ...]
    tp_forwards: tuple[tuple[str, Callable[..., torch.Tensor]], ...]
    """(module path in a layer, forward) replacing a forward that assumes unsharded shapes."""
    embed_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    layer_args_fn: Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, ...]]
    head_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    heads_attr: str
    kv_heads_attr: str | None


def _qkv_to_tp(t: torch.Tensor, tp: int) -> torch.Tensor:
    q, k, v = t.chunk(3, dim=0)
    parts = [torch.cat([x.chunk(tp, dim=0)[r] for x in (q, k, v)], dim=0) for r in range(tp)]
    return torch.cat(parts, dim=0).contiguous()


def _qkv_from_tp(t: torch.Tensor, tp: int) -> torch.Tensor:
    per_rank = [r.chunk(3, dim=0) for r in t.chunk(tp, dim=0)]
    return torch.cat([torch.cat([p[i] for p in per_rank], dim=0) for i in range(3)], dim=0).contiguous()


def _gpt_attention_tp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # The zoo forward splits qkv by the full hidden size; under TP each rank holds
    # (q_r, k_r, v_r) of heads/tp heads (see Permutation), so split in three instead.
    b, s, _ = x.shape
    q, k, v = self.qkv(x).chunk(3, dim=2)
    q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(y.transpose(1, 2).reshape(b, s, -1))


def _gpt_embed(m: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return m.wte(tokens) + m.wpe(m.pos[: tokens.shape[1]])


def _llama_embed(m: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return m.tok_embeddings(tokens)


def _gpt_layer_args(m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return ()


def _llama_layer_args(m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    s = x.shape[1]
    dtype = x.dtype if x.is_floating_point() else torch.float32
    return m.rope_cos[:s].to(dtype), m.rope_sin[:s].to(dtype)


def _gpt_head(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m.lm_head(m.ln_f(x))


def _llama_head(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m.output(m.norm(x))


def _gpt_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _llama_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


GPT_RULES = FamilyRules(
    name="gpt",
    embed=("wte", "wpe"),
    head=("ln_f", "lm_head"),
    tied=("wte.weight", "lm_head.weight"),
    layer_extra_buffers=("pos",),
    tp_rules=(
        TPRule(path="ln_1", style="norm"),
        TPRule(path="attn", style="region"),
        TPRule(path="attn.qkv", style="colwise"),
        TPRule(path="attn.proj", style="rowwise"),
        TPRule(path="ln_2", style="norm"),
        TPRule(path="mlp", style="region"),
        TPRule(path="mlp.fc", style="colwise"),
        TPRule(path="mlp.proj", style="rowwise"),
    ),
    head_counts=(HeadCount(path="attn", attr="heads"),),
    permutations=(
        Permutation(path="attn.qkv.weight", to_tp=_qkv_to_tp, from_tp=_qkv_from_tp),
        Permutation(path="attn.qkv.bias", to_tp=_qkv_to_tp, from_tp=_qkv_from_tp),
    ),
    tp_forwards=(("attn", _gpt_attention_tp_forward),),
    embed_fn=_gpt_embed,
    layer_args_fn=_gpt_layer_args,
    head_fn=_gpt_head,
    loss_fn=_gpt_loss,
    heads_attr="heads",
    kv_heads_attr=None,
)

LLAMA_RULES = FamilyRules(
    name="llama",
    embed=("tok_embeddings",),
    head=("norm", "output"),
    tied=("tok_embeddings.weight", "output.weight"),
    layer_extra_buffers=("rope_cos", "rope_sin"),
    tp_rules=(
        TPRule(path="attention_norm", style="norm"),
        TPRule(path="attention", style="region", num_inputs=3),
        TPRule(path="attention.wq", style="colwise"),
        TPRule(path="attention.wk", style="colwise"),
        TPRule(path="attention.wv", style="colwise"),
        TPRule(path="attention.wo", style="rowwise"),
        TPRule(path="ffn_norm", style="norm"),
        TPRule(path="feed_forward", style="region"),
        TPRule(path="feed_forward.w1", style="colwise"),
        TPRule(path="feed_forward.w3", style="colwise"),
        TPRule(path="feed_forward.w2", style="rowwise"),
    ),
    head_counts=(HeadCount(path="attention", attr="heads"), HeadCount(path="attention", attr="kv_heads")),
    permutations=(),
    tp_forwards=(),
    embed_fn=_llama_embed,
    layer_args_fn=_llama_layer_args,
    head_fn=_llama_head,
    loss_fn=_llama_loss,
    heads_attr="heads",
    kv_heads_attr="kv_heads",
)

_FAMILIES: tuple[tuple[type, FamilyRules], ...] = ((GPT, GPT_RULES), (Llama, LLAMA_RULES))


def rules_for(model: nn.Module) -> FamilyRules | None:
    """The family rules of a zoo model, or None for a model of unknown structure."""
    for cls, rules in _FAMILIES:
        if isinstance(model, cls):
            return rules
    return None


def permutation_for(fqn: str, rules: FamilyRules | None) -> Permutation | None:
    """The permutation applying to a full parameter name such as `layers.3.attn.qkv.weight`."""
    if rules is None:
        return None
    parts = fqn.split(".")
    if len(parts) < 3 or parts[0] != "layers":
        return None
    local = ".".join(parts[2:])
    return next((p for p in rules.permutations if p.path == local), None)
