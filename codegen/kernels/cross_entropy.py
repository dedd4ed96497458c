"""Chunked, vocabulary-parallel cross-entropy fused with the output (logit) layer.

Where it sits: the loss of a language model, `mean_t CE(hidden_t @ weight.T, label_t)`, as
one op. The runtime calls `vocab_parallel_cross_entropy` when the output layer is sharded
over the vocabulary (tensor parallel: each rank holds rows [vocab_start, vocab_start +
local_vocab) of `weight`); with no group it is the plain fused loss.

Math, per token t (rows of `hidden`), over the local vocab slice V_r of rank r:
    m_r = max_v z_tv,  s_r = sum_v exp(z_tv - m_r),  y_r = z_t,label if label in V_r else 0
    m = allreduce_max(m_r),  s = allreduce_sum(s_r * exp(m_r - m)),  y = allreduce_sum(y_r)
    lse = m + log s,  loss = sum_{t valid} (lse - y) / num_valid
    d loss / d z_tv = (exp(z_tv - lse) - [v == label]) * g / num_valid
Forward and backward walk the tokens in chunks of `chunk_tokens`, so at most
(chunk_tokens x local_vocab) logits exist at once: the (tokens x vocab) logits and
probabilities are never materialised. The backward recomputes each chunk's logits (one
extra GEMM) from the saved per-token `lse`. The two stats all-reduces run once over all
tokens, not per chunk. `hidden` is taken as replicated over the group, so its gradient is
summed over the group (Megatron's `copy_to_tensor_model_parallel_region` backward).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from codegen.kernels.ops import LIB, kernel_backend

DEFAULT_CHUNK_TOKENS = 1024
"""Tokens per chunk: 1024 x 128K vocab x 4 B = 512 MiB of logits at most per chunk."""


def _group(group_name: str) -> Any:
    if not group_name:
        return None

    return _resolve_process_group(group_name)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    # GEMM in the input dtype (tensor cores on GPU); the softmax math is float32.
    return (hidden[start:stop] @ weight.t()).float().contiguous()


@torch.library.custom_op(f"{LIB}::vocab_parallel_ce", mutates_args=())
def _vocab_parallel_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                       chunk_tokens: int, ignore_index: int, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    kern = kernel_backend(hidden)
    num_tokens = hidden.shape[0]
    row_max, sum_exp, target = (torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
                                for _ in range(3))
    for start in range(0, num_tokens, chunk_tokens):
        stop = min(start + chunk_tokens, num_tokens)
        logits = _chunk_logits(hidden, weight, start, stop)
        m, s, y = kern.ce_chunk_stats(logits, labels[start:stop].contiguous(), vocab_start)
        row_max[start:stop], sum_exp[start:stop], target[start:stop] = m, s, y
        del logits
    pg = _group(group_name)
    if pg is not None:
        local_max = row_max.clone()
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=pg)
        both = torch.stack((sum_exp * torch.exp(local_max - row_max), target))
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=pg)
        sum_exp, target = both[0], both[1]
    lse = row_max + torch.log(sum_exp)
    valid = labels != ignore_index
    loss = torch.where(valid, lse - target, 0.0).sum() / valid.sum()
    return loss, lse


@_vocab_parallel_ce.register_fake
def _(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_start: int, chunk_tokens: int,
      ignore_index: int, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return hidden.new_empty((), dtype=torch.float32), hidden.new_empty(hidden.shape[:1], dtype=torch.float32)


@torch.library.custom_op(f"{LIB}::vocab_parallel_ce_backward", mutates_args=())
def _vocab_parallel_ce_backward(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                                labels: torch.Tensor, lse: torch.Tensor, vocab_start: int, chunk_tokens: int,
                                ignore_index: int, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    kern = kernel_backend(hidden)
    valid = labels != ignore_index
    scale = torch.where(valid, grad_loss.float() / valid.sum(), 0.0)
    dhidden = torch.empty_like(hidden)
    dweight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        stop = min(start + chunk_tokens, hidden.shape[0])
        logits = _chunk_logits(hidden, weight, start, stop)
        grad = kern.ce_chunk_grad(logits, labels[start:stop].contiguous(), lse[start:stop].contiguous(),
                                  scale[start:stop].contiguous(), vocab_start).to(hidden.dtype)
        del logits
        dhidden[start:stop] = grad @ weight
        # in the input dtype (tensor cores), summed over chunks in float32: an fp32 GEMM here
        # ran on an H100's CUDA cores, 223 ms for 8192 tokens x 128K vocab against eager's 51
        dweight += grad.t() @ hidden[start:stop]
        del grad
    pg = _group(group_name)
    if pg is not None:
        dist.all_reduce(dhidden, op=dist.ReduceOp.SUM, group=pg)
    return dhidden, dweight.to(weight.dtype)


@_vocab_parallel_ce_backward.register_fake
def _(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
      lse: torch.Tensor, vocab_start: int, chunk_tokens: int, ignore_index: int,
      group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(hidden), torch.empty_like(weight)


def _ce_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    hidden, weight, labels, ctx.vocab_start, ctx.chunk_tokens, ctx.ignore_index, ctx.group_name = inputs
    ctx.save_for_backward(hidden, weight, labels, output[1])


def _ce_grad(ctx: Any, grad_loss: torch.Tensor, _dlse: torch.Tensor) -> tuple[Any, ...]:
    hidden, weight, labels, lse = ctx.saved_tensors
    dh, dw = _vocab_parallel_ce_backward(grad_loss, hidden, weight, labels, lse, ctx.vocab_start,
                                         ctx.chunk_tokens, ctx.ignore_index, ctx.group_name)
    return dh, dw, None, None, None, None, None


_vocab_parallel_ce.register_autograd(_ce_grad, setup_context=_ce_setup)


def vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = -100,
    group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `labels`, chunked over tokens.

    hidden: (..., hidden_dim), replicated over `group`; weight: (local_vocab, hidden_dim),
    this rank's vocab slice; labels: (...) global vocab ids, replicated. `vocab_start`
    defaults to rank * local_vocab (an even split). Equals
    `F.cross_entropy(hidden @ full_weight.T, labels, ignore_index=ignore_index)`.
    """
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(
            f"vocab_parallel_cross_entropy: weight must be (local_vocab, {hidden.shape[-1]}) to match "
            f"hidden's last dim, given weight {tuple(weight.shape)}; pass the output layer's weight slice")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: labels shape {tuple(labels.shape)} must equal hidden's "
            f"leading dims {tuple(hidden.shape[:-1])}; pass one label per token")
    if chunk_tokens <= 0:
        raise ValueError(f"vocab_parallel_cross_entropy: chunk_tokens must be positive, given {chunk_tokens}")
    group_name = ""
    if group is not None and dist.get_world_size(group) > 1:
        group_name = group.group_name
        if vocab_start is None:
            vocab_start = dist.get_rank(group) * weight.shape[0]
    loss, _lse = _vocab_parallel_ce(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                    vocab_start or 0, chunk_tokens, ignore_index, group_name)
    return loss

