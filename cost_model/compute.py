"""Per-op compute time: a roofline with achievable efficiencies (cost_model/efficiency.py).

Where it sits: cost_model/, used per IR node by the graph profile and by the strategy
pricer (a sharded op is priced with its local FLOPs and bytes). Torch-free.

Math, for an op of `flops` tensor-core FLOPs moving `bytes_moved` bytes, with
E = efficiency_for(hardware) (the cost model's constants, the hardware's overrides):

    t_memory  = bytes_moved / (HBM bandwidth * E.memory_efficiency)
    memory    t = t_memory + E.memory_overhead_s
    attention t = max(work / (peak * attention_fraction * E.flash_attention_efficiency), t_memory)
                  + E.gemm_overhead_s  (attention_fraction: the GPU's best fused-attention rate)
                  (work = E.causal_work_fraction of the counted FLOPs when causal)
    gemm      t = max(t_flops, t_gemm_mem) + min(t_flops, t_gemm_mem) + E.gemm_overhead_s
              (t_gemm_mem = t_memory / E.gemm_memory_efficiency: 1 on GPUs; on the cpu
              profile a step's GEMMs move their bytes slower than a copy, fitted on the sweep)

GEMM shape (`gemm_time_s`, when the local shape B x (M x K) @ (K x N) is known): the
achievable rate is peak * matmul_fraction (the hardware's best-shape rate) *
E.gemm_efficiency, times two shape factors (NVIDIA Matrix Multiplication Background
User's Guide, Sec 3: tile and wave quantization):
    tiles   = B * ceil(M / T) * ceil(N / T)               T = E.gemm_tile
    split   = min(SMs // tiles, K // E.split_k_min) when tiles < SMs, else 1  (split-K)
    wave    = tiles * split / (ceil(tiles * split / SMs) * SMs)   (last wave partly idle;
              padded edge tiles count as whole tiles: tile quantization)
    k_eff   = (K / split) / (K / split + E.gemm_k_ramp)  (per-tile prologue/epilogue)
    t_flops = 2 B M N K / (rate * wave * k_eff)
so thin GEMMs (small micro-batch in the weight gradient, large tp, small hidden) cost more
per FLOP than the fat ones of the same layer. Hardware without SMs (the cpu profile) skips
the wave term. A GEMM's operand traffic near the ridge point is only partly hidden behind
its math, hence the additive min() term.
"""

from __future__ import annotations

import math

from autopar.cluster import Hardware
from cost_model.efficiency import Efficiency, efficiency_for

OP_CLASSES = ("gemm", "attention", "memory")


