"""Precision policy: the dtypes a plan computes, keeps and reduces in, priced and run.

Where it sits: shared data. `ParallelConfig.precision` / `.reduce_dtype` name
a policy; the tracer traces the step in its compute dtype and records the policy on the
graph (`ModelInfo.master_dtype`, `.reduce_dtype`), the cost model charges its bytes
(cost_model/memory.py `parameter_state_bytes`, the gradient sync's bytes), and the
per-op program runs it (autopar/runtime/spmd.py).

A policy has four dtypes:
- compute: the dtype of the traced step, every activation, and the weight copies the step
  reads (held in each parameter's compute placement);
- master: the weights the optimizer updates (held in each parameter's weight-update
  placement: what `named_parameters()` and checkpoints hold);
- optimizer state: the master dtype (stock `torch.optim` keeps its moments in the
  parameter's dtype);
- reduce: the dtype gradients are accumulated over microbatches and reduced in
  (all-reduce / reduce-scatter); the reduced gradient is cast to the master dtype for the
  optimizer.

Named policies:
- `fp32`: everything float32 (one copy of each weight where its compute and update
  placements agree). The `cpu` profile's default.
- `bf16-mixed`: compute bfloat16, master, optimizer state and reduction float32, as
  Megatron-LM runs bf16 (its bf16 path forces fp32 gradient accumulation and all-reduce,
  `accumulate_allreduce_grads_in_fp32`; its distributed-optimizer table counts 6 + 12/d bytes
  per parameter: bf16 weight, fp32 gradient, fp32 master and Adam moments sharded over d)
  and torchtitan's FSDP default (`mixed_precision_param = bfloat16`,
  `mixed_precision_reduce = float32`). The GPU profiles' default.
- `bf16`: everything bfloat16 (optimizer moments too); reduction float32 unless
  `reduce_dtype` says otherwise.

`reduce_dtype` overrides a policy's reduction dtype (`bfloat16` halves the gradient
sync's bytes). float16 is not offered: it needs a loss scaler, and bfloat16 has float32's
exponent range, so no scaler is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autopar.units import DTYPE_BYTES

POLICIES: tuple[str, ...] = ("fp32", "bf16-mixed", "bf16")
REDUCE_DTYPES: tuple[str, ...] = ("float32", "bfloat16")

_COMPUTE = {"fp32": "float32", "bf16-mixed": "bfloat16", "bf16": "bfloat16"}
_MASTER = {"fp32": "float32", "bf16-mixed": "float32", "bf16": "bfloat16"}

ADAM_MOMENTS = 2
"""Optimizer state tensors per parameter of the default optimizer (AdamW: first and
second moment), each the size and dtype of its master weight."""


@dataclass(frozen=True, slots=True)
class Precision:
    compute: str
    master: str
    reduce: str

    @property
    def name(self) -> str:
        """The policy's name, with its reduction dtype where it is not the default float32."""
        base = next(n for n in POLICIES if _COMPUTE[n] == self.compute and _MASTER[n] == self.master)
        return base if self.reduce == "float32" else f"{base} (reduce {self.reduce})"

    @property
    def mixed(self) -> bool:
        """Whether the step reads weight copies in another dtype than the master weights."""
        return self.compute != self.master

    def bytes(self, which: str) -> int:
        """Bytes per element of the `compute`, `master` or `reduce` dtype."""
        return DTYPE_BYTES.get(getattr(self, which), 4)

    def raw_gradient_bytes(self, numel: float, split: float) -> float:
        """Bytes per device of a raw gradient of `numel` elements accumulated over a step's
        microbatches in the reduction dtype, its placement splitting it `split` ways."""
        return self.bytes("reduce") * numel / split

    def state_bytes(self, numel: float, computed: float, updated: float, *,
                    grads_at_update: bool = False) -> tuple[float, float, float]:
        """(weights, gradients, optimizer state) bytes per device of one parameter of
        `numel` elements whose compute placement splits it `computed` ways and whose
        weight-update placement `updated` ways: what the per-op program holds
        (autopar/runtime/spmd.py; its StepStats measure the same parts) and the cost model
        charges (cost_model/memory.py `parameter_state_bytes`).

        - weights: the master weight in the update placement (master bytes / updated), plus
          the compute copy the step reads (compute bytes / computed) where the program keeps
          one: where the policy computes in another dtype than the master's (bf16-mixed), or
          the update placement is split another way than the compute one (ZeRO-1/2: the
          gathered copy);
        - gradients: the gradient in the reduction dtype: in the update placement with
          `grads_at_update` (the step syncs it in its backward: one microbatch, or ZeRO-2,
          which accumulates the shards), else split as the compute placement is. The cost
          model charges an accumulated raw gradient at its gradient node's own placement
          instead (`raw_gradient_bytes`; cost_model/table.py), which this split only
          approximates: a pending sum over dp is whole whatever the weight's split;
        - optimizer state: AdamW's two moments in the master dtype, in the update placement.

        fp32 with both placements whole: 4 + 4 + 8 = 16 bytes per element. bf16-mixed:
        2 + 4 + 4 + 8 = 18, and 6 + 12/d with the update sharded over d (ZeRO-1), as
        Megatron-LM's distributed-optimizer table counts bf16 weights with fp32 gradients
        (docs/source/api-guide/dist_optimizer.md)."""
        master, compute = self.bytes("master"), self.bytes("compute")
        copy = self.mixed or computed != updated
        weights = master * numel / updated + (compute * numel / computed if copy else 0.0)
        grads = self.raw_gradient_bytes(numel, updated if grads_at_update else computed)
        return weights, grads, ADAM_MOMENTS * master * numel / updated


