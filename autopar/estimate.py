"""`Estimate`: what pricing one full configuration predicts (DESIGN.md JSON contract).

Where it sits: shared (autopar/), beside the plan types. The searches build one per
ranked candidate from the cost model's costs (so does `autopar price`, the search
restricted to one configuration), and
a Plan embeds the chosen plan's as `Plan.predicted` (autopar/plan.py), so one type carries
a prediction from pricing to the plan file. `autopar price --json` prints `to_json()`,
and each plan of `autopar search --json` carries the same keys.

Terms: `time_breakdown` maps a component to seconds per step (compute, recompute,
exposed communication by kind, bubble, optimizer); `memory_breakdown` maps a component
to bytes on the peak device (the pipeline stage with the largest total); `config` the
configuration priced, as (name, value) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.json_codec import JsonData, encode


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate(JsonData):
    step_time_s: float
    tokens_per_s: float
    """Whole job."""
    tokens_per_s_per_device: float
    model_tflops_per_device: float
    """Model FLOPs (forward+backward, no recompute credit) per device per second / 1e12."""
    mfu: float
    """model_tflops_per_device / dense peak of the dtype."""
    peak_memory_bytes: int
    fits: bool
    memory_limit_bytes: int
    time_breakdown: tuple[tuple[str, float], ...]
    memory_breakdown: tuple[tuple[str, float], ...]
    """Bytes (integers as the cost model writes them)."""
    config: tuple[tuple[str, Any], ...]
    """tp, pp, dp, zero, micro_batch, num_microbatches, schedule, interleave, recompute
    (+ attention, sequence_parallel)."""
    hardware_tflops_per_device: float = 0.0
    """Like model TFLOP/s but counting recomputed forward FLOPs (HFU convention)."""
    peak_stage: int = 0

    @property
    def over_memory_bytes(self) -> int:
        return max(0, self.peak_memory_bytes - self.memory_limit_bytes)

    def to_json(self) -> dict[str, Any]:
        """The fields (autopar/json_codec.py rules) plus the derived `over_memory_bytes`,
        which `autopar price --json` reports; a plan file stores the fields only."""
        return {**encode(self, Estimate), "over_memory_bytes": self.over_memory_bytes}


@dataclass(frozen=True, slots=True, kw_only=True)
class CommunicationTime(JsonData):
    """One row of a priced plan's communication per step (`autopar price`): what one
    collective kind on one mesh axis costs, split out of the `time_breakdown` row that
    charges it (solver/comm_time.py). The seconds are the solver's own charges, each the
    pricer's part of an edge's time (cost_model `ChargePart`), so the rows of one
    `part_of` add up to that row's communication."""

    kind: str
    """all_reduce, all_gather, reduce_scatter, all_to_all; send_recv (pipeline boundary
    messages); local_copy (gradients copied into their bucket, grouped gathers' shards
    packed and unpacked: memory traffic the communication charge includes, no collective)."""
    axis: str
    """The mesh axis ("dp", "tp"; "pp" for send_recv; "-" for local_copy)."""
    count: float
    """Calls per step (for a pipeline: the critical stage's, see solver/comm_time.py)."""
    bytes: float
    """Bytes per step as the collective records count them (cost_model `Collective`)."""
    time_s: float
    """Seconds per step charged for it."""
    part_of: str
    """The `time_breakdown` row whose seconds include these: "reshard_s" (one stage),
    "critical_stage_s" or "p2p_s" (a pipeline)."""
