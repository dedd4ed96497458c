"""The torchtitan baseline (benchmarks/baselines/torchtitan_baseline.py) trains like one process, and
autopar's zoo Llama with the mapped weights computes torchtitan's model.

Needs the `bench` install (`make bench-install`); skipped, with the reason, without it.
The autopar-vs-torchtitan figures (benchmarks/measure_torchtitan.py) only mean something if
(1) torchtitan's own parallel program computes the single-process training step under
FSDP, FSDP x TP (sequence + loss parallel) and PP on 4 gloo processes (3 AdamW steps,
rtol 1e-4), and (2) both sides start from the same function: the zoo Llama holding
`zoo_state_dict(torchtitan model)` gives torchtitan's loss.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import benchmarks.baselines.torchtitan_baseline as tb

_why = tb.available()
if _why is not None:
    pytest.skip(f"{_why}; `make bench-install` installs the torchtitan baseline", allow_module_level=True)

from autopar.runtime.launch import spawn  # noqa: E402

pytestmark = pytest.mark.dist

SHAPE = tb.TitanShape(layers=2, dim=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=32)
GLOBAL_BATCH = 8
STEPS = 3
CONFIGS = {
    "fsdp4": tb.TitanConfig(dp_shard=4, local_batch_size=2),
    "fsdp2 x tp2": tb.TitanConfig(dp_shard=2, tp=2, local_batch_size=4),
    "pp2 x fsdp2": tb.TitanConfig(pp=2, dp_shard=2, local_batch_size=4, pp_microbatch_size=1),
}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, SHAPE.vocab, (GLOBAL_BATCH, SHAPE.seq), generator=g),
             torch.randint(0, SHAPE.vocab, (GLOBAL_BATCH, SHAPE.seq), generator=g)) for _ in range(STEPS)]


def _worker(rank: int) -> dict[str, list[float]]:
    out = {}
    for label, config in CONFIGS.items():
        program = tb.build(SHAPE, config, global_batch=GLOBAL_BATCH)
        out[label] = [program.step(batch) for batch in _batches()]
    return out


def _zoo_logits(zoo: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    s = tokens.shape[1]
    x = zoo.tok_embeddings(tokens)
    for layer in zoo.layers:
        x = layer(x, zoo.rope_cos[:s], zoo.rope_sin[:s])
    return zoo.output(zoo.norm(x))


@pytest.mark.parametrize("fuse_qkv", [True, False])
def test_zoo_llama_with_mapped_weights_is_torchtitans_model(fuse_qkv):
    shape = replace(SHAPE, fuse_qkv=fuse_qkv)
    titan = tb.reference_model(shape, seed=5)
    zoo = tb.zoo_model(shape, seed=5)
    tokens, labels = _batches()[0]
    with torch.no_grad():
        expected = titan(tokens)
        torch.testing.assert_close(_zoo_logits(zoo, tokens), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(zoo(tokens, labels), tb.titan_loss(expected, labels), rtol=1e-6, atol=0)
        # the RoPE pair permutation matters: wq rows in torchtitan's order give other logits
        hd, hpk = SHAPE.head_dim, SHAPE.heads // SHAPE.kv_heads
        if fuse_qkv:
            wqkv = titan.get_parameter("layers.0.attention.qkv_linear.wqkv.weight")
            wq = wqkv.reshape(SHAPE.kv_heads, hpk + 2, hd, SHAPE.dim)[:, :hpk].reshape(-1, SHAPE.dim)
        else:
            wq = titan.get_parameter("layers.0.attention.qkv_linear.wq.weight")
        zoo.layers[0].attention.wq.weight.copy_(wq)
        assert (_zoo_logits(zoo, tokens) - expected).abs().max() > 5e-4  # 1.8e-3 here; mapped: 5e-7


def test_torchtitan_baseline_matches_single_process():
    reference = tb.reference_losses(SHAPE, _batches())
    per_rank = spawn(_worker, 4, (), collective_timeout_s=180.0)
    for label in CONFIGS:
        for r, rec in enumerate(per_rank):
            assert rec[label] == per_rank[0][label], f"{label}: rank {r} reports another global loss"
        torch.testing.assert_close(torch.tensor(per_rank[0][label]), torch.tensor(reference), rtol=1e-4, atol=0,
                                   msg=lambda m, label=label: f"{label}: {m}")
    assert len(set(reference)) == STEPS  # the weights change between steps: later losses test the update
