"""Model factories for tests that go through `autopar train FACTORY` (`tests.factories:NAME`).

Each returns `(model, example_inputs)` with a forward that returns the scalar loss, the
factory contract of autopar/models/zoo.py. Built from configs only (no downloads), under
a fixed seed so the launcher, every rank and the reference build the same weights.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ, BATCH = 64, 16, 4
"""Sizes of the GPT-2 factory's batch, and the vocabulary of the embedding + head model."""


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
                                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0,
                                     eos_token_id=0)
    torch.manual_seed(0)
    model = CausalLMLoss(transformers.GPT2LMHeadModel(config))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return model, (ids, ids.clone())


class MLP(nn.Module):
    """Three distinct linear layers: no repeated layer stack."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 12), nn.Linear(12, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x))))), y)


def mlp_batch() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return MLP(), mlp_batch()


class SmallCNN(nn.Module):
    """Two convolutions of different shapes and a linear head: no repeated layer stack."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 8, 3, stride=2)
        self.head = nn.Linear(8 * 3 * 3, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return nn.functional.cross_entropy(self.head(h.flatten(1)), y)


def cnn() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    return SmallCNN(), (torch.randn(8, 1, 7, 7, generator=g), torch.randint(0, 5, (8,), generator=g))


class EmbeddingHead(nn.Module):
    """An embedding and a linear head over the vocabulary: no layer stack between them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.embed(tokens)).flatten(0, 1), labels.flatten())


def embedding_head() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    return EmbeddingHead(), (torch.randint(0, VOCAB, (8, 6), generator=g), torch.randint(0, VOCAB, (8, 6), generator=g))


class ShuffledFeatures(MLP):
    """Permutes its input features at random each step (`torch.randperm`): a random op that
    `--check` has no deterministic stand-in for."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().forward(x[:, torch.randperm(x.shape[1])], y)


def shuffled_features() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return ShuffledFeatures(), mlp_batch()


class SharedBias(nn.Module):
    """A masked-LM-style head whose bias is also its decoder's bias: one Parameter under two
    names (`bias` and `decoder.bias`), as BERT's prediction head registers it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.transform = nn.Linear(16, 16)
        self.decoder = nn.Linear(16, VOCAB)
        self.bias = self.decoder.bias

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.decoder(torch.tanh(self.transform(self.embed(ids))))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def shared_bias() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(1))
    return SharedBias(), (ids, ids.roll(1, dims=1))


class ModuleTwice(nn.Module):
    """One block applied twice (weights shared across both uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.block = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = torch.relu(self.block(h))
        h = torch.relu(self.block(h))
        return nn.functional.mse_loss(self.out(h), y)


def module_twice() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return ModuleTwice(), mlp_batch()


class BatchNormCNN(nn.Module):
    """A convolution, BatchNorm2d (running mean / variance / batch count updated in forward)
    and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 7 * 7, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(torch.relu(self.bn(self.conv(x))).flatten(1)), y)


def batchnorm_cnn() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    return BatchNormCNN(), (torch.randn(8, 1, 7, 7, generator=g), torch.randint(0, 5, (8,), generator=g))


class CountingMLP(MLP):
    """An MLP that counts its forward calls in a buffer (`register_buffer`), as schedulers
    and EMA wrappers keep a step counter."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x, y)


def counting_mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return CountingMLP(), mlp_batch()


class SmallLSTM(nn.Module):
    """An embedding, a one-layer LSTM and a linear head (83k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.lstm = nn.LSTM(64, 96, batch_first=True)
        self.head = nn.Linear(96, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(ids))
        return nn.functional.cross_entropy(self.head(out).flatten(0, 1), labels.flatten())


def small_lstm() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (8, SEQ), generator=g)
    return SmallLSTM(), (ids, ids.roll(1, dims=1))


class VectorLoss(MLP):
    """Returns the per-sample loss vector instead of a scalar."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x))))) - y) ** 2).mean(dim=1)


def vector_loss() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return VectorLoss(), mlp_batch()


class DictBatchLM(nn.Module):
    """A forward that takes one dict batch, `model({"input_ids": ..., "labels": ...})`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.Linear(16, VOCAB)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.head(torch.tanh(self.mix(self.embed(batch["input_ids"]))))
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def dict_batch() -> tuple[nn.Module, tuple[dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(5))
    return DictBatchLM(), ({"input_ids": ids, "labels": ids.roll(1, dims=1)},)


class KeywordOnlyLM(DictBatchLM):
    """A forward whose inputs are keyword-only: `model(input_ids=..., labels=...)`."""

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward({"input_ids": input_ids, "labels": labels})


def keyword_only() -> tuple[nn.Module, tuple[()], dict[str, torch.Tensor]]:
    """The keyword form of the factory contract: (model, positional inputs, keyword inputs)."""
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(5))
    return KeywordOnlyLM(), (), {"input_ids": ids, "labels": ids.roll(1, dims=1)}


class TinyViT(nn.Module):
    """Patches of a 3-channel image, one attention layer, a class head: no token ids."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 16, 4, stride=4)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return nn.functional.cross_entropy(self.head(x.mean(1)), labels)


def tiny_vit() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(6)
    return TinyViT(), (torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 5, (8,), generator=g))
