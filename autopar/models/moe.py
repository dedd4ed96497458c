"""Mixture-of-experts decoder in plain PyTorch: Llama attention, then a DeepSeek-style MoE
feed-forward (shared experts plus E routed experts, top-k softmax routing, an auxiliary
load-balance loss), dispatched GShard-style so that expert parallelism is a placement.

Part of the model zoo (autopar/models). `forward(tokens, labels)` returns the scalar
training loss: mean cross-entropy plus `aux_loss_coef` times the load-balance losses of
all layers.

Why the dispatch is written this way (GShard, Lepikhin et al. 2020, arXiv 2006.16668,
section 2.2 and its Algorithm 1): every shape is static, so the step traces on fake
tensors and every op has a sharding strategy in DTensor's registry.
- Groups: a group is a run of `group_tokens` consecutive tokens of one sequence (by
  default the whole sequence): g indexes (batch row, run), s the tokens of a run, so
  groups split with the batch wherever the batch is split (GShard's groups are a
  device's tokens).
- Capacity: each expert takes at most C = ceil(capacity_factor * s * k / E) tokens of a
  group (`MoEConfig.capacity`). Slots are taken in priority order: every token's first
  choice before any second choice, earlier tokens first within a choice (GShard's
  top-1-then-top-2 order, Algorithm 1). A choice that finds its expert full is dropped:
  it contributes nothing, and the residual connection carries the token on (Switch
  Transformer, Fedus et al. 2021, arXiv 2101.03961, section 2.2). The remaining gates are
  not renormalised after drops.
- Masks: `dispatch[g, s, e, c]` is 1 where token s of group g sits in slot c of expert e;
  `combine` is the same mask times the token's gate. Built with topk, one_hot and cumsum.
- Dispatch `einsum('gsec,gsm->egcm')`, experts as batched matmuls over e with weights
  [E, d, f] and [E, f, d] (SwiGLU), combine `einsum('gsec,egcm->gsm')`. With the groups
  sharded (Shard(g)) and the expert weights sharded on e, the change from Shard(g) to
  Shard(e) between dispatch and experts is DTensor's all-to-all: expert parallelism is a
  placement the intra-op ILP can choose, and the per-op program runs it.
- Cost of the formulation: the masks are [g, s, E, C] and the dispatch and combine
  einsums are dense, 2 * E * C * d FLOPs per token each, which grows with the group size
  (C ~ capacity_factor * k * s / E). Against the experts' 6 * k * d * f forward FLOPs per
  token that is 4 * capacity_factor * s / (6 f): 0.06 for Mixtral's sizes in groups of
  1024 tokens, 1.3 for DeepSeek-V3's in groups of 4096, hence the large presets' smaller
  groups. Systems that gather and scatter tokens by index (MegaBlocks, DeepSeek's
  kernels) pay no such term; their data-dependent shapes are what this formulation avoids.

Routing follows DeepSeek-V3 (arXiv 2412.19437, section 2.1.2) in its structure: shared
experts every token passes through, plus top-k routed experts whose gates are the
top-k affinities normalised to sum to one. Its affinities are softmax probabilities here
(DeepSeek-V2's and Mixtral's choice) rather than V3's sigmoid with a bias-based balance;
the balance is the auxiliary loss of Switch Transformer (eq. 4) with top-k counts, as in
GShard: aux = E * sum_e f_e * P_e, f_e the fraction of routed choices that pick expert e,
P_e the mean router probability of e, both per group and averaged over groups. It is 1
for a uniform router. Attention is the zoo Llama's (grouped-query), not V3's multi-head
latent attention, and every layer is a MoE layer (V3's first three are dense, and it adds
multi-token prediction): the `deepseek-v3-like` preset has V3's widths and expert counts,
not its exact parameter count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.llama import Attention, RMSNorm, init_weights, register_rope, rope


@dataclass(frozen=True, slots=True, kw_only=True)
class MoEConfig:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    experts: int
    """Routed experts per layer (E)."""
    top_k: int = 2
    """Routed experts each token is sent to (k)."""
    expert_ffn: int = 0
    """SwiGLU inner size of one routed expert; 0 means the Llama rule for `hidden`."""
    shared_experts: int = 1
    """Experts every token passes through (DeepSeek's shared experts; 0 for Mixtral). They
    run as one SwiGLU of inner size shared_experts * expert_ffn."""
    group_tokens: int = 0
    """Tokens per routing group (GShard's group size); 0, or anything at least seq, means one
    sequence per group. A smaller size must divide seq. The dispatch and combine einsums cost 2 * E * C * d FLOPs per token each, with C
    proportional to the group size (module docstring), so long sequences route in smaller
    groups."""
    capacity_factor: float = 1.25
    """Slots per expert per group, relative to an even split of the group's k*s choices
    (GShard, Switch Transformer); choices beyond capacity are dropped (module docstring)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balance loss in the training loss (Switch Transformer: 1e-2)."""
    kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 means heads (plain MHA)."""
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "seq", "experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"moe spec: {name} must be a positive integer, got {value!r}")
        if self.top_k > self.experts:
            raise ValueError(f"moe spec: top_k={self.top_k} exceeds experts={self.experts}; "
                             "each token picks top_k distinct experts")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"moe spec: hidden={self.hidden} must split into heads={self.heads} heads "
                             "of even size (RoPE)")
        if self.kv_heads < 0 or self.expert_ffn < 0 or self.shared_experts < 0:
            raise ValueError("moe spec: kv_heads, expert_ffn and shared_experts must be >= 0")
        if self.heads % self.num_kv_heads:
            raise ValueError(f"moe spec: heads={self.heads} is not divisible by kv_heads={self.num_kv_heads}")
        if self.group_tokens < 0 or (0 < self.group_tokens < self.seq and self.seq % self.group_tokens):
            raise ValueError(f"moe spec: group_tokens={self.group_tokens} must divide seq={self.seq} (0: one "
                             "sequence per group)")
        if not self.capacity_factor > 0:
            raise ValueError(f"moe spec: capacity_factor must be > 0, got {self.capacity_factor}")

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn_hidden(self) -> int:
        """Inner size of one routed expert."""
        if self.expert_ffn:
            return self.expert_ffn
        inner = int(2 * 4 * self.hidden / 3)
        return 256 * ((inner + 255) // 256)

    @property
    def ffn(self) -> int:
        """The shared experts' summed inner size."""
        return self.shared_experts * self.ffn_hidden

    @property
    def capacity(self) -> int:
        """Slots per expert per group of `group_tokens` (else `seq`) tokens."""
        return capacity(min(self.group_tokens or self.seq, self.seq), self.top_k, self.experts,
                        self.capacity_factor)


def capacity(tokens_per_group: int, top_k: int, experts: int, capacity_factor: float) -> int:
    """GShard's expert capacity: ceil(capacity_factor * tokens_per_group * k / E), at least 1
    and at most tokens_per_group (an expert never needs more slots than the group has tokens)."""
    return max(1, min(tokens_per_group, math.ceil(capacity_factor * tokens_per_group * top_k / experts)))


def route(logits: torch.Tensor, top_k: int, slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dispatch [g, s, E, C], combine [g, s, E, C], aux loss) from router logits [g, s, E].

    Static shapes only (module docstring): one_hot of the top-k choices, a cumsum over the
    group's choices in priority order (all first choices, then all second choices, ...)
    gives each choice its slot in its expert, and choices at slot >= C are dropped."""
    g, s, num_experts = logits.shape
    probs = logits.float().softmax(dim=-1)
    top_p, top_i = probs.topk(top_k, dim=-1)                            # [g, s, k]
    gates = top_p / top_p.sum(dim=-1, keepdim=True)
    chosen = F.one_hot(top_i, num_experts).to(probs.dtype)              # [g, s, k, E]
    by_priority = chosen.transpose(1, 2).reshape(g, top_k * s, num_experts)
    slot = (by_priority.cumsum(dim=1) - 1.0).reshape(g, top_k, s, num_experts).transpose(1, 2)
    kept = chosen * (slot < slots).to(probs.dtype)                      # [g, s, k, E]
    # a token picks k distinct experts, so each (token, expert) pair has at most one kept
    # choice: fold k before the slot one-hot (a [g, s, E] slot, not a [g, s, k, E, C] mask)
    slot_of = (kept * slot).sum(dim=2)                                   # [g, s, E]
    dispatch = kept.sum(dim=2).unsqueeze(-1) * F.one_hot(slot_of.long(), slots).to(probs.dtype)  # [g, s, E, C]
    combine = (kept * gates.unsqueeze(-1)).sum(dim=2).unsqueeze(-1) * dispatch
    fraction = chosen.sum(dim=2).mean(dim=1) / top_k                    # [g, E]
    mean_prob = probs.mean(dim=1)                                        # [g, E]
    aux = num_experts * (fraction * mean_prob).sum(dim=-1).mean()
    return dispatch.to(logits.dtype), combine.to(logits.dtype), aux


class MoEFeedForward(nn.Module):
    """Shared experts + top-k routed experts, GShard dispatch (module docstring)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k, self.num_experts, self.capacity_factor = cfg.top_k, cfg.experts, cfg.capacity_factor
        self.group_tokens = cfg.group_tokens
        self.gate = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        e, d, f = cfg.experts, cfg.hidden, cfg.ffn_hidden
        self.w1 = nn.Parameter(torch.empty(e, d, f))
        self.w3 = nn.Parameter(torch.empty(e, d, f))
        self.w2 = nn.Parameter(torch.empty(e, f, d))
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, mean=0.0, std=0.02)
        self.shared = SharedExperts(cfg.hidden, cfg.ffn) if cfg.shared_experts else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, s, d] -> (y [b, s, d], aux loss); groups are runs of `group_tokens` tokens
        of a sequence (whole sequences by default), so they split with the batch."""
        b, s, d = x.shape
        size = min(self.group_tokens or s, s)
        if s % size:
            raise ValueError(f"MoE layer: {s} tokens per sequence do not split into groups of {size}")
        x = x.reshape(b * (s // size), size, d)
        slots = capacity(size, self.top_k, self.num_experts, self.capacity_factor)
        dispatch, combine, aux = route(self.gate(x), self.top_k, slots)
        xe = torch.einsum("gsec,gsm->egcm", dispatch, x)
        h = F.silu(torch.einsum("egcm,emf->egcf", xe, self.w1)) * torch.einsum("egcm,emf->egcf", xe, self.w3)
        ye = torch.einsum("egcf,efm->egcm", h, self.w2)
        y = torch.einsum("gsec,egcm->gsm", combine, ye)
        if self.shared is not None:
            y = y + self.shared(x)
        return y.reshape(b, s, d), aux


class SharedExperts(nn.Module):
    """The shared experts as one SwiGLU of their summed inner size (DeepSeekMoE's shared
    experts are dense experts every token passes through; side by side they are one wider
    SwiGLU)."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attention = Attention(cfg)  # type: ignore[arg-type]  # reads hidden, heads, num_kv_heads
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.moe = MoEFeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        y, aux = self.moe(self.ffn_norm(x))
        return x + y, aux


class MoE(nn.Module):
    """MoE decoder. Submodules `layers.<i>` are the repeated blocks."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.apply(init_weights)
        register_rope(self, cfg)  # type: ignore[arg-type]  # reads hidden, heads, rope_theta, seq

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cos, sin = rope(self, tokens.shape[1], self.tok_embeddings.weight.dtype)
        x = self.tok_embeddings(tokens)
        auxes = []
        for layer in self.layers:
            x, aux = layer(x, cos, sin)
            auxes.append(aux)
        logits = self.output(self.norm(x))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        return loss + self.cfg.aux_loss_coef * torch.stack(auxes).sum()
