"""Hugging Face models built from small configs (no downloads), as autopar factories.

Each function returns `(model, example_inputs)` with a forward that returns the scalar
loss, the form `autopar train package.module:function` and `autopar.compile` take.
Dropout is 0 unless a test asks otherwise; weights come from `torch.manual_seed` set by
the caller (autopar.runtime.jobs builds every rank's copy under the job's seed).
"""

from __future__ import annotations

import torch
from torch import nn

BATCH, SEQ, VOCAB = 8, 16, 128


class LossOf(nn.Module):
    """A Hugging Face model whose forward(input_ids, labels) returns the loss tensor."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids, labels=labels).loss


def _tokens(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def gpt2(num_layers: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=num_layers, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    ids, _ = _tokens()
    return LossOf(GPT2LMHeadModel(cfg)), (ids, ids)


def gpt2_4layers():
    """GPT-2 with 4 blocks: enough layers for pp 2 x interleave 2."""
    return gpt2(num_layers=4)


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      attention_dropout=0.0)
    ids, _ = _tokens()
    return LossOf(LlamaForCausalLM(cfg)), (ids, ids)


def distilbert():
    """Encoder-only: masked-language-model loss on every position."""
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    cfg = DistilBertConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, dim=64, n_layers=2, n_heads=4,
                           hidden_dim=128, dropout=0.0, attention_dropout=0.0)
    ids, labels = _tokens()
    return LossOf(DistilBertForMaskedLM(cfg)), (ids, labels)


def bert():
    """BERT masked LM: its prediction head registers one bias under two names
    (`cls.predictions.bias` and `cls.predictions.decoder.bias`)."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    ids, labels = _tokens()
    return LossOf(BertForMaskedLM(cfg)), (ids, labels)


def t5():
    """Encoder-decoder: T5 with a masked-span-style target (labels through the decoder)."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_decoder_layers=1,
                   num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    ids, labels = _tokens()
    return LossOf(T5ForConditionalGeneration(cfg)), (ids, labels)


def mixtral():
    """Mixtral: 4 routed experts per layer, top-2, on Hugging Face's experts interface (autopar
    traces them through autopar/grouped_mm.py's op)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                        num_local_experts=4, num_experts_per_tok=2, attention_dropout=0.0)
    ids, _ = _tokens()
    return LossOf(MixtralForCausalLM(cfg)), (ids, ids)


def qwen2_moe():
    """Qwen2-MoE: 4 routed experts, top-2, beside a gated shared expert in every layer."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=SEQ, num_experts=4, num_experts_per_tok=2,
                         attention_dropout=0.0, decoder_sparse_step=1, mlp_only_layers=[])
    ids, _ = _tokens()
    return LossOf(Qwen2MoeForCausalLM(cfg)), (ids, ids)


def gpt_oss():
    """gpt-oss: 4 routed experts, top-2, with their weights stored transposed, biases and a
    clamped, interleaved gate (Hugging Face's experts interface with every option on)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ,
                       num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                       layer_types=["full_attention", "full_attention"])
    ids, _ = _tokens()
    return LossOf(GptOssForCausalLM(cfg)), (ids, ids)
