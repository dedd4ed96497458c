"""ZeRO-3 / FSDP runtimes: how parameters are gathered and gradients reduced (one place).

Where it sits: benchmarks/baselines/analytic/, called by step.py once per priced configuration
with zero >= 3. Torch-free. Everything the step model assumes about a sharded-parameter
runtime is here; the presets are facts about the runtimes, never fitted to a run.

What a ZeRO-3 runtime does per layer and microbatch (ZeRO paper Sec 5.3 and 7.2.3):
all-gather the layer's parameters before its forward, again before its backward (they
were freed after the forward), and reduce-scatter its gradients after the backward: 3
collectives' worth of traffic, 1.5x plain data parallelism. Two properties of the
runtime decide what that costs:

- granularity: FSDP (PyTorch FSDP1 flat parameters, FSDP2 grouped per-module
  all-gathers) issues ONE collective per wrapped layer; DeepSpeed ZeRO-3 (2021, the
  SC'21 Table 2 runs) gathered and reduced each parameter TENSOR on its own. Every
  collective pays the ring latency (n - 1) alpha (collectives.py), so with thousands of
  data-parallel ranks a per-tensor runtime is latency-bound: 12 tensors per GPT layer,
  3 passes, n = 1536 and alpha = 10 us is ~0.55 s per layer, more than its compute.
- prefetch window: a collective issued ahead of use hides behind the previous layer's
  compute (up to Efficiency.overlap_efficiency: NCCL kernels share SMs and HBM); one
  issued on demand blocks it. FSDP prefetches the whole next layer (forward and
  backward prefetch). DeepSpeed ZeRO-3 prefetches at most `stage3_prefetch_bucket_size`
  parameters (default 5e7) ahead, so of a layer of P parameters only min(1, 5e7 / P)
  of its gather time can hide; a 175B GPT layer has 1.8e9 parameters (2.8% hideable).
  FSDP runs gradient reduce-scatters on a side stream, hidden behind the backward;
  DeepSpeed's `overlap_comm` (off by default) would do the same.
- per-rank work: a list-output all-gather copies each of the n pieces out with its own
  kernel (Efficiency.memory_overhead_s each): n x 3 us, 4.6 ms per collective at n = 1536.
- recompute: a runtime whose module hooks free parameters after every forward gathers
  them again for the activation recompute inside the backward (4 collectives per
  tensor per microbatch instead of 3); FSDP keeps them from the pre-backward unshard.

Math per layer and microbatch, n = data-parallel ranks, P = the layer's parameters on one
tp rank, k = collectives per pass (parameter tensors, or 1), w = hideable share:
    G   = k * (all_gather(2 P / k) + [per-rank copies] n * memory_overhead_s)
    R   = k * reduce_scatter(grad_bytes * P / k)
    g   = 1 + [regather] recomputed share of the layer
    fwd = G - OVERLAP * min(w G, forward compute)
    bwd = g G + R - OVERLAP * min(g w G + [overlapped] R, backward + recompute compute)
where OVERLAP = Efficiency.overlap_efficiency: the share of the communication time that
runs under compute which is really hidden (the rest is the slowdown both suffer from
sharing SMs and HBM bandwidth).
The first layer's gather of every microbatch has nothing to hide behind (step.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_model.collectives import AxisLink, all_gather_time_s, reduce_scatter_time_s
from cost_model.efficiency import DEFAULT_EFFICIENCY, Efficiency


@dataclass(frozen=True, slots=True, kw_only=True)
class Zero3Runtime:
    name: str
    per_tensor_collectives: bool
    """True: one collective per parameter tensor (DeepSpeed ZeRO-3); False: one per layer."""
    prefetch_params: float
    """Parameters that may be gathered ahead of use; math.inf = the whole next layer."""
    grad_reduce_bytes: int = 2
    """Bytes per gradient element in the reduce-scatter (16-bit reduce in both presets)."""
    regather_for_recompute: bool = False
    """True: a recomputed layer gathers its parameters once more (module-hook runtimes
    release them after every forward, including the recompute inside the backward)."""
    overlap_grad_reduce: bool = True
    """False: gradient reduce-scatters block the backward."""
    per_rank_copies: bool = False
    """True: each all-gather writes a list of n per-rank outputs (torch.distributed.all_gather
    with a tensor list), i.e. n copy kernels of memory_overhead_s each after the NCCL call."""

    def __post_init__(self) -> None:
        if self.prefetch_params < 0 or self.grad_reduce_bytes not in (2, 4):
            raise ValueError(f"Zero3Runtime {self.name!r}: prefetch_params must be >= 0 and grad_reduce_bytes "
                             f"2 or 4, got {self.prefetch_params} and {self.grad_reduce_bytes}")


FSDP = Zero3Runtime(name="fsdp", per_tensor_collectives=False, prefetch_params=math.inf)
"""PyTorch FSDP / FSDP2 (torchtitan, llm-foundry): per-layer collectives, next layer prefetched."""

DEEPSPEED_2021 = Zero3Runtime(name="deepspeed-2021", per_tensor_collectives=True, prefetch_params=5e7,
                              regather_for_recompute=True, overlap_grad_reduce=False, per_rank_copies=True)
"""DeepSpeed ZeRO-3 as released in 2021 (v0.3-0.5) with its default config: per-tensor
collectives; prefetch bounded by `stage3_prefetch_bucket_size` = 5e7 parameters; module
hooks that release parameters after every forward, so activation recompute gathers
again; `overlap_comm` off by default, so gradient reduction blocks the backward; and
list-output `torch.distributed.all_gather` (before `_all_gather_base`), which copies
the n per-rank pieces out one kernel each."""

ZERO3_RUNTIMES: dict[str, Zero3Runtime] = {r.name: r for r in (FSDP, DEEPSPEED_2021)}


def zero3_runtime(value: str | Zero3Runtime) -> Zero3Runtime:
    if isinstance(value, Zero3Runtime):
        return value
    if value not in ZERO3_RUNTIMES:
        raise ValueError(f"unknown ZeRO-3 runtime {value!r}; known: {', '.join(ZERO3_RUNTIMES)}")
    return ZERO3_RUNTIMES[value]


@dataclass(frozen=True, slots=True, kw_only=True)
class Zero3LayerTimes:
    gather_s: float
    """One pass's parameter all-gathers for the layer (what the first layer exposes)."""
    forward_exposed_s: float
    backward_exposed_s: float


