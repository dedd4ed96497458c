"""Buckets: which gradient reductions, and which parameter gathers, travel in one collective.

Where it sits: shared by the pricing of a plan (solver/intra_op/ilp.py reports the bucketed
collectives; cost_model/table.py prices a gradient's share of a bucket's latency) and the
program (codegen/apply.py flattens each bucket into one all-reduce or reduce-scatter),
so both count the same collectives. Torch-free.

A gradient is bucketable when bringing it to its parameter's placement is one collective
on one mesh axis: an all-reduce (pending sum -> replicated) or a reduce-scatter (pending
sum -> shard). Buckets group gradients of the same (kind, axis, reduce op, dtype) in
graph order. All-reduces fill buckets of up to BUCKET_BYTES (DDP's default bucket size,
25 MiB). Reduce-scatters go by layer (`gradient_bucket_key`), one collective per layer
whatever its size, as FSDP reduce-scatters a unit's flat gradient in one call: capping a
layer's bucket at 25 MiB split a large model's layers into one reduce-scatter per weight,
and each call pays the ring's (n-1) step latencies (on 512 ranks about 2.4 ms: 290 calls
a step for a 3B model, against FSDP's 33). Any other gradient reshards on its own.
"""

from __future__ import annotations

import math
from typing import Hashable, NamedTuple, Sequence

BUCKET_BYTES = 25 * 2**20
"""Largest bucket (torch DDP's `bucket_cap_mb` default)."""


def plan_buckets(items: Sequence[tuple[Hashable | None, int]], cap_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Group `items` [(bucket key or None if not bucketable, bytes), ...] into buckets of
    item indices: same key, in order, a new bucket when the next item would pass
    `cap_bytes` (an item larger than the cap gets its own; a `LayerBucket` key has no cap);
    unbucketable items alone."""
    open_: dict[Hashable, tuple[list[int], int]] = {}
    buckets: list[list[int]] = []
    for i, (key, nbytes) in enumerate(items):
        if key is None:
            buckets.append([i])
            continue
        current = open_.get(key)
        cap = math.inf if isinstance(key, LayerBucket) else cap_bytes
        if current is not None and current[1] + nbytes <= cap:
            current[0].append(i)
            open_[key] = (current[0], current[1] + nbytes)
            continue
        bucket = [i]
        buckets.append(bucket)
        open_[key] = (bucket, nbytes)
    return buckets


class LayerBucket(NamedTuple):
    """The bucket key of a layer's reduce-scatters: one bucket per layer, uncapped."""

    key: tuple
    layer: int


def gradient_bucket_key(key: tuple | None, layer: int | None) -> tuple | None:
    """The bucket key of a gradient whose reduction has bucket key `key` ((steps, dtype),
    steps ((kind, axis, reduce op), ...)) and which belongs to layer `layer`:
    reduce-scatters are bucketed per layer, as FSDP reduce-scatters each unit's gradients
    (a layer's full-size gradients are freed once it is reduced, not held for the whole
    backward), in one collective however large the layer (`LayerBucket`). Those outside
    the layer stack (embedding, head: at the two ends of the backward) keep DDP's cap, so
    a large head's gradient is not held until the embedding's is computed. All-reduces by
    DDP's rule alone (the reduced gradients are kept whole anyway)."""
    if key is None or key[0][0][0] != "reduce_scatter":
        return key
    return (key, None) if layer is None else LayerBucket(key, layer)


# ---- parameter gathers ------------------------------------------------------------------

def gather_group(layer: int | None, phase: str, axis: int, dtype: str) -> tuple:
    """The group a parameter's all-gather belongs to: parameters sharded on `axis` and
    gathered for consumers in the same layer (None: outside the layer stack) and phase
    (forward or backward) travel in one flat all-gather, issued where the group's first
    consumer runs (as FSDP gathers a unit's parameters before its forward and again before
    its backward). A parameter consumed twice in one group is gathered once."""
    return (layer, phase, axis, dtype)


UPDATE_PHASE = "update"
"""The `gather_group` phase of the weights gathered from their update placement once per
step (weight-update sharding): a layer's updated weights travel in one all-gather."""


def gather_share(param_bytes: float, group_bytes: float) -> float:
    """A parameter's share of its group's collective latency (the pricing charges each
    member that share, so the group pays one latency)."""
    return min(1.0, param_bytes / group_bytes) if group_bytes > 0 else 1.0
