"""Model factories for tests that go through `autopar train FACTORY` (`tests.factories:NAME`).

Each returns `(model, example_inputs)` with a forward that returns the scalar loss, the
factory contract of autopar/models/zoo.py. Built from configs only (no downloads), under
a fixed seed so the launcher, every rank and the reference build the same weights.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ, BATCH = 64, 16, 4


class CausalLMLoss(nn.Module):
    """A Hugging Face causal LM whose forward(input_ids, labels) returns the loss tensor."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, labels=labels).loss


def hf_gpt2_dropout() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """GPT-2 from a Hugging Face config with its default dropout (0.1 on embeddings,
    attention probabilities and residual branches), tiny: 2 layers, hidden 32."""
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    torch.manual_seed(0)
    model = CausalLMLoss(transformers.GPT2LMHeadModel(config))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return model, (ids, ids.clone())