def gemm_shape_efficiency(b: float, m: float, n: float, k: float, hardware: Hardware, eff: Efficiency) -> float:
    """wave * k_eff of the module docstring (1.0 for an empty GEMM)."""
    if min(b, m, n, k) <= 0:
        return 1.0
    split = 1.0
    wave = 1.0
    sms = hardware.sm_count
    if sms:
        tiles = max(1.0, math.ceil(b) * math.ceil(m / eff.gemm_tile) * math.ceil(n / eff.gemm_tile))
        if tiles < sms:
            split = float(max(1, min(int(sms // tiles), int(k // eff.split_k_min))))
        work = tiles * split
        padded = (m * n) / (math.ceil(m / eff.gemm_tile) * math.ceil(n / eff.gemm_tile) * eff.gemm_tile ** 2)
        wave = work / (math.ceil(work / sms) * sms) * padded
    chunk = k / split
    return wave * chunk / (chunk + eff.gemm_k_ramp)


def gemm_time_s(b: float, m: float, n: float, k: float, bytes_moved: float, hardware: Hardware, dtype: str,
                efficiency: Efficiency | None = None) -> float:
    """Time of one (batched) GEMM of local shape b x (m x k) @ (k x n); see the module docstring."""
    eff = efficiency_for(hardware, efficiency)
    flops = 2.0 * b * m * n * k
    if flops <= 0 and bytes_moved <= 0:
        return 0.0
    rate = hardware.peak_flops(dtype) * hardware.matmul_fraction * eff.gemm_efficiency
    t_flops = flops / (rate * gemm_shape_efficiency(b, m, n, k, hardware, eff))
    t_mem = bytes_moved / (hardware.memory_bandwidth_bytes_per_s * eff.memory_efficiency * eff.gemm_memory_efficiency)
    return max(t_flops, t_mem) + min(t_flops, t_mem) + eff.gemm_overhead_s


def compute_time_s(flops: float, bytes_moved: float, hardware: Hardware, dtype: str, *,
                   op_class: str | None = None, causal: bool = False,
                   efficiency: Efficiency | None = None) -> float:
    """Roofline time of one op on one device; `op_class` defaults to gemm if flops > 0.
    A GEMM of unknown shape is priced as a large, well-shaped one (shape factor 1)."""
    if flops <= 0 and bytes_moved <= 0:
        return 0.0
    eff = efficiency_for(hardware, efficiency)
    cls = op_class or ("gemm" if flops > 0 else "memory")
    t_mem = bytes_moved / (hardware.memory_bandwidth_bytes_per_s * eff.memory_efficiency)
    if cls == "memory" or flops <= 0:
        return t_mem + eff.memory_overhead_s
    peak = hardware.peak_flops(dtype)
    if cls == "attention":
        work = flops * (eff.causal_work_fraction if causal else 1.0)
        rate = peak * hardware.attention_fraction * eff.flash_attention_efficiency
        return max(work / rate, t_mem) + eff.gemm_overhead_s
    if cls != "gemm":
        raise ValueError(f"unknown op class {cls!r}; expected one of {', '.join(OP_CLASSES)}")
    t_flops = flops / (peak * hardware.matmul_fraction * eff.gemm_efficiency)
    t_mem /= eff.gemm_memory_efficiency
    return max(t_flops, t_mem) + min(t_flops, t_mem) + eff.gemm_overhead_s


__all__ = ["OP_CLASSES", "compute_time_s", "gemm_shape_efficiency", "gemm_time_s", "grad_accumulation_time_s",
           "optimizer_time_s"]


def optimizer_time_s(local_parameters: float, hardware: Hardware, efficiency: Efficiency | None = None, *,
                     tensors: float = 0.0) -> float:
    """The optimizer step over `local_parameters` elements in `tensors` local parameter
    tensors: a memory-bound pass moving Efficiency.optimizer_bytes_per_param bytes per
    element at achievable HBM bandwidth, plus Efficiency.optimizer_tensor_overhead_s per
    tensor (the host's per-tensor epilogue; 0 on GPUs)."""
    eff = efficiency_for(hardware, efficiency)
    return local_parameters * eff.optimizer_bytes_per_param / (hardware.memory_bandwidth_bytes_per_s * eff.memory_efficiency) \
        + tensors * eff.optimizer_tensor_overhead_s


def grad_accumulation_time_s(gradient_elements: float, num_microbatches: int, element_bytes: int,
                             hardware: Hardware, efficiency: Efficiency | None = None) -> float:
    """Accumulating the microbatches' gradients of one step, a memory-bound term of its own:
        (m - 1) * elements * element_bytes * accumulate_bytes_per_byte (3: read both,
        write one) / (HBM bandwidth * memory_efficiency)
    The first microbatch's backward writes the gradients; every later one adds into them
    (read both, write one): autograd accumulates into `.grad` across backward calls (PyTorch
    autograd docs: gradients "will be accumulated"), Megatron-LM's per-parameter hook adds
    each microbatch's grad into `main_grad`, FSDP adds each reduce-scattered shard into the
    sharded gradient, and autopar's per-op program adds each microbatch's raw gradients.
    `gradient_elements`: the gradient elements one rank accumulates (its whole local
    replica, or its shard when the gradients are reduce-scattered every microbatch)."""
    if num_microbatches <= 1 or gradient_elements <= 0:
        return 0.0
    eff = efficiency_for(hardware, efficiency)
    moved = (num_microbatches - 1) * gradient_elements * element_bytes * eff.accumulate_bytes_per_byte
    return moved / (hardware.memory_bandwidth_bytes_per_s * eff.memory_efficiency)
