"""Step time, throughput and memory of one full parallel configuration.

Where it sits: benchmarks/baselines/analytic/, the closed-form baseline the product's one model
(`autopar price` and `autopar search`: the ILP's costs, solver/) is validated beside on
the published runs; `price_profile(profile, config, cluster, global_batch=...)` prices a
whole configuration in a few ms, which is what the published-run fit of its constants
(benchmarks/fit/fit_cost_model.py) and the template grid (benchmarks/baselines/template/
search.py) call thousands of times.
`price_profile` is a straight line of one function per term, named below beside its
formula; each function's docstring repeats the formula it implements.

Math. Mesh (pp, dp, tp), tp fastest over device ids (Megatron's order), so tp sits in a
node when tp <= devices per node. Per microbatch (b sequences, r = b / traced batch)
and per layer, with t = tp:
    compute  F, B   (`_segment_times`, `_items_time`, `_host_time`)
                    = sum over the layer's forward / backward ops of their time at r/t of
                      their FLOPs and bytes (residual-stream ops r/1 without sequence
                      parallelism); GEMMs at their local shape (compute.gemm_time_s: the
                      micro-batch grows M, or K of the weight gradient; tp divides the
                      weight's split dimension), memory-bound ops by bytes, scaled by
                      compiled_memory_factor under torch.compile
    recompute R     (`_segment_times`)
                    = F / k (full; k = checkpoint_every, 1 by default) | the recomputable
                      ops' forward time, plus every second GEMM under "alternate-mm"
                      (selective) | 0
    tp comm         (`_tp_comm`)
                    2 all-reduces (or reduce-scatter + all-gather with SP) of b*s*h in
                    the forward, 2 in the backward, 2 more when the forward is recomputed;
                    on the critical path (tp_comm_overlap), or async_tp_overlap of them
                    hidden with the async_tp option
    zero-3          (`_zero3_layer`)
                    all-gather the layer's weights before forward and backward, reduce-
                    scatter its gradients after backward, as the runtime issues them
                    (granularity, prefetch window, overlap: analytic/zero3.py)
Core sharing (`_pipeline`; the cpu profile, cores_per_node < ranks per node, share =
ranks / cores): op times are at a dedicated core's speed; the step is the longer of the dedicated-core
pipeline below and every rank's CPU work over the cores, m * mean stage work * share plus
the critical stage's communication (a rank waiting in a bubble or a collective frees its
core); the optimizer runs on all ranks at once (x share).
A stage i of n_i layers (plus embedding on the first, head+loss on the last, and the
pipeline send/recv of b*s*h/t per chunk boundary, v per stage when interleaved) takes
T_i per microbatch (`_stage_times`). With m microbatches and v chunks per stage:
    pipeline  (`_pipeline`)
              = m * max_i T_i + (sum_i T_i - max_i T_i) / v      (bubble: second term;
                gives (m + (p-1)/v) T for uniform stages: SC'21's bubble (p-1)/(v m))
    dp sync   (`_dp_sync_s`)
              = all-reduce (zero 0-1) of the stage's gradients once per step in buckets of
                dp_bucket_bytes (each pays the collective latencies), or reduce-scatter
                per microbatch (zero 2-3), at grad_reduce_bytes per element, hidden behind
                the last microbatch's backward (overlap_efficiency of the part that runs
                under it is hidden: NCCL kernels share SMs and HBM); zero 1-2
                all-gather updated weights after the step
    optimizer (`_optimizer_s`)
              = local parameters * optimizer_bytes_per_param / achievable HBM bandwidth
    grad accumulation (`_grad_accumulation_s`)
              = (m - 1) microbatches adding into the step's gradients, a memory-bound pass
                of 3 * grad_reduce_bytes per local gradient element (compute.py
                grad_accumulation_time_s); the whole local replica under zero 0-1, the
                shard under zero 2-3 (reduce-scattered every microbatch)
    step      (`_estimate`) = pipeline + exposed dp sync + optimizer + grad accumulation
Model FLOPs are the traced forward+backward FLOPs (attention counted as the full s x s
square, the convention of torchtitan, llm-foundry and Megatron); MFU divides them per
device per second by the dense peak (`_estimate`; peak memory: analytic/memory.py).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from autopar.cluster import Cluster, Hardware
from autopar.config import ParallelConfig, default_stage_layers
from cost_model.collectives import (
    AxisLink,
    all_gather_time_s,
    all_reduce_time_s,
    mesh_axis_links,
    reduce_scatter_time_s,
    send_recv_time_s,
)
from cost_model.compute import compute_time_s, gemm_time_s, grad_accumulation_time_s
from cost_model.efficiency import Efficiency, efficiency_for
from cost_model.table import core_share, pipeline_call_time_s
from autopar.estimate import Estimate
from cost_model.memory import BYTES_WEIGHT
from .memory import stage_memory, stage_params
from .options import SELECTIVE_POLICIES, RuntimeOptions
from .profile import GraphProfile, OpItem, SegmentProfile
from .zero3 import Zero3LayerTimes, zero3_layer_times, zero3_runtime


@dataclass(frozen=True, slots=True, kw_only=True)
class _SegTimes:
    forward_s: float
    backward_s: float
    recompute_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class _Ctx:
    """What every op's time depends on besides the op (one per price call)."""
    config: ParallelConfig
    cluster: Cluster
    ratio: float
    dtype: str
    dtype_bytes: int
    eff: Efficiency
    memory_scale: float
    dtensor: bool
    """Ops of tensor-parallel segments pay the DTensor overhead."""