def policy(name: str, reduce_dtype: str = "") -> Precision:
    """The named policy, with `reduce_dtype` (float32 / bfloat16; "" for the default,
    float32) as its reduction dtype. ValueError names the choices."""
    if name not in POLICIES:
        raise ValueError(f"--precision must be one of {', '.join(POLICIES)}, got {name!r}")
    if reduce_dtype and reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"--reduce-dtype must be one of {', '.join(REDUCE_DTYPES)}, got {reduce_dtype!r}")
    return Precision(compute=_COMPUTE[name], master=_MASTER[name], reduce=reduce_dtype or "float32")


def cast_parameters(model: Any, dtype: str) -> None:
    """Cast `model`'s (an nn.Module) floating-point parameters to `dtype` in place: each
    parameter object stays (a pipeline's chunks share them; a caller holding the old data
    keeps it as master weights) and its data is replaced; works on fake tensors too.
    Buffers keep the dtype the model made them in, as FSDP2's mixed precision leaves them
    (`param_dtype` casts parameters only): a model that keeps rotary tables or running
    statistics in float32 computes with them in float32. The tracer casts a model so
    before tracing its step (autopar/trace/), the single-process reference its compute
    copy (autopar/runtime/jobs.py)."""
    target = getattr(torch, dtype)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != target:
            p.data = p.data.to(target)


def default_policy(hardware: str) -> str:
    """The policy a plan runs when none is given: `fp32` on the `cpu` profile (what its gloo
    ranks train in), `bf16-mixed` on accelerator profiles (what large models train in)."""
    return "fp32" if hardware.startswith("cpu") else "bf16-mixed"


def unrecorded_dtype(dtype: str) -> str:
    """The master and reduction dtype of a step traced in `dtype` whose graph records none:
    float32 (the default of both named policies of a float32 or bfloat16 trace); a float64
    trace keeps float64."""
    return dtype if dtype == "float64" else "float32"


def of_model(dtype: str, master_dtype: str = "", reduce_dtype: str = "") -> Precision:
    """The policy a traced graph runs under (its `ModelInfo` fields): the trace's dtype is the
    compute dtype; master and reduction dtypes as recorded, else `unrecorded_dtype`."""
    wide = unrecorded_dtype(dtype)
    return Precision(compute=dtype, master=master_dtype or wide, reduce=reduce_dtype or wide)
