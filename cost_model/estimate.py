"""`Estimate`: what pricing one full configuration predicts (DESIGN.md JSON contract).

Where it sits: returned by `cost_model.price` / `price_profile`; `autopar price --json`
prints `to_json()`, and each plan of `autopar search --json` carries the same keys.

Terms: `time_breakdown` maps a component to seconds per step (compute, recompute,
exposed communication by kind, bubble, optimizer); `memory_breakdown` maps a component
to bytes on the peak device (the pipeline stage with the largest total).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
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
    memory_breakdown: tuple[tuple[str, int], ...]
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
        return {
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "model_tflops_per_device": self.model_tflops_per_device,
            "hardware_tflops_per_device": self.hardware_tflops_per_device,
            "mfu": self.mfu,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_limit_bytes": self.memory_limit_bytes,
            "over_memory_bytes": self.over_memory_bytes,
            "fits": self.fits,
            "peak_stage": self.peak_stage,
            "time_breakdown": dict(self.time_breakdown),
            "memory_breakdown": dict(self.memory_breakdown),
            "config": dict(self.config),
        }
