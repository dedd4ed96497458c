"""The benchmark's hand-tuned baseline (benchmarks/baselines/handtuned.py) trains like one process.

The autopar-vs-hand-tuned figures (benchmarks/measure_cpu.py) only mean something if the
baseline computes the same training step: 3 AdamW steps of a small Llama under each
hand-picked configuration must give the single-process losses (rtol 1e-4), including the
DDP-style bucketed gradient all-reduce (tiny buckets here, so several are exercised).
"""

from __future__ import annotations

import pytest
import torch

from autopar.runtime.jobs import TrainJob, build_model_and_batches, reference_run
from autopar.runtime.launch import spawn

pytestmark = pytest.mark.dist

LLAMA = "llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=32"
CONFIGS = {  # (dp, tp, pp, zero)
    "dp4": (4, 1, 1, 0),
    "zero3 dp4": (4, 1, 1, 3),
    "dp2xtp2": (2, 2, 1, 0),
    "dp2xpp2": (2, 1, 2, 0),
    "tp2xpp2": (1, 2, 2, 0),
}


def _worker(rank: int, job: TrainJob, configs: dict[str, tuple[int, int, int, int]]) -> dict[str, list[float]]:
    import torch.distributed as dist

    from benchmarks.baselines import handtuned  # the repository root: conftest.py

    handtuned.DDP_BUCKET_BYTES = 64 * 1024  # several buckets for a model this small
    out = {}
    for label, (dp, tp, pp, zero) in configs.items():
        model, batches, _ = build_model_and_batches(job)
        cfg = handtuned.HandConfig(dp=dp, tp=tp, pp=pp, zero=zero, micro_batch=1)
        hand = handtuned.HandTuned(model, cfg, num_microbatches=job.global_batch // dp, lr=job.lr)
        dp_rank = hand.mesh.get_local_rank("dp")
        losses = []
        for tokens, labels in batches:
            value = hand.step(tokens.chunk(dp)[dp_rank], labels.chunk(dp)[dp_rank])
            t = torch.tensor([value if value is not None else 0.0, float(value is not None)], dtype=torch.float64)
            dist.all_reduce(t)  # ranks without the last stage report nothing
            losses.append(float(t[0] / t[1]))
        out[label] = losses
    return out


def test_hand_tuned_baseline_matches_single_process():
    job = TrainJob(model=LLAMA, configs=(), steps=3, global_batch=8)
    ref_losses, _ = reference_run(job)
    per_rank = spawn(_worker, 4, (job, CONFIGS))
    for label in CONFIGS:
        for r in per_rank:
            assert r[label] == per_rank[0][label], f"{label}: ranks disagree on the global loss"
        torch.testing.assert_close(torch.tensor(per_rank[0][label]), torch.tensor(ref_losses), rtol=1e-4, atol=0,
                                   msg=lambda m, label=label: f"{label}: {m}")
    assert ref_losses[-1] < ref_losses[0]  # the reference itself learns
