"""autopar/determinism.py: random ops found in traced steps, and the deterministic mode
`train --check` runs them in (same masks whatever the batch slicing, recomputation or
call order; real dropout semantics; unsupported ops refused)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.determinism import UnsupportedRandomOpError, deterministic_random, random_ops, unsupported
from autopar.models import resolve
from autopar.trace import trace
from tests import factories

pytest.importorskip("transformers", reason="transformers not installed (extra 'test')")


@pytest.fixture(scope="module")
def gpt2():
    return factories.hf_gpt2_dropout()


def test_traced_dropout_is_found_and_attention_without_dropout_is_not(gpt2):
    model, batch = gpt2
    found = random_ops(trace(model, batch).gm)
    assert found == {"aten.native_dropout.default": 7}  # embeddings, 2 x (attention probs, 2 residuals)
    assert unsupported(found) == []
    zoo = resolve("gpt-tiny")
    assert random_ops(trace(zoo.build(), zoo.example_inputs(2)).gm) == {}  # SDPA with dropout_p 0 is not random
    shuffled, inputs = factories.shuffled_features()
    assert unsupported(random_ops(trace(shuffled, inputs).gm)) == ["aten.randperm.default"]


def test_masks_do_not_depend_on_how_the_batch_is_split(gpt2):
    """What data parallelism and microbatching need: the loss of the whole batch is the mean
    of the losses of its halves, dropout included, and dropout is really on."""
    model, (ids, labels) = gpt2
    with deterministic_random() as counts, torch.no_grad():
        whole = model(ids, labels)
        halves = [model(ids[i:i + 2], labels[i:i + 2]) for i in (0, 2)]
        again = model(ids, labels)
    assert counts["aten.bernoulli_.float"] == 4 * 7  # four forwards, seven dropouts each
    torch.testing.assert_close(whole, (halves[0] + halves[1]) / 2, rtol=1e-6, atol=0)
    assert whole == again
    model.eval()
    with torch.no_grad():
        assert abs(float(model(ids, labels)) - float(whole)) > 1e-4  # the masks changed the loss
    model.train()


def test_dropout_semantics_and_recomputation():
    p = 0.25
    x = torch.ones(64, 4096, requires_grad=True)
    with deterministic_random():
        y = nn.functional.dropout(x, p)
        keep, scaled = (y != 0), y[y != 0]
        out, mask = torch.ops.aten.native_dropout(x.detach(), p, True)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.02
    torch.testing.assert_close(scaled, torch.full_like(scaled, 1 / (1 - p)))
    assert torch.equal(mask, keep) and torch.equal(out, y.detach())  # bernoulli and native_dropout agree
    assert torch.equal(keep[0], keep[-1])  # the same mask in every row

    layer = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 1))
    inp = torch.randn(8, 16)
    grads = []
    for recompute in (False, True):
        layer.zero_grad()
        with deterministic_random():
            out = torch.utils.checkpoint.checkpoint(layer, inp, use_reentrant=False) if recompute else layer(inp)
            out.sum().backward()
        grads.append(layer[0].weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_other_random_draws_and_unsupported_ops():
    with deterministic_random():
        u, z = torch.rand(3, 10_000), torch.randn(2, 10_000)
        w = torch.empty(5, 10_000).uniform_(-1.0, 3.0)
        with pytest.raises(UnsupportedRandomOpError, match="aten.randperm.default draws random numbers"):
            torch.randperm(5)
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean().item() - 0.5) < 0.02
    assert abs(z.mean().item()) < 0.05 and abs(z.std().item() - 1.0) < 0.05
    assert -1.0 <= w.min() and w.max() <= 3.0
    assert torch.equal(u, torch.rand(3, 10_000)) is False  # outside the mode: the real generator
