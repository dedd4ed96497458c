"""Pure-PyTorch reference math for the fused kernels (forward and backward).

Where it sits: `codegen/kernels/ops.py` runs these when Triton cannot run (CPU without
`TRITON_INTERPRET=1`); tests compare the Triton kernels against eager modules and against
these. Every function computes in float32 and returns outputs in the input dtype, as the
Triton kernels do, and saves the same statistics (per-row `rstd`, `mean`, `lse`) so the
backward of both paths needs the same inputs.

Terms: a *row* is one token's vector along the last dim (hidden or vocabulary); `num_rows`
is the product of the leading dims. GeLU is the tanh approximation (GPT-2's).
"""

from __future__ import annotations

import math

import torch

GELU_TANH_K = math.sqrt(2.0 / math.pi)
GELU_TANH_C = 0.044715


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = xf * rstd * weight.float()
    return y.to(x.dtype), rstd.squeeze(-1)


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf, dyf, r = x.float(), dy.float(), rstd.unsqueeze(-1)
    g = dyf * weight.float()
    # d/dx of x*r: r*g - x*r^3*mean(g*x), from r = (mean(x^2)+eps)^-1/2
    dx = r * g - xf * r.pow(3) * (g * xf).mean(-1, keepdim=True)
    dw = (dyf * xf * r).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + eps)
    y = (xf - mean) * rstd * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), mean.squeeze(-1), rstd.squeeze(-1)


def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                   rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xf, dyf, r = x.float(), dy.float(), rstd.unsqueeze(-1)
    xhat = (xf - mean.unsqueeze(-1)) * r
    g = dyf * weight.float()
    dx = r * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    flat = (-1, x.shape[-1])
    dw = (dyf * xhat).reshape(flat).sum(0)
    db = dyf.reshape(flat).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype), db.to(weight.dtype)


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = gate.float()
    return (g * torch.sigmoid(g) * up.float()).to(gate.dtype)


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g, u, dyf = gate.float(), up.float(), dy.float()
    s = torch.sigmoid(g)
    dgate = dyf * u * (s + g * s * (1.0 - s))
    dup = dyf * g * s
    return dgate.to(gate.dtype), dup.to(up.dtype)


def _gelu_tanh_parts(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tanh(GELU_TANH_K * (z + GELU_TANH_C * z.pow(3)))
    return t, 0.5 * z * (1.0 + t)


def bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    _, y = _gelu_tanh_parts(x.float() + bias.float())
    return y.to(x.dtype)


def bias_gelu_bwd(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = x.float() + bias.float()
    t, _ = _gelu_tanh_parts(z)
    dgelu = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * GELU_TANH_K * (1.0 + 3.0 * GELU_TANH_C * z * z)
    dx = dy.float() * dgelu
    dbias = dx.reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dbias.to(bias.dtype)


def ce_chunk_stats(logits: torch.Tensor, labels: torch.Tensor,
                   vocab_start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of a (rows x local vocab) chunk: max, sum of exp(logit - max), target logit.

    The target logit is 0 on rows whose label falls outside this rank's vocab slice, so a
    sum over the tensor-parallel group yields the true target logit.
    """
    lf = logits.float()
    row_max = lf.amax(-1)
    sum_exp = torch.exp(lf - row_max.unsqueeze(-1)).sum(-1)
    local = labels - vocab_start
    here = (local >= 0) & (local < logits.shape[-1])
    picked = lf.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return row_max, sum_exp, torch.where(here, picked, torch.zeros_like(picked))


def ce_chunk_grad(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                  vocab_start: int) -> torch.Tensor:
    """d loss / d logits for a chunk: (softmax - onehot(target)) * per-row scale, float32."""
    grad = torch.exp(logits.float() - lse.unsqueeze(-1))
    local = labels - vocab_start
    here = (local >= 0) & (local < logits.shape[-1])
    rows = torch.nonzero(here).squeeze(-1)
    grad[rows, local[rows]] -= 1.0
    return grad * scale.unsqueeze(-1)
