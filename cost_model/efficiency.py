"""Every achievable-efficiency factor of the cost model, in one frozen value.

Where it sits: read by cost_model/compute.py (op roofline), cost_model/collectives.py
(bus bandwidths, latencies) and cost_model/table.py (host times); the closed-form
baseline (benchmarks/baselines/analytic/step.py) also reads the fields only it uses (overlap,
torch.compile, async TP, DTensor host time: the runtime options of published stacks).
Hardware peaks live in autopar/cluster.py; `Efficiency` says how much of a peak real
kernels and collectives reach. A hardware profile may override fields
(`Hardware.efficiency`: the calibrated `cpu` profile replaces the GPU kernel figures by
what `autopar calibrate` measured); `efficiency_for(hardware)` applies them.

Two kinds of fields:
- FITTED: global constants fitted by `benchmarks/fit/fit_cost_model.py` on the published
  runs (benchmarks/data/published_runs.csv), one value for every row and every GPU; the
  values live in `fitted_constants.json` beside this module (written by that script,
  with the rows they were fitted on). Never edited by hand, never per row.
- facts: documented values from public measurements (source beside each field).

Terms: a *peak* is the datasheet rate; *efficiency* is achieved / peak; a *fixed overhead*
is the per-kernel (or per-collective) time a launch pays regardless of size:
time = work / (peak * efficiency) + overhead, so efficiency(work) saturates with size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

FITTED_CONSTANTS_PATH = Path(__file__).with_name("fitted_constants.json")


@dataclass(frozen=True, slots=True, kw_only=True)
class Efficiency:
    # --- fitted (benchmarks/fit/fit_cost_model.py) -------------------------------------------
    gemm_efficiency: float
    """Share of the hardware's maximum achievable matmul rate (Hardware.matmul_fraction x
    peak, the best-shape cuBLAS rate) that training GEMMs of large, well-shaped tiles reach
    inside a real step (clocks under power load, L2 contention with concurrent kernels)."""
    gemm_k_ramp: float
    """K0 of the per-tile main-loop efficiency K / (K + K0): each output tile pays a fixed
    prologue/epilogue (fill and drain of the load pipeline, the epilogue store) worth K0
    reduction steps, so GEMMs with a short reduction dimension (small hidden, large tp on a
    row-parallel layer, a small micro-batch in the weight-gradient GEMM) are less efficient
    (NVIDIA Matrix Multiplication Background User's Guide DU-09799-001, Sec 2-3)."""
    flash_attention_efficiency: float
    """Fused attention forward+backward on the causal work, relative to the GPU's best fused
    forward rate (Hardware.attention_fraction x peak): the backward runs slower than the
    forward (FlashAttention-2 paper: 50-73% forward, 30-45% backward on A100)."""
    memory_efficiency: float
    """Bandwidth-bound kernels' share of HBM peak in a training step (STREAM-like copies reach
    ~0.8-0.9 on A100/H100; norms, softmax and cross-entropy less)."""
    overlap_efficiency: float
    """Share of the communication time that runs concurrently with compute which is really
    hidden: NCCL kernels occupy SMs (one per channel) and HBM bandwidth, so the compute they
    overlap slows down by the rest (exposed = comm - overlap_efficiency * min(comm, window))."""
    grad_sync_overlap_efficiency: float = 0.5
    """The one model's share of the backward compute behind which a gradient bucket's
    collective really hides (rho in cost_model/table.py `exposed_sync_s`: exposed sync =
    max(S_last, S - rho x W) per overlapped sync). Below 1 because the collective shares
    the GPU with the backward it overlaps (NCCL's kernels take SMs and HBM bandwidth) and a
    bucket issued late has less backward left to hide behind than the whole window W.
    Fitted on the published runs by benchmarks/fit/fit_one_model.py (ONE_MODEL_FITTED), a
    constant of the one model only: the closed-form baseline's `overlap_efficiency`
    multiplies another window (min(comm, window) over all its overlappable collectives,
    ZeRO-3 gathers included), so one value fitted for both would move either model when
    the other is refitted. Before any fit, 0.5 (the prior's centre: half hidden). Read
    where a one-stage program overlaps its gradient sync (codegen/collectives.py
    `GradSync`) and where it issues its weights' collectives ahead of their use
    (codegen/prefetch.py; rho of cost_model/table.py `hidden_comm_s`, the same share of
    another phase's compute: both are collectives on NCCL's stream beside the compute's
    kernels), times the hardware's `comm_overlap` (0 on the cpu profile)."""
    compiled_memory_factor: float
    """torch.compile (`compiled` runtime option): fraction of the eager op-by-op memory traffic
    and kernel launches of memory-bound ops that remain after inductor's fusion."""
    gemm_overhead_s: float
    """Per-GEMM fixed time on a GPU: the gap between back-to-back kernels (the host launches
    ahead, so not the ~5 us launch latency itself), the first wave's fill and the last
    wave's drain, and the epilogue of one cuBLAS kernel. What it decides: how much a small
    micro-batch or a small hidden size (many short GEMMs) loses per FLOP. The `cpu` profile
    replaces it by the per-call time `autopar calibrate` measured."""
    memory_overhead_s: float
    """Per memory-bound kernel fixed time on a GPU (inter-kernel gap and tail of a short
    elementwise/norm kernel); the `cpu` profile replaces it by the measured eager op cost."""

    # --- facts ---------------------------------------------------------------------------
    view_overhead_s: float = 0.0
    """Host time of one view op (t, view, transpose, ...): 0 on GPUs, where host work runs
    ahead of the asynchronous kernels; measured by `autopar calibrate` on the cpu profile,
    as the per-rank program calls it (an ATen op overload in a make_fx GraphModule: 1.3 us
    per dedicated core on the development machine, against 0.62 for the `Tensor.t`
    method). Charged per view op by the ILP's cost table (cost_model/table.py
    `view_host_s`)."""
    dtensor_op_overhead_s: float = 0.0
    """Extra host time of one op on DTensors (sharding propagation, wrapping): paid by every op
    of a tensor-parallel layer with the `dtensor_tp` runtime option; 0 on GPUs (hidden behind
    the kernels), measured by `autopar calibrate` on the cpu profile."""
    gemm_tile: int = 128
    """Output tile edge for wave/tile quantization (cuBLAS's common 128x128 CTA tile;
    the guide above, Sec 2.3)."""
    split_k_min: int = 256
    """Smallest reduction chunk cuBLAS's split-K heuristics hand one CTA."""
    causal_work_fraction: float = 0.5
    """A fused causal kernel skips the masked half of the s x s tiles; the traced FLOP count
    (and the MFU conventions of the sources) count the full square."""
    math_attention_passes: float = 10.0
    """Unfused attention (`--attention math`): memory passes over the b*a*s*s score tensor
    per training step beyond its two batched GEMMs: forward write scores, scale+mask+softmax
    read/write (fused softmax kernel), read for the value GEMM (4); backward read probs,
    write/read grad-probs, softmax-backward read/write, write grad-scores (6)."""
    math_forward_passes: float = 4.0
    """Of math_attention_passes, the forward's share."""
    optimizer_bytes_per_param: float = 36.0
    """Fused AdamW step, mixed precision: read+write fp32 master, m, v (24), read the fp32
    gradient (4), write the 16-bit weight (2), grad-norm read (4) and zeroing (2).
    The calibrated `cpu` profile overrides it with what `autopar calibrate` measured (the
    runtime's fused fp32 AdamW step per parameter x the measured copy bandwidth)."""
    optimizer_tensor_overhead_s: float = 0.0
    """Host time per local parameter tensor per step of the step's epilogue: the gradient
    set as a DTensor, DTensor's dispatch of the fused optimizer kernel over its tensor
    lists, zero_grad. 0 on GPUs (one multi-tensor kernel launch, hidden behind the
    backward's tail); measured by `autopar calibrate` on the cpu profile (on the sweep's
    small model, 39 tensors, this epilogue took 3x the per-element optimizer price)."""
    accumulate_bytes_per_byte: float = 3.0
    """Memory traffic per gradient byte of one microbatch's in-place accumulation (read
    both, write one). The calibrated `cpu` profile overrides it with what `autopar
    calibrate` measured (an in-place fp32 add per byte x the measured copy bandwidth)."""
    tp_comm_overlap: float = 0.0
    """Share of tensor-parallel collectives hidden behind compute without async TP: none
    (Megatron SC'21, plain DTensor TP put them on the critical path)."""
    async_tp_overlap: float = 0.5
    """With the `async_tp` runtime option (torchtitan's micro-pipelined all-gather/reduce-
    scatter matmuls), share of the TP collectives hidden: torchtitan's async-TP benchmark
    (benchmarks/asyncTP_llama3_h100_2025-06) reports 1.09-1.10x end to end in bf16."""
    stage_collective_wait_s: float = 0.0
    """Ranks sharing cores (the cpu profile; never on GPUs): the extra wall time of a
    collective inside one pipeline stage while the other stages' ranks, on the same cores,
    run different work (a stage's tensor-parallel pair, its data-parallel gradient sync):
    the members wait for each other's turn on a core. Not charged in a one-stage program,
    whose groups all reach the same collective at once. Fitted by
    benchmarks/fit/fit_cpu_constants.py on the CPU sweep's recorded runs (that script's
    docstring says which; docs/cost-model.md lists the value); 0 keeps it out."""
    collective_latency_share_exponent: float = 1.0
    """Ranks sharing cores (the cpu profile; never on GPUs, whose share is 1): a collective's
    latency terms (per ring step and per call) grow as share ** this with share = ranks per
    core, where its bandwidth shrinks as 1 / share. 1 (linear) time-slices every ring step
    in full; below 1, part of a ring step is a rank waiting on a peer whose core it shares,
    not CPU work. `autopar calibrate` stores the latencies per dedicated core by the same
    law (measured / share ** this), so a profile prices the rank count it was measured at
    as measured, whatever the value. Fitted by benchmarks/fit/fit_cpu_constants.py on the CPU
    sweep's recorded runs (that script's docstring has the measurements behind it and
    says which runs; docs/cost-model.md lists the value)."""
    pipeline_call_host_s: float = 0.0
    """Ranks sharing cores (the cpu profile; 0 on GPUs, where the host runs ahead of the
    kernels): host time per pipeline stage per chunk call (one microbatch's forward and
    backward through torch.distributed.pipelining's schedule), beyond the stage graph's
    ops and its boundary messages as priced: the schedule's bookkeeping, the autograd
    Function around the per-rank graphs, the p2p messages' host work, the cold start of a
    graph call. Charged per dedicated core, x the ranks per core
    (`cost_model.pipeline_call_time_s`), on every stage of a pipeline (pp > 1) per
    microbatch and chunk. Measured (per-rank CPU and wall): S and M on 8 ranks, dp2 pp4 against dp4 pp2 (the same
    layer work in twice the stage calls) ran about 12 ms per step slower than priced on
    both: 0.7-1.6 ms of CPU per extra stage call (the extra nodes a stage graph has, its
    boundary clones and tangent product, are a few us); trivial stages through the same
    runtime path (PerOpStage, 1F1B, 2 ranks) took 0.07 ms of CPU per call without
    messages and 0.2 ms with one message each way. Too entangled with the p2p and core-sharing terms to price from one probe: fitted
    by benchmarks/fit/fit_cpu_constants.py on the CPU sweep's recorded runs; 0 keeps it out."""
    scalar_all_reduce_hop_s: float = 0.0
    """gloo (the cpu profile; 0 on GPUs and in profiles from an older calibrate, which
    price every all-reduce by the ring's latency): latency per ring step of an all-reduce
    of one element (a loss, a loss's total weight), per dedicated core like the ring's
    (`autopar calibrate` measures it, `scalar_all_reduce_s`). gloo's ring all-reduce
    (gloo/allreduce.cc) cuts the input into at least 2 n segments of at least one element
    and skips the empty ones, so an input of fewer than 2 n elements sends fewer, smaller
    messages: measured on the development machine (20 back to back, 2 cores) 0.92 / 2.2 ms for one
    float32 over 4 / 8 ranks against 5.4 / 18.8 ms for 1024. Between 1 and 2 n elements
    the cost model interpolates linearly (cost_model.collectives.all_reduce_time_s)."""
    gemm_memory_efficiency: float = 1.0
    """Share of `memory_efficiency` x bandwidth at which a GEMM's operand and output bytes
    move (the t_memory of a GEMM's roofline, cost_model/compute.py). 1 on GPUs (their
    GEMM roofline is fitted as it is). On the cpu profile a training step's thin GEMMs (a
    small microbatch's few rows re-reading a whole weight, a weight gradient written once
    per microbatch) cost more per FLOP than the copy bandwidth prices their bytes: fitted
    by benchmarks/fit/fit_cpu_constants.py on the CPU sweep's recorded runs (that script's
    docstring has the measurements behind it and says which runs; docs/cost-model.md
    lists the value)."""
    collective_base_latency_s: float = 6.6e-6
    """Fixed launch latency of one NCCL collective (NCCL src/graph/tuning.cc baseLatencies,
    ring/Simple protocol: 6.6 us)."""
    nvlink_bus_efficiency: float = 0.8
    """nccl-tests busBW / NVLink line rate per direction: A100 ~230 of 300 GB/s at 8 GB and
    ~200 at <= 1 GB (NVIDIA/nccl-tests#149, #178); H100 ~370 of 450 GB/s ring
    (nccl-tests#212). Per-GPU values override this in NVLINK_BUS_EFFICIENCY."""
    nic_bus_efficiency: float = 0.96
    """ConnectX-7 NDR: 48-49 of 50 GB/s (nccl-tests#267); 8x HDR: 192 of 200 GB/s (nccl#812)."""


ONE_MODEL_ONLY: tuple[str, ...] = ("grad_sync_overlap_efficiency",)
"""Fields only the one model reads and only benchmarks/fit/fit_one_model.py fits: read
from `fitted_constants.json` when a fit committed them there, else their defaults."""

FITTED: tuple[str, ...] = ("gemm_efficiency", "gemm_k_ramp", "flash_attention_efficiency", "memory_efficiency",
                           "overlap_efficiency", "compiled_memory_factor", "gemm_overhead_s", "memory_overhead_s")
"""The fields benchmarks/fit/fit_cost_model.py fits (in this order)."""

NVLINK_BUS_EFFICIENCY: dict[str, float] = {"a100-40gb": 0.70, "a100-80gb": 0.70, "h100": 0.82, "h200": 0.82,
                                           "b200": 0.82}
"""Per GPU, nccl-tests busBW / NVLink line rate (sources at Efficiency.nvlink_bus_efficiency)."""


def load_fitted(path: Path = FITTED_CONSTANTS_PATH) -> dict[str, Any]:
    """The fit script's output: {"constants": {name: value}, "fitted_on": ..., ...}."""
    data = json.loads(path.read_text())
    missing = set(FITTED) - set(data["constants"])
    if missing:
        raise ValueError(f"{path}: fitted constants {sorted(missing)} missing; rerun benchmarks/fit/fit_cost_model.py")
    return data


DEFAULT_EFFICIENCY = Efficiency(**{k: float(v) for k, v in load_fitted()["constants"].items()
                                    if k in FITTED or k in ONE_MODEL_ONLY})
"""The cost model's constants: facts plus the committed fit."""

EFFICIENCY_FIELDS = frozenset(f.name for f in fields(Efficiency))


def efficiency_for(hardware: Any, base: Efficiency | None = None) -> Efficiency:
    """`base` (default DEFAULT_EFFICIENCY) with the hardware profile's overrides applied."""
    eff = base or DEFAULT_EFFICIENCY
    overrides = dict(getattr(hardware, "efficiency", ()) or ())
    return replace(eff, **overrides) if overrides else eff


def nvlink_bus_efficiency(hardware_name: str, eff: Efficiency) -> float:
    return NVLINK_BUS_EFFICIENCY.get(hardware_name, eff.nvlink_bus_efficiency)


__all__ = ["DEFAULT_EFFICIENCY", "EFFICIENCY_FIELDS", "Efficiency", "FITTED", "ONE_MODEL_ONLY", "efficiency_for", "load_fitted",
           "nvlink_bus_efficiency"]