def _gemm_item_time(it: OpItem, ctx: _Ctx, div: int) -> float:
    dims = list(it.gemm_dims)
    dims[it.batch_axis] *= ctx.ratio
    dims[it.tp_axis] /= div
    moved = ((it.bytes_moved - it.fixed_bytes) * ctx.ratio + it.fixed_bytes) / div
    b, m, n, k = dims
    return gemm_time_s(b, m, n, k, moved, ctx.cluster.hardware, ctx.dtype, ctx.eff)


def _items_time(items: tuple[OpItem, ...], ctx: _Ctx, phase: str | None) -> float:
    hw = ctx.cluster.hardware
    config, ratio, eff = ctx.config, ctx.ratio, ctx.eff
    t = config.tp
    total = 0.0
    for it in items:
        if phase is not None and it.phase != phase:
            continue
        div = t if (not it.stream or config.sequence_parallel) else 1
        flops = it.flops * ratio / div
        moved = ((it.bytes_moved - it.fixed_bytes) * ratio + it.fixed_bytes) / div
        if it.op_class == "memory":
            # a fused (compiled) stack moves a fraction of the op-by-op bytes in a fraction of the kernels
            total += it.weight * ctx.memory_scale * compute_time_s(0.0, moved, hw, ctx.dtype, efficiency=eff)
        elif it.op_class == "attention" and config.attention == "math":
            forward = it.phase == "forward"
            share = eff.math_forward_passes if forward else eff.math_attention_passes - eff.math_forward_passes
            scores = it.score_elems * ratio / t * ctx.dtype_bytes * share
            total += it.weight * (compute_time_s(flops, 0.0, hw, ctx.dtype, op_class="gemm", efficiency=eff)
                                  + scores / (hw.memory_bandwidth_bytes_per_s * eff.memory_efficiency))
        elif it.op_class == "gemm" and it.gemm_dims:
            total += it.weight * _gemm_item_time(it, ctx, div)
        else:
            total += it.weight * compute_time_s(flops, moved, hw, ctx.dtype, op_class=it.op_class, causal=it.causal,
                                                efficiency=eff)
    return total


def _host_time(seg: SegmentProfile, ctx: _Ctx, phase: str) -> float:
    """Host costs beyond the ops' own: views (eager) and DTensor dispatch (tp > 1)."""
    eff = ctx.eff
    views = seg.view_ops[0 if phase == "forward" else 1]
    total = views * eff.view_overhead_s
    if ctx.dtensor and ctx.config.tp > 1 and eff.dtensor_op_overhead_s:
        ops = sum(it.weight for it in seg.items if it.phase == phase)
        total += (ops + views) * eff.dtensor_op_overhead_s
    return total


def _segment_times(seg: SegmentProfile, ctx: _Ctx, recompute: bool, options: RuntimeOptions) -> _SegTimes:
    config = ctx.config
    fwd = _items_time(seg.items, ctx, "forward") + _host_time(seg, ctx, "forward")
    bwd = _items_time(seg.items, ctx, "backward") + _host_time(seg, ctx, "backward")
    rec = 0.0
    if recompute and config.recompute == "full":
        rec = fwd / options.checkpoint_every  # the average layer: 1 in k re-runs its forward
    elif recompute and config.recompute == "selective":
        rec = _items_time(seg.recompute_items, ctx, "forward")
        if options.selective_policy == "alternate-mm":
            rec += _items_time(seg.alternate_gemm_items, ctx, "forward")
        if config.attention == "math":  # Korthikanti's selective recompute: the attention core
            rec += _items_time(tuple(i for i in seg.items if i.op_class == "attention"), ctx, "forward")
    return _SegTimes(forward_s=fwd, backward_s=bwd, recompute_s=rec)


def _bucketed_all_reduce_s(size_bytes: float, bucket_bytes: float, link: AxisLink) -> float:
    """All-reduce of `size_bytes` in buckets of at most `bucket_bytes` (each pays the latencies)."""
    if size_bytes <= 0:
        return 0.0
    buckets = max(1, math.ceil(size_bytes / bucket_bytes))
    return buckets * all_reduce_time_s(size_bytes / buckets, link)


def _runtime_options(options: RuntimeOptions | None, zero3: str | None, checkpoint_every: int | None,
                     selective_policy: str | None) -> RuntimeOptions:
    """`options` with the shorthand keywords of `price_profile` applied on top."""
    opts = options or RuntimeOptions()
    shorthand = {k: v for k, v in (("zero3", zero3), ("checkpoint_every", checkpoint_every),
                                   ("selective_policy", selective_policy)) if v is not None}
    if shorthand:
        if shorthand.get("selective_policy", "pointwise") not in SELECTIVE_POLICIES:
            raise ValueError(f"unknown selective_policy {shorthand['selective_policy']!r}; known: "
                             f"{', '.join(SELECTIVE_POLICIES)}")
        opts = replace(opts, **shorthand)
    return opts


def _checked_stage_layers(profile: GraphProfile, pp: int, stage_layers: tuple[int, ...] | None) -> tuple[int, ...]:
    """Layers per pipeline stage: the given split (checked) or the even default."""
    if stage_layers is None:
        stage_layers = default_stage_layers(profile.num_layers, pp)
    layerless = profile.num_layers == 0 and pp == 1 and tuple(stage_layers) == (0,)  # one stage holds all
    if not layerless and (len(stage_layers) != pp or sum(stage_layers) != profile.num_layers
                          or min(stage_layers) < 1):
        raise ValueError(
            f"stage_layers {stage_layers} must have pp={pp} positive entries summing to the model's "
            f"{profile.num_layers} layers"
        )
    return stage_layers


@dataclass(frozen=True, slots=True, kw_only=True)
class _TpComm:
    """Exposed tensor-parallel collective time per microbatch."""
    forward_s: float
    """Per layer, forward."""
    backward_s: float
    """Per layer, backward (with the recomputed forward's under full recompute)."""
    edge_s: float
    """Per pass at the vocab-parallel embedding and head (first and last stage)."""


def _tp_comm(config: ParallelConfig, opts: RuntimeOptions, eff: Efficiency, tp_link: AxisLink,
             stream_bytes: float) -> _TpComm:
    """Megatron's 2 collectives per layer per pass on the b*s*h residual stream:
        one       = all-reduce(b*s*h), or all-gather + reduce-scatter with sequence parallelism
        exposed   = 1 - (async_tp_overlap with async TP, else tp_comm_overlap)
        forward   = 2 * one * exposed
        backward  = 2 * one * exposed + forward / k   (full recompute, k = checkpoint_every)
        edge      = one when tp > 1 (embedding / head reduction per pass)"""
    if config.sequence_parallel:
        one = all_gather_time_s(stream_bytes, tp_link) + reduce_scatter_time_s(stream_bytes, tp_link)
    else:
        one = all_reduce_time_s(stream_bytes, tp_link)
    tp_exposed = 1 - (eff.async_tp_overlap if opts.async_tp else eff.tp_comm_overlap)
    tp_fwd = 2 * one * tp_exposed
    tp_bwd = 2 * one * tp_exposed + (tp_fwd / opts.checkpoint_every if config.recompute == "full" else 0.0)
    return _TpComm(forward_s=tp_fwd, backward_s=tp_bwd, edge_s=one if config.tp > 1 else 0.0)


def _zero3_layer(profile: GraphProfile, config: ParallelConfig, opts: RuntimeOptions, layer: _SegTimes,
                 dp_link: AxisLink, comm_overlap: float, eff: Efficiency) -> Zero3LayerTimes | None:
    """ZeRO-3 per layer (zero >= 3, else None): gather the layer's params/tp + replicated
    weights before forward and backward, reduce-scatter its gradients at grad_reduce_bytes,
    as the runtime issues them (cost_model/zero3.py: granularity, prefetch, overlap)."""
    if config.zero < 3:
        return None
    layer_params = profile.layer.params_split / config.tp + profile.layer.params_replicated
    z3_rt = replace(zero3_runtime(opts.zero3), grad_reduce_bytes=opts.grad_reduce_bytes)
    return zero3_layer_times(z3_rt, layer_params=layer_params,
                             param_tensors=profile.layer.param_tensors, link=dp_link,
                             forward_s=layer.forward_s, backward_s=layer.backward_s + layer.recompute_s,
                             weight_bytes=BYTES_WEIGHT,
                             recompute_share=1 / opts.checkpoint_every if config.recompute == "full" else 0.0,
                             comm_overlap=comm_overlap, efficiency=eff)


@dataclass(frozen=True, slots=True, kw_only=True)
class _StageTime:
    """One pipeline stage's time per microbatch, by term."""
    compute_s: float
    recompute_s: float
    tp_s: float
    zero3_s: float
    pp_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.recompute_s + self.tp_s + self.zero3_s + self.pp_s


def _stage_times(stage_layers: tuple[int, ...], config: ParallelConfig, layer: _SegTimes, pre: _SegTimes,
                 post: _SegTimes, tp: _TpComm, z3_layer: Zero3LayerTimes | None, p2p_s: float,
                 call_s: float = 0.0) -> list[_StageTime]:
    """Per stage i of n_i layers, per microbatch:
        compute   = n_i (F + B) (+ pre's F + B on the first stage, post's on the last)
        recompute = n_i R
        tp        = n_i (tp forward + backward) (+ 2 edge on the first and on the last stage)
        zero3     = n_i (exposed gather/reduce-scatter, forward + backward)
        pp        = 2 p2p v x (2 for a middle stage, 1 at either end) / 2, when pp > 1:
                    blocking send/recv of the b*s*h/t boundary activations, forward and backward,
                    + v call: the host time of a chunk call (cost_model.pipeline_call_time_s)"""
    p, v = config.pp, config.interleave
    z3_fwd = z3_layer.forward_exposed_s if z3_layer else 0.0
    z3_bwd = z3_layer.backward_exposed_s if z3_layer else 0.0
    stages = []
    for i, n in enumerate(stage_layers):
        comp = n * (layer.forward_s + layer.backward_s)
        tp_comm = n * (tp.forward_s + tp.backward_s)
        if i == 0:
            comp += pre.forward_s + pre.backward_s
            tp_comm += 2 * tp.edge_s
        if i == p - 1:
            comp += post.forward_s + post.backward_s
            tp_comm += 2 * tp.edge_s
        stages.append(_StageTime(compute_s=comp, recompute_s=n * layer.recompute_s, tp_s=tp_comm,
                                 zero3_s=n * (z3_fwd + z3_bwd),
                                 pp_s=2 * p2p_s * v * (2 if 0 < i < p - 1 else 1) / 2 + v * call_s if p > 1 else 0.0))
    return stages


@dataclass(frozen=True, slots=True, kw_only=True)
class _Pipeline:
    """The pipelined microbatches of one step: the critical stage's terms over m microbatches."""
    critical_stage: int
    compute_s: float
    recompute_s: float
    tp_s: float
    zero3_s: float
    pp_s: float
    bubble_s: float
    pipeline_s: float


def _pipeline(stages: list[_StageTime], num_microbatches: int, interleave: int, share: float) -> _Pipeline:
    """pipeline = m * max_i T_i + bubble, bubble = (sum_i T_i - max_i T_i) / v.
    Core sharing (share > 1): every rank's CPU work over the cores, m * mean stage
    (compute + recompute) * share plus the critical stage's communication, when longer
    (a stage waiting in a bubble frees its core, so the bubble is then 0)."""
    m = num_microbatches
    crit = max(range(len(stages)), key=lambda i: stages[i].total_s)
    t_max = stages[crit].total_s
    bubble = (sum(s.total_s for s in stages) - t_max) / interleave
    c = stages[crit]
    comp, rec, tp_comm, z3, pp_comm = (m * x for x in (c.compute_s, c.recompute_s, c.tp_s, c.zero3_s, c.pp_s))
    pipeline = m * t_max + bubble
    if share > 1:
        mean_comp = statistics.fmean(s.compute_s for s in stages) * m * share
        mean_rec = statistics.fmean(s.recompute_s for s in stages) * m * share
        shared = mean_comp + mean_rec + tp_comm + z3 + pp_comm
        if shared >= pipeline:
            comp, rec, bubble, pipeline = mean_comp, mean_rec, 0.0, shared
    return _Pipeline(critical_stage=crit, compute_s=comp, recompute_s=rec, tp_s=tp_comm, zero3_s=z3, pp_s=pp_comm,
                     bubble_s=bubble, pipeline_s=pipeline)


def _dp_sync_s(config: ParallelConfig, opts: RuntimeOptions, psi: float, layers: int, num_microbatches: int,
               layer: _SegTimes, z3_layer: Zero3LayerTimes | None, dp_link: AxisLink, eff: Efficiency,
               comm_overlap: float) -> float:
    """Exposed data-parallel sync of the critical stage's psi parameters (dp > 1), with
    g = psi * grad_reduce_bytes and the last backward's window W = layers (B + R) hidden
    at o = overlap_efficiency * comm_overlap (W = 0 without overlap_grad_reduce):
        zero 0-1: all-reduce(g) in dp_bucket_bytes buckets, minus o min(sync, W);
                  zero 1 adds all-gather(psi * BYTES_WEIGHT)
        zero 2:   FSDP2 without reshard, per module (layers + 1 root): m (reduce-scatter
                  - o min(sync, W)) + all-gather of the updated weights
        zero 3:   m * the first layer's gather (the rest is in the stage times)"""
    if config.dp <= 1:
        return 0.0
    m = num_microbatches
    last_bwd = layers * (layer.backward_s + layer.recompute_s)
    window = last_bwd if opts.overlap_grad_reduce else 0.0
    overlap = eff.overlap_efficiency * comm_overlap
    grad_bytes = psi * opts.grad_reduce_bytes
    dp_sync = 0.0
    if config.zero <= 1:
        sync = _bucketed_all_reduce_s(grad_bytes, opts.dp_bucket_bytes, dp_link)
        dp_sync = sync - overlap * min(sync, window)
    elif config.zero == 2:
        modules = layers + 1
        sync = modules * reduce_scatter_time_s(grad_bytes / modules, dp_link)
        dp_sync = m * (sync - overlap * min(sync, window))
        dp_sync += modules * all_gather_time_s(psi * BYTES_WEIGHT / modules, dp_link)
    if config.zero == 1:
        dp_sync += all_gather_time_s(psi * BYTES_WEIGHT, dp_link)
    if z3_layer is not None:  # the first layer's gather before each forward cannot hide
        dp_sync = m * z3_layer.gather_s
    return dp_sync


