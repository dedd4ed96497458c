"""Llama family in plain PyTorch: RMSNorm, RoPE, SwiGLU, grouped-query attention.

Part of the model zoo (autopar/models). `forward(tokens, labels)` returns the scalar
mean cross-entropy loss. RoPE tables are non-persistent buffers, so a trace sees them
as inputs rather than as factory ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaConfig:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 means heads (plain MHA)."""
    ffn: int = 0
    """SwiGLU inner size; 0 means the Llama rule (2/3 of 4*hidden, rounded up to 256)."""
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"llama spec: {name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(
                f"llama spec: hidden={self.hidden} is not divisible by heads={self.heads}; "
                "pick heads that divide hidden"
            )
        if (self.hidden // self.heads) % 2:
            raise ValueError(f"llama spec: head dim {self.hidden // self.heads} must be even for RoPE")
        if self.kv_heads < 0 or self.ffn < 0:
            raise ValueError("llama spec: kv_heads and ffn must be >= 0")
        if self.heads % self.num_kv_heads:
            raise ValueError(
                f"llama spec: heads={self.heads} is not divisible by kv_heads={self.num_kv_heads}; "
                "kv_heads must divide heads"
            )

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn_hidden(self) -> int:
        if self.ffn:
            return self.ffn
        inner = int(2 * 4 * self.hidden / 3)
        return 256 * ((inner + 255) // 256)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.hidden // cfg.heads
        self.wq = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, self.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, self.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Llama 2/3 decoder. Submodules `layers.<i>` are the repeated blocks."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.apply(init_weights)
        register_rope(self, cfg)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cos, sin = rope(self, tokens.shape[1], self.tok_embeddings.weight.dtype)
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def register_rope(module: nn.Module, cfg: LlamaConfig) -> None:
    """Rotary position tables for `cfg.seq` positions as `module`'s non-persistent buffers
    `rope_cos` and `rope_sin` ([seq, head_dim], each frequency twice: the rotate-half form),
    frequencies theta^(-2i / head_dim) (RoFormer, arXiv 2104.09864)."""
    head_dim = cfg.hidden // cfg.heads
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(cfg.seq).float(), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    module.register_buffer("rope_cos", angles.cos(), persistent=False)
    module.register_buffer("rope_sin", angles.sin(), persistent=False)


def rope(module: nn.Module, seq: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `seq` rows of `module`'s rotary tables (`register_rope`), in `dtype`."""
    return module.rope_cos[:seq].to(dtype), module.rope_sin[:seq].to(dtype)


def init_weights(module: nn.Module) -> None:
    """GPT-2 initialisation: N(0, 0.02) weights, zero biases (loss starts near log(vocab))."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
