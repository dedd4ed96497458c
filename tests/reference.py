"""The single-process reference run: the oracle the multi-process tests compare losses with.

Where it sits: tests/, beside the tests that use it (tests/dist/); no product module
imports it. `reference_losses` trains an unsharded model in this process, one optimizer
step per batch, and returns each step's loss: a parallel program of the same model,
optimizer and batches must reproduce them (the batch is the global one every rank sees).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn


def reference_losses(model: nn.Module, batch: Sequence[Any], *, steps: int,
                     optimizer: Callable[..., torch.optim.Optimizer],
                     loss_fn: Callable[..., torch.Tensor] | None = None) -> list[float]:
    """`steps` optimizer steps of `model` on the same `batch`, the loss of each. The model
    returns its loss from `model(*batch)`, or with `loss_fn` its output from
    `model(*batch[:-1])`, scored as `loss_fn(output, batch[-1])` (autopar.compile's rule)."""
    opt = optimizer(model.parameters())
    losses = []
    for _ in range(steps):
        loss = model(*batch) if loss_fn is None else loss_fn(model(*batch[:-1]), batch[-1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses
