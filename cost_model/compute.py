"""Per-op compute time: a roofline with achievable efficiencies (cost_model/efficiency.py).

Where it sits: cost_model/, used per IR node by the graph profile and by the strategy
pricer (a sharded op is priced with its local FLOPs and bytes). Torch-free.

Math, for an op of `flops` tensor-core FLOPs moving `bytes_moved` bytes:

    t_compute = flops / (peak(dtype) * eff_class)
    t_memory  = bytes_moved / (HBM bandwidth * MEMORY_EFFICIENCY)
    t         = max(t_compute, t_memory) + overhead_class                 (memory, attention)
    t         = max(t_c, t_m) + (1 - GEMM_MEMORY_OVERLAP) min(t_c, t_m) + overhead  (gemm)

`Node.flops` counts only matmul/attention FLOPs; a node with no FLOPs is memory-bound
and priced by bytes alone. Classes: "gemm" (mm/addmm/bmm), "attention" (fused SDPA:
FLASH_ATTENTION_EFFICIENCY on CAUSAL_WORK_FRACTION of the counted FLOPs when causal),
"memory" (everything else). The fixed overhead per kernel is what makes small ops
inefficient (see efficiency.py).
"""

from __future__ import annotations

from autopar.cluster import Hardware
from cost_model.efficiency import (
    CAUSAL_WORK_FRACTION,
    FLASH_ATTENTION_EFFICIENCY,
    GEMM_EFFICIENCY,
    GEMM_MEMORY_OVERLAP,
    GEMM_OVERHEAD_S,
    MEMORY_EFFICIENCY,
    MEMORY_OVERHEAD_S,
)

OP_CLASSES = ("gemm", "attention", "memory")


def compute_time_s(flops: float, bytes_moved: float, hardware: Hardware, dtype: str, *,
                   op_class: str | None = None, causal: bool = False) -> float:
    """Roofline time of one op on one device; `op_class` defaults to gemm if flops > 0."""
    if flops <= 0 and bytes_moved <= 0:
        return 0.0
    cls = op_class or ("gemm" if flops > 0 else "memory")
    t_mem = bytes_moved / (hardware.memory_bandwidth_bytes_per_s * MEMORY_EFFICIENCY)
    if cls == "memory" or flops <= 0:
        return t_mem + MEMORY_OVERHEAD_S
    peak = hardware.peak_flops(dtype)
    if cls == "attention":
        work = flops * (CAUSAL_WORK_FRACTION if causal else 1.0)
        return max(work / (peak * FLASH_ATTENTION_EFFICIENCY), t_mem) + GEMM_OVERHEAD_S
    if cls != "gemm":
        raise ValueError(f"unknown op class {cls!r}; expected one of {', '.join(OP_CLASSES)}")
    t_flops = flops / (peak * GEMM_EFFICIENCY)
    # near the ridge point a GEMM's operand traffic is only partly hidden behind its math
    return max(t_flops, t_mem) + (1 - GEMM_MEMORY_OVERLAP) * min(t_flops, t_mem) + GEMM_OVERHEAD_S


def optimizer_time_s(local_parameters: float, hardware: Hardware) -> float:
    """The optimizer step over `local_parameters` elements: a memory-bound pass reading and
    writing OPTIMIZER_BYTES_PER_PARAM bytes per element (efficiency.py) at achievable HBM
    bandwidth."""
    from cost_model.efficiency import OPTIMIZER_BYTES_PER_PARAM

    return local_parameters * OPTIMIZER_BYTES_PER_PARAM / (hardware.memory_bandwidth_bytes_per_s * MEMORY_EFFICIENCY)