def zero3_layer_times(runtime: Zero3Runtime, *, layer_params: float, param_tensors: float, link: AxisLink,
                      forward_s: float, backward_s: float, weight_bytes: int,
                      recompute_share: float = 0.0, comm_overlap: float = 1.0,
                      efficiency: Efficiency = DEFAULT_EFFICIENCY) -> Zero3LayerTimes:
    """Exposed ZeRO-3 communication per layer and microbatch (module docstring)."""
    if link.size <= 1 or layer_params <= 0:
        return Zero3LayerTimes(gather_s=0.0, forward_exposed_s=0.0, backward_exposed_s=0.0)
    k = max(1.0, param_tensors) if runtime.per_tensor_collectives else 1.0
    gather = k * all_gather_time_s(layer_params * weight_bytes / k, link)
    if runtime.per_rank_copies:
        gather += k * link.size * efficiency.memory_overhead_s
    scatter = k * reduce_scatter_time_s(layer_params * runtime.grad_reduce_bytes / k, link)
    hideable = min(1.0, runtime.prefetch_params / layer_params)
    bwd_gathers = 1.0 + (recompute_share if runtime.regather_for_recompute else 0.0)
    hidden_scatter = scatter if runtime.overlap_grad_reduce else 0.0
    overlap = efficiency.overlap_efficiency * comm_overlap  # comm_overlap: the hardware's share (cluster.Hardware)
    fwd = gather - overlap * min(hideable * gather, forward_s)
    bwd = bwd_gathers * gather + scatter - overlap * min(bwd_gathers * hideable * gather + hidden_scatter,
                                                         backward_s)
    return Zero3LayerTimes(gather_s=gather, forward_exposed_s=fwd, backward_exposed_s=bwd)