def _optimizer_s(config: ParallelConfig, psi: float, share: float, hw: Hardware, eff: Efficiency) -> float:
    """optimizer = share * local params * optimizer_bytes_per_param / (HBM bandwidth *
    memory_efficiency); local = psi / dp under ZeRO >= 1, else psi."""
    local = psi / (config.dp if config.zero >= 1 else 1)
    return share * local * eff.optimizer_bytes_per_param / (hw.memory_bandwidth_bytes_per_s * eff.memory_efficiency)


def _grad_accumulation_s(config: ParallelConfig, opts: RuntimeOptions, psi: float, num_microbatches: int,
                         share: float, hw: Hardware, eff: Efficiency) -> float:
    """share * grad_accumulation_time_s(local gradients, m, grad_reduce_bytes): local =
    psi (zero 0-1: each rank accumulates its whole replica) or psi / dp (zero 2-3: the
    gradients are reduce-scattered every microbatch and the shard accumulates)."""
    local = psi / config.dp if config.zero >= 2 else psi
    return share * grad_accumulation_time_s(local, num_microbatches, opts.grad_reduce_bytes, hw, eff)


def _estimate(profile: GraphProfile, config: ParallelConfig, cluster: Cluster, global_batch: int,
              stage_layers: tuple[int, ...], num_microbatches: int, checkpoint_every: int, pipe: _Pipeline,
              dp_sync_s: float, optimizer_s: float, accumulate_s: float) -> Estimate:
    """step = pipeline + dp sync + optimizer + gradient accumulation; tokens/s, model TFLOP/s (traced fwd+bwd FLOPs
    scaled to the global batch), hardware TFLOP/s (+ recomputed layer forwards), MFU over
    the dense peak; memory of the stage with the largest total (cost_model/memory.py)."""
    p, t, d, v, m = config.pp, config.tp, config.dp, config.interleave, num_microbatches
    hw = cluster.hardware
    step = pipe.pipeline_s + dp_sync_s + optimizer_s + accumulate_s
    tokens = global_batch * profile.seq
    model_flops = profile.model_flops_per_step * global_batch / profile.batch
    rec_flops = 0.0
    if config.recompute == "full":
        rec_flops = profile.layer_forward_flops * profile.num_layers * global_batch / profile.batch / checkpoint_every
    devices = cluster.num_devices
    model_tflops = model_flops / step / devices / 1e12
    peak = hw.peak_flops(profile.dtype)

    mems = [stage_memory(profile, config, stage=i, layers=n, num_microbatches=m, checkpoint_every=checkpoint_every)
            for i, n in enumerate(stage_layers)]
    peak_stage = max(range(p), key=lambda i: mems[i].total_bytes)
    mem = mems[peak_stage]
    limit = cluster.device_memory_bytes
    peak_bytes = int(round(mem.total_bytes))
    return Estimate(
        step_time_s=step,
        tokens_per_s=tokens / step,
        tokens_per_s_per_device=tokens / step / devices,
        model_tflops_per_device=model_tflops,
        hardware_tflops_per_device=(model_flops + rec_flops) / step / devices / 1e12,
        mfu=model_tflops * 1e12 / peak,
        peak_memory_bytes=peak_bytes,
        fits=peak_bytes <= limit,
        memory_limit_bytes=limit,
        peak_stage=peak_stage,
        time_breakdown=(
            ("compute_s", pipe.compute_s), ("recompute_s", pipe.recompute_s), ("comm_tp_s", pipe.tp_s),
            ("comm_pp_s", pipe.pp_s), ("comm_zero3_s", pipe.zero3_s), ("comm_dp_s", dp_sync_s),
            ("bubble_s", pipe.bubble_s), ("optimizer_s", optimizer_s), ("grad_accum_s", accumulate_s),
        ),
        memory_breakdown=(
            ("params_bytes", int(mem.params_bytes)), ("grads_bytes", int(mem.grads_bytes)),
            ("optimizer_bytes", int(mem.optimizer_bytes)), ("activations_bytes", int(mem.activations_bytes)),
            ("temporary_bytes", int(mem.temporary_bytes)),
        ),
        config=(
            ("tp", t), ("pp", p), ("dp", d), ("zero", config.zero), ("micro_batch", config.micro_batch),
            ("num_microbatches", m), ("schedule", config.schedule if p > 1 else "none"),
            ("interleave", v), ("recompute", config.recompute), ("attention", config.attention),
            ("sequence_parallel", config.sequence_parallel),
        ),
    )


def price_profile(profile: GraphProfile, config: ParallelConfig, cluster: Cluster, *, global_batch: int,
                  stage_layers: tuple[int, ...] | None = None, zero3: str | None = None,
                  checkpoint_every: int | None = None, selective_policy: str | None = None,
                  options: RuntimeOptions | None = None, efficiency: Efficiency | None = None) -> Estimate:
    """Price one configuration from a precomputed profile (see module docstring).

    `options` (analytic/options.py) describes what the runtime does where ParallelConfig
    leaves it open (ZeRO-3 runtime, per-layer checkpointing, selective policy, reduce
    dtype, torch.compile, async TP, DP buckets); `zero3`, `checkpoint_every` and
    `selective_policy` are shorthands that override the same fields. `efficiency`
    replaces the cost model's constants (the fit script passes candidates here); the
    hardware profile's overrides apply on top.
    """
    opts = _runtime_options(options, zero3, checkpoint_every, selective_policy)
    m = config.check(global_batch=global_batch, num_devices=cluster.num_devices, heads=profile.heads,
                     kv_heads=profile.kv_heads, num_layers=profile.num_layers)
    p, t, d = config.pp, config.tp, config.dp
    stage_layers = _checked_stage_layers(profile, p, stage_layers)
    hw = cluster.hardware
    eff = efficiency_for(hw, efficiency)
    pp_link, dp_link, tp_link = mesh_axis_links(cluster, (p, d, t), eff)
    share = core_share(cluster)
    ctx = _Ctx(config=config, cluster=cluster, ratio=config.micro_batch / profile.batch, dtype=profile.dtype,
               dtype_bytes=profile.dtype_bytes, eff=eff,
               memory_scale=eff.compiled_memory_factor if opts.compiled else 1.0, dtensor=opts.dtensor_tp)
    layer = _segment_times(profile.layer, ctx, True, opts)
    pre = _segment_times(profile.pre, ctx, False, opts)
    post = _segment_times(profile.post, ctx, False, opts)

    stream_bytes = config.micro_batch * profile.seq * profile.hidden * profile.dtype_bytes
    tp = _tp_comm(config, opts, eff, tp_link, stream_bytes)
    z3_layer = _zero3_layer(profile, config, opts, layer, dp_link, hw.comm_overlap, eff)
    # SC'21's scatter/gather: each tp rank sends its b*s*h/t slice of the boundary activations
    p2p = send_recv_time_s(stream_bytes / t, pp_link) if p > 1 else 0.0
    call = pipeline_call_time_s(cluster, efficiency) if p > 1 else 0.0  # a chunk call's host time, every stage
    stages = _stage_times(stage_layers, config, layer, pre, post, tp, z3_layer, p2p, call)
    pipe = _pipeline(stages, m, config.interleave, share)
    crit = pipe.critical_stage
    psi = stage_params(profile, config, stage_layers[crit], crit == 0, crit == p - 1)
    dp_sync = _dp_sync_s(config, opts, psi, stage_layers[crit], m, layer, z3_layer, dp_link, eff, hw.comm_overlap)
    optimizer = _optimizer_s(config, psi, share, hw, eff)
    accumulate = _grad_accumulation_s(config, opts, psi, m, share, hw, eff)
    return _estimate(profile, config, cluster, global_batch, stage_layers, m, opts.checkpoint_every, pipe,
                     dp_sync, optimizer, accumulate)


__all__ = ["AxisLink", "SELECTIVE_POLICIES", "default_stage_layers", "price_profile"]
