"""Runtime options: what the training stack does where ParallelConfig leaves it open.

Where it sits: an optional argument of the baseline's `analytic.price_profile`. A published run's software stack is described by these explicit options
(benchmarks/data/published_runs.csv carries them per row in `price_options`), never by
matching the name of its source. Defaults describe autopar's own runtime.

Fields (each a documented property of a runtime, not a fitted number):
- zero3: the sharded-parameter runtime under zero 3 ("fsdp": PyTorch FSDP/FSDP2, one
  collective per layer with the next layer prefetched; "deepspeed-2021": DeepSpeed ZeRO-3
  of 2021, per-tensor collectives, bounded prefetch; analytic/zero3.py).
- checkpoint_every: with recompute "full", checkpoint only every k-th layer (torchtitan's
  per-layer selective AC `selective_ac_option = k`); the other layers keep everything.
- selective_policy: with recompute "selective", "pointwise" (re-run norms and activation
  functions: Korthikanti et al.'s selective recompute in spirit) or "alternate-mm"
  (torchtitan's per-op policy: also every second matmul of a layer).
- grad_reduce_bytes: bytes per gradient element in the data-parallel reduction (2: bf16/
  fp16 reduce; 4: fp32 reduce, e.g. FSDP MixedPrecision(reduce_dtype=float32), Composer's
  'DEFAULT' mixed precision, torchtitan's mixed_precision_reduce = float32).
- compiled: the step runs under torch.compile (memory-bound ops fused by inductor; their
  traffic and launches scale by Efficiency.compiled_memory_factor).
- async_tp: torchtitan's async tensor parallelism (collectives micro-pipelined with the
  matmuls; Efficiency.async_tp_overlap of them hidden).
- dp_bucket_bytes: gradient bucket size of the zero 0-1 all-reduce (PyTorch DDP's
  bucket_cap_mb = 25 MiB); every bucket pays the collective latencies.
- dtensor_tp: tensor-parallel layers run their ops on DTensors (autopar's module-level
  runtime, torch's `parallelize_module`): each op pays Efficiency.dtensor_op_overhead_s
  (measured on CPU; 0 on GPUs). False for a runtime that runs plain local tensors with
  explicit collectives (a per-op compiled program, Megatron).
- overlap_grad_reduce: the data-parallel gradient reduction (zero 0-2) starts during the
  last microbatch's backward (PyTorch DDP/FSDP buckets, Megatron-Core's
  --overlap-grad-reduce). False for runtimes that reduce after the whole backward or
  pipeline flush: Megatron-LM of SC'21 (all-reduce after the pipeline flush) and
  DeepSpeed's pipeline engine (its ReduceGrads step ends the schedule).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

SELECTIVE_POLICIES = ("pointwise", "alternate-mm")
ZERO3_RUNTIME_NAMES = ("fsdp", "deepspeed-2021")


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeOptions:
    zero3: str = "fsdp"
    checkpoint_every: int = 1
    selective_policy: str = "pointwise"
    grad_reduce_bytes: int = 2
    compiled: bool = False
    async_tp: bool = False
    dp_bucket_bytes: float = 25 * 2**20
    overlap_grad_reduce: bool = True
    dtensor_tp: bool = True

    def __post_init__(self) -> None:
        if self.zero3 not in ZERO3_RUNTIME_NAMES:
            raise ValueError(f"unknown ZeRO-3 runtime {self.zero3!r}; known: {', '.join(ZERO3_RUNTIME_NAMES)}")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be a positive integer (checkpoint every k-th layer), "
                             f"got {self.checkpoint_every!r}")
        if self.selective_policy not in SELECTIVE_POLICIES:
            raise ValueError(f"unknown selective_policy {self.selective_policy!r}; known: "
                             f"{', '.join(SELECTIVE_POLICIES)}")
        if self.grad_reduce_bytes not in (2, 4):
            raise ValueError(f"grad_reduce_bytes must be 2 (bf16/fp16 reduce) or 4 (fp32 reduce), "
                             f"got {self.grad_reduce_bytes!r}")
        if not self.dp_bucket_bytes > 0:
            raise ValueError(f"dp_bucket_bytes must be positive, got {self.dp_bucket_bytes!r}")

    @classmethod
    def from_pairs(cls, pairs: dict[str, Any]) -> "RuntimeOptions":
        """From text values ("compiled": "1", "checkpoint_every": "2", ...); ValueError names
        unknown keys."""
        known = {f.name: f for f in fields(cls)}
        unknown = set(pairs) - set(known)
        if unknown:
            raise ValueError(f"unknown runtime options {sorted(unknown)}; known: {sorted(known)}")
        values: dict[str, Any] = {}
        for key, raw in pairs.items():
            kind = type(getattr(cls(), key))
            if kind is bool:
                values[key] = str(raw).strip().lower() in ("1", "true", "yes")
            else:
                values[key] = kind(raw) if kind is not int else int(float(raw))
        return cls(**values)

    def changed(self) -> dict[str, Any]:
        """The options that differ from the defaults (for reports)."""
        default = RuntimeOptions()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)}


__all__ = ["RuntimeOptions", "SELECTIVE_POLICIES", "ZERO3_RUNTIME_NAMES"]
