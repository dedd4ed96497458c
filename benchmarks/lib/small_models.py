"""Small recurrent models for the search-speed benchmark (benchmarks/bench_search.py
--only small): factories `benchmarks.lib.small_models:lstm` / `:gru`, built from sizes only.

An embedding, one recurrent layer of 96 units over 64 steps, and a linear head over a
64-token vocabulary (about 83k parameters for the LSTM). A recurrent layer is traced
unrolled, one cell per step, and has no repeated layer stack: every step's ops are
distinct nodes of the ILP, so such a model is a worst case for the search's size.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ, BATCH, HIDDEN = 64, 64, 8, 96


class RecurrentLM(nn.Module):
    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.rnn = cell(64, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(ids))
        return nn.functional.cross_entropy(self.head(out).flatten(0, 1), labels.flatten())


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return ids, ids.roll(1, dims=1)


def lstm() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return RecurrentLM(nn.LSTM), _batch()


def gru() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return RecurrentLM(nn.GRU), _batch()
