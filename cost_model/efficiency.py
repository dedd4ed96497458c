"""Every achievable-efficiency factor of the cost model, in one place.

Where it sits: read by cost_model/compute.py (op roofline), cost_model/collectives.py
(bus bandwidths) and cost_model/step.py (overlap, optimizer). Hardware peaks live in
autopar/cluster.py; this module says how much of a peak real kernels reach. These are
GLOBAL constants from public measurements, never fitted per validation row.

Terms: a *peak* is the datasheet rate; *efficiency* is achieved / peak for large,
well-shaped work; a *fixed overhead* is the per-kernel (or per-collective-step) time a
small launch pays regardless of size, which is what makes small ops less efficient:
time = work / (peak * efficiency) + overhead, so efficiency(work) saturates with size.
"""

from __future__ import annotations

# --- compute ---------------------------------------------------------------------------

GEMM_EFFICIENCY = 0.75
"""Large bf16 GEMMs in training reach ~70-80% of dense tensor peak on A100/H100 (cuBLAS
training shapes; the best published end-to-end MFU without recompute is ~64%, MPT-7B)."""

GEMM_OVERHEAD_S = 6e-6
"""Per-GEMM fixed time (launch, wave-quantisation tail): makes a 1 GFLOP A100 GEMM ~60%
efficient and a 100 GFLOP one ~80%."""

GEMM_MEMORY_OVERLAP = 0.0
"""Share of a GEMM's operand traffic (as the op-by-op graph counts it) hidden behind its
math: 0 = additive. Thin GEMMs (hidden 768-2048) sit near the A100 ridge point (~150
FLOP/byte) and lose efficiency; a pure max() roofline would call them compute-bound."""

FLASH_ATTENTION_EFFICIENCY = 0.30
"""Fused attention forward+backward as training stacks run it, on the causal work (half
the square): kernels reach 50-70% forward but 30-45% backward (FlashAttention-2 paper,
A100), and the backward is 2/3 of the work; ALiBi/triton variants and GQA head repeats
cost more. Long-sequence llm-foundry runs (attention > 90% of FLOPs) report ~53% MFU in
full-square counting, i.e. ~27% on the causal work."""

CAUSAL_WORK_FRACTION = 0.5
"""A fused causal kernel skips the masked half of the s x s tiles; the traced FLOP count
(and the MFU conventions of the sources) count the full square."""

MEMORY_EFFICIENCY = 0.75
"""Bandwidth-bound kernels reach ~70-80% of HBM peak (STREAM-like copies on A100/H100)."""

MEMORY_OVERHEAD_S = 3e-6
"""Per memory-bound kernel fixed time."""

POINTWISE_FUSION_FACTOR = 1.0
"""Fraction of the traced (one-kernel-per-ATen-op) pointwise bytes a stack moves. The
published eager stacks (llm-foundry, torchtitan without compile, Megatron with dropout
on top of its fused kernels) move about what the op-by-op graph says; a torch.compile'd
runtime would be nearer 0.5."""

MATH_ATTENTION_PASSES = 10.0
"""Unfused attention (`--attention math`): memory passes over the b*a*s*s score tensor
per training step beyond the two batched GEMMs: forward write scores, scale+mask+softmax
read/write (fused softmax kernel), read for the value GEMM (4), backward read probs,
write/read grad-probs, softmax-backward read/write, write grad-scores (6). Dropout on the
scores (GPT-3 era) would add 3 more; our models have none."""

# --- communication ---------------------------------------------------------------------

NVLINK_BUS_EFFICIENCY: dict[str, float] = {
    # nccl-tests busBW / line rate per direction. A100: ~230 of 300 GB/s at 8 GB messages,
    # ~200 at <= 1 GB (NVIDIA/nccl-tests#149, #178). H100: ~370 of 450 GB/s (ring; NVLS
    # all-reduce can reach 480 busBW at > 256 MB, not assumed) (nccl-tests#212).
    "a100-40gb": 0.70, "a100-80gb": 0.70, "h100": 0.82, "h200": 0.82, "b200": 0.82,
}
NVLINK_BUS_EFFICIENCY_DEFAULT = 0.75
NIC_BUS_EFFICIENCY = 0.96
"""ConnectX-7 NDR: 48-49 of 50 GB/s (nccl-tests#267); 8x HDR: 192 of 200 GB/s (nccl#812)."""

# --- overlap and optimizer -------------------------------------------------------------

OVERLAP_EFFICIENCY = 0.8
"""Share of compute time that can hide concurrent communication: NCCL kernels take SMs
and HBM bandwidth from compute, so overlap is never perfect (FSDP/DDP profiles)."""

OPTIMIZER_BYTES_PER_PARAM = 36
"""Fused AdamW step, mixed precision: read+write fp32 master, m, v (24), read the
gradient (4, fp32 after unscale), write the 16-bit weight (2), plus grad-norm read (4)
and zeroing (2). Memory-bound at MEMORY_EFFICIENCY."""

TP_COMM_OVERLAP = 0.0
"""Tensor-parallel collectives sit on the critical path (Megatron SC'21; plain DTensor TP).
Async-TP would raise this; not assumed."""
