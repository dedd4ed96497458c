"""Per-device memory of one pipeline stage: model state, activations, temporaries.

Where it sits: benchmarks/baselines/analytic/ (the closed-form baseline), called by step.py for
every stage; torch-free. The model-state bytes per parameter are the product's
(cost_model/memory.py).

Math (psi = parameters held by the stage on one tp rank, N = dp degree; mixed-precision
AdamW, 16 bytes/param = 2 weight + 2 grad + 12 fp32 master/momentum/variance; ZeRO
paper Sec 3.1 and 5):

    zero 0: 16 psi        zero 1: 4 psi + 12 psi/N
    zero 2: 2 psi + 14 psi/N        zero 3: 16 psi/N

Activations are the traced graph's saved values (profile.py), per microbatch:

    A_layer = r * (split / t + stream / (t if sequence parallel else 1))     r = b / b_traced

with `split`/`stream` the saved bytes for the recompute mode (none: all saved values;
selective: minus recomputable ones; full: the layer input only), plus, for math
attention without recompute, the softmax probabilities r * scores * dtype_bytes / t.
A stage of n layers holds A_layer * n * inflight microbatches, where inflight is
(pp = 1) 1, (gpipe) m, (1f1b) min(m, p - stage), (interleaved) the 1F1B count times
1 + (p - 1)/(p v) (Korthikanti Sec 4.2.3). Temporaries: the gradient workspace of one
layer (its saved activations again), one more layer of activations under full
recompute, the largest backward tensor of the stage's non-layer segments (logits grad),
and under ZeRO-3 two layers of gathered parameters (current + prefetch).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.config import ParallelConfig, microbatches_in_flight
from cost_model.memory import BYTES_WEIGHT, model_state_bytes
from .profile import GraphProfile, SegmentProfile


@dataclass(frozen=True, slots=True, kw_only=True)
class StageMemory:
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    temporary_bytes: float

    @property
    def total_bytes(self) -> float:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes
                + self.temporary_bytes)


def segment_activation_bytes(seg: SegmentProfile, config: ParallelConfig, ratio: float, dtype_bytes: int,
                             *, recompute: str | None = None) -> float:
    """Saved bytes per microbatch for one unit of a segment (one layer, or pre/post).
    `recompute` overrides config.recompute (pre/post segments are never recomputed)."""
    mode = config.recompute if recompute is None else recompute
    t = config.tp
    stream_div = t if config.sequence_parallel else 1
    if mode == "full":
        return ratio * seg.input_bytes / stream_div
    if mode == "selective":
        stream, split = seg.selective_stream_bytes, seg.selective_split_bytes
    else:
        stream, split = seg.saved_stream_bytes, seg.saved_split_bytes
    total = ratio * (split / t + stream / stream_div)
    if config.attention == "math" and mode == "none":
        total += ratio * seg.score_elems * dtype_bytes / t
    return total


def inflight_microbatches(config: ParallelConfig, stage: int, num_microbatches: int) -> float:
    # the count has one home (autopar/config.py), shared with solver/stage_dp.py
    return microbatches_in_flight(config.schedule, config.pp, config.interleave, stage, num_microbatches)


def stage_params(profile: GraphProfile, config: ParallelConfig, layers: int, first: bool, last: bool) -> float:
    """Parameters one tp rank of the stage holds."""
    t = config.tp
    params = layers * (profile.layer.params_split / t + profile.layer.params_replicated)
    if first:
        params += profile.pre.params_split / t + profile.pre.params_replicated
    if last:
        params += profile.post.params_split / t + profile.post.params_replicated
    if first and last:
        params -= profile.tied_params / t
    return params


def stage_memory(profile: GraphProfile, config: ParallelConfig, *, stage: int, layers: int,
                 num_microbatches: int, checkpoint_every: int = 1) -> StageMemory:
    first, last = stage == 0, stage == config.pp - 1
    psi = stage_params(profile, config, layers, first, last)
    weights, grads, optimizer = model_state_bytes(psi, config.zero, config.dp)
    ratio = config.micro_batch / profile.batch
    db = profile.dtype_bytes
    per_layer = segment_activation_bytes(profile.layer, config, ratio, db)
    if config.recompute == "full" and checkpoint_every > 1:  # 1 in k layers checkpointed, the rest keep all
        kept = segment_activation_bytes(profile.layer, config, ratio, db, recompute="none")
        per_layer = (per_layer + (checkpoint_every - 1) * kept) / checkpoint_every
    inflight = inflight_microbatches(config, stage, num_microbatches)
    acts = per_layer * layers * inflight
    # a stage holds 1f1b's in-flight count for its own segments too
    if first:
        acts += segment_activation_bytes(profile.pre, config, ratio, db, recompute="none") * inflight
    if last:
        acts += segment_activation_bytes(profile.post, config, ratio, db, recompute="none") * inflight
    full_layer = segment_activation_bytes(profile.layer, config, ratio, db, recompute="none")
    temp = full_layer  # gradient workspace of the layer in backward
    if config.recompute == "full":
        temp += full_layer  # the recomputed layer's activations
    segs = ([profile.pre] if first else []) + ([profile.post] if last else [])
    temp += max((s.largest_backward_bytes * ratio / config.tp for s in segs), default=0.0)
    if config.zero >= 3:
        temp += 2 * BYTES_WEIGHT * (profile.layer.params_split / config.tp + profile.layer.params_replicated)
    return StageMemory(params_bytes=weights, grads_bytes=grads, optimizer_bytes=optimizer,
                       activations_bytes=acts, temporary_bytes=temp)
