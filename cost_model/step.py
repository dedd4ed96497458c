"""Step time, throughput and memory of one full parallel configuration.

Where it sits: cost_model/; `price_profile(profile, config, cluster, global_batch=...)`
is what `autopar price` and the whole-plan search call (thousands of times: a few ms).

Math. Mesh (pp, dp, tp), tp fastest over device ids (Megatron's order), so tp sits in a
node when tp <= devices per node. Per microbatch (b sequences, r = b / traced batch)
and per layer, with t = tp:
    compute  F, B   = sum over the layer's forward / backward ops of their time at r/t of
                      their FLOPs and bytes (residual-stream ops r/1 without sequence
                      parallelism); GEMMs at their local shape (compute.gemm_time_s: the
                      micro-batch grows M, or K of the weight gradient; tp divides the
                      weight's split dimension), memory-bound ops by bytes, scaled by
                      compiled_memory_factor under torch.compile
    recompute R     = F / k (full; k = checkpoint_every, 1 by default) | the recomputable
                      ops' forward time, plus every second GEMM under "alternate-mm"
                      (selective) | 0
    tp comm         2 all-reduces (or reduce-scatter + all-gather with SP) of b*s*h in
                    the forward, 2 in the backward, 2 more when the forward is recomputed;
                    on the critical path (tp_comm_overlap), or async_tp_overlap of them
                    hidden with the async_tp option
    zero-3          all-gather the layer's weights before forward and backward, reduce-
                    scatter its gradients after backward, as the runtime issues them
                    (granularity, prefetch window, overlap: cost_model/zero3.py)
Core sharing (the cpu profile, cores_per_node < ranks per node, share = ranks / cores): op
times are at a dedicated core's speed; the step is the longer of the dedicated-core
pipeline below and every rank's CPU work over the cores, m * mean stage work * share plus
the critical stage's communication (a rank waiting in a bubble or a collective frees its
core); the optimizer runs on all ranks at once (x share).
A stage i of n_i layers (plus embedding on the first, head+loss on the last, and the
pipeline send/recv of b*s*h/t per chunk boundary, v per stage when interleaved) takes
T_i per microbatch. With m microbatches and v chunks per stage:
    pipeline  = m * max_i T_i + (sum_i T_i - max_i T_i) / v      (bubble: second term;
                gives (m + (p-1)/v) T for uniform stages: SC'21's bubble (p-1)/(v m))
    dp sync   = all-reduce (zero 0-1) of the stage's gradients once per step in buckets of
                dp_bucket_bytes (each pays the collective latencies), or reduce-scatter
                per microbatch (zero 2-3), at grad_reduce_bytes per element, hidden behind
                the last microbatch's backward (overlap_efficiency of the part that runs
                under it is hidden: NCCL kernels share SMs and HBM); zero 1-2
                all-gather updated weights after the step
    optimizer = local parameters * optimizer_bytes_per_param / achievable HBM bandwidth
    step      = pipeline + exposed dp sync + optimizer
Model FLOPs are the traced forward+backward FLOPs (attention counted as the full s x s
square, the convention of torchtitan, llm-foundry and Megatron); MFU divides them per
device per second by the dense peak.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from autopar.cluster import Cluster
from autopar.config import ParallelConfig, default_stage_layers
from cost_model.collectives import (
    AxisLink,
    all_gather_time_s,
    all_reduce_time_s,
    mesh_axis_links,
    reduce_scatter_time_s,
    send_recv_time_s,
)
from cost_model.compute import compute_time_s, gemm_time_s
from cost_model.efficiency import Efficiency, efficiency_for
from cost_model.estimate import Estimate
from cost_model.memory import BYTES_WEIGHT, stage_memory, stage_params
from cost_model.options import SELECTIVE_POLICIES, RuntimeOptions
from cost_model.profile import GraphProfile, OpItem, SegmentProfile
from cost_model.zero3 import zero3_layer_times, zero3_runtime


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


def price_profile(profile: GraphProfile, config: ParallelConfig, cluster: Cluster, *, global_batch: int,
                  stage_layers: tuple[int, ...] | None = None, zero3: str | None = None,
                  checkpoint_every: int | None = None, selective_policy: str | None = None,
                  options: RuntimeOptions | None = None, efficiency: Efficiency | None = None) -> Estimate:
    """Price one configuration from a precomputed profile (see module docstring).

    `options` (cost_model/options.py) describes what the runtime does where ParallelConfig
    leaves it open (ZeRO-3 runtime, per-layer checkpointing, selective policy, reduce
    dtype, torch.compile, async TP, DP buckets); `zero3`, `checkpoint_every` and
    `selective_policy` are shorthands that override the same fields. `efficiency`
    replaces the cost model's constants (the fit script passes candidates here); the
    hardware profile's overrides apply on top.
    """
    opts = options or RuntimeOptions()
    shorthand = {k: v for k, v in (("zero3", zero3), ("checkpoint_every", checkpoint_every),
                                   ("selective_policy", selective_policy)) if v is not None}
    if shorthand:
        if shorthand.get("selective_policy", "pointwise") not in SELECTIVE_POLICIES:
            raise ValueError(f"unknown selective_policy {shorthand['selective_policy']!r}; known: "
                             f"{', '.join(SELECTIVE_POLICIES)}")
        opts = replace(opts, **shorthand)
    m = config.check(global_batch=global_batch, num_devices=cluster.num_devices, heads=profile.heads,
                     kv_heads=profile.kv_heads, num_layers=profile.num_layers)
    p, t, d, v = config.pp, config.tp, config.dp, config.interleave
    if stage_layers is None:
        stage_layers = default_stage_layers(profile.num_layers, p)
    layerless = profile.num_layers == 0 and p == 1 and tuple(stage_layers) == (0,)  # one stage holds all
    if not layerless and (len(stage_layers) != p or sum(stage_layers) != profile.num_layers or min(stage_layers) < 1):
        raise ValueError(
            f"stage_layers {stage_layers} must have pp={p} positive entries summing to the model's "
            f"{profile.num_layers} layers"
        )
    hw = cluster.hardware
    eff = efficiency_for(hw, efficiency)
    pp_link, dp_link, tp_link = mesh_axis_links(cluster, (p, d, t), eff)
    k_ckpt = opts.checkpoint_every
    share = max(1.0, cluster.devices_per_node / hw.cores_per_node) if hw.cores_per_node else 1.0
    ctx = _Ctx(config=config, cluster=cluster, ratio=config.micro_batch / profile.batch, dtype=profile.dtype,
               dtype_bytes=profile.dtype_bytes, eff=eff,
               memory_scale=eff.compiled_memory_factor if opts.compiled else 1.0, dtensor=opts.dtensor_tp)
    layer = _segment_times(profile.layer, ctx, True, opts)
    pre = _segment_times(profile.pre, ctx, False, opts)
    post = _segment_times(profile.post, ctx, False, opts)

    # tensor-parallel collectives per layer per microbatch (Megatron: 2 per pass)
    stream_bytes = config.micro_batch * profile.seq * profile.hidden * profile.dtype_bytes
    if config.sequence_parallel:
        one = all_gather_time_s(stream_bytes, tp_link) + reduce_scatter_time_s(stream_bytes, tp_link)
    else:
        one = all_reduce_time_s(stream_bytes, tp_link)
    tp_exposed = 1 - (eff.async_tp_overlap if opts.async_tp else eff.tp_comm_overlap)
    tp_fwd = 2 * one * tp_exposed
    tp_bwd = 2 * one * tp_exposed + (tp_fwd / k_ckpt if config.recompute == "full" else 0.0)
    tp_edge = one if t > 1 else 0.0  # vocab-parallel embedding / head reductions, per pass

    # ZeRO-3: per layer gathers and gradient reduce-scatters as the runtime issues them (zero3.py)
    layer_params = profile.layer.params_split / t + profile.layer.params_replicated
    z3_rt = replace(zero3_runtime(opts.zero3), grad_reduce_bytes=opts.grad_reduce_bytes)
    z3_layer = zero3_layer_times(z3_rt, layer_params=layer_params,
                                 param_tensors=profile.layer.param_tensors, link=dp_link,
                                 forward_s=layer.forward_s, backward_s=layer.backward_s + layer.recompute_s,
                                 weight_bytes=BYTES_WEIGHT,
                                 recompute_share=1 / k_ckpt if config.recompute == "full" else 0.0,
                                 comm_overlap=hw.comm_overlap, efficiency=eff) if config.zero >= 3 else None
    z3_fwd = z3_layer.forward_exposed_s if z3_layer else 0.0
    z3_bwd = z3_layer.backward_exposed_s if z3_layer else 0.0

    # pipeline: blocking send/recv of the stage boundary activations (b*s*h/t per tp rank,
    # SC'21's scatter/gather), per microbatch and chunk boundary, forward and backward
    p2p = send_recv_time_s(stream_bytes / t, pp_link) if p > 1 else 0.0
    stage_totals, parts = [], []
    for i, n in enumerate(stage_layers):
        comp = n * (layer.forward_s + layer.backward_s)
        rec = n * layer.recompute_s
        tp_comm = n * (tp_fwd + tp_bwd)
        z3 = n * (z3_fwd + z3_bwd)
        if i == 0:
            comp += pre.forward_s + pre.backward_s
            tp_comm += 2 * tp_edge
        if i == p - 1:
            comp += post.forward_s + post.backward_s
            tp_comm += 2 * tp_edge
        pp_comm = 2 * p2p * v * (2 if 0 < i < p - 1 else 1) / 2 if p > 1 else 0.0
        parts.append((comp, rec, tp_comm, z3, pp_comm))
        stage_totals.append(comp + rec + tp_comm + z3 + pp_comm)
    crit = max(range(p), key=lambda i: stage_totals[i])
    t_max = stage_totals[crit]
    bubble = (sum(stage_totals) - t_max) / v
    comp, rec, tp_comm, z3, pp_comm = (m * x for x in parts[crit])
    pipeline = m * t_max + bubble
    if share > 1:
        # core sharing: ranks time-slice the cores, so the step is at least every rank's CPU
        # work over the cores (m * mean stage work * share, the communication of the
        # critical stage on top); a stage waiting in a pipeline bubble frees its core for
        # the others, so the bubble only counts where the dedicated-core schedule is longer
        mean_comp = statistics.fmean(x[0] for x in parts) * m * share
        mean_rec = statistics.fmean(x[1] for x in parts) * m * share
        shared = mean_comp + mean_rec + tp_comm + z3 + pp_comm
        if shared >= pipeline:
            comp, rec, bubble, pipeline = mean_comp, mean_rec, 0.0, shared

    # data-parallel gradient sync and optimizer on the critical stage
    psi = stage_params(profile, config, stage_layers[crit], crit == 0, crit == p - 1)
    last_bwd = stage_layers[crit] * (layer.backward_s + layer.recompute_s)
    # the share overlap_efficiency of the sync that runs under the last backward is hidden
    window = last_bwd if opts.overlap_grad_reduce else 0.0
    overlap = eff.overlap_efficiency * hw.comm_overlap
    grad_bytes = psi * opts.grad_reduce_bytes
    dp_sync = 0.0
    if d > 1:
        if config.zero <= 1:
            sync = _bucketed_all_reduce_s(grad_bytes, opts.dp_bucket_bytes, dp_link)
            dp_sync = sync - overlap * min(sync, window)
        elif config.zero == 2:
            # ZeRO-2 runs as FSDP2 without resharding after forward: one reduce-scatter and one
            # all-gather per module (each layer and the stage's root), each paying the latencies
            modules = stage_layers[crit] + 1
            sync = modules * reduce_scatter_time_s(grad_bytes / modules, dp_link)
            dp_sync = m * (sync - overlap * min(sync, window))
            dp_sync += modules * all_gather_time_s(psi * BYTES_WEIGHT / modules, dp_link)
        if config.zero == 1:
            dp_sync += all_gather_time_s(psi * BYTES_WEIGHT, dp_link)
        if z3_layer is not None:  # the first layer's gather before each forward cannot hide
            dp_sync = m * z3_layer.gather_s
    local = psi / (d if config.zero >= 1 else 1)
    optimizer = share * local * eff.optimizer_bytes_per_param / (hw.memory_bandwidth_bytes_per_s * eff.memory_efficiency)
    step = pipeline + dp_sync + optimizer

    tokens = global_batch * profile.seq
    model_flops = profile.model_flops_per_step * global_batch / profile.batch
    rec_flops = 0.0
    if config.recompute == "full":
        rec_flops = profile.layer_forward_flops * profile.num_layers * global_batch / profile.batch / k_ckpt
    devices = cluster.num_devices
    model_tflops = model_flops / step / devices / 1e12
    peak = hw.peak_flops(profile.dtype)

    mems = [stage_memory(profile, config, stage=i, layers=n, num_microbatches=m, checkpoint_every=k_ckpt)
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
            ("compute_s", comp), ("recompute_s", rec), ("comm_tp_s", tp_comm), ("comm_pp_s", pp_comm),
            ("comm_zero3_s", z3), ("comm_dp_s", dp_sync), ("bubble_s", bubble), ("optimizer_s", optimizer),
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


__all__ = ["AxisLink", "SELECTIVE_POLICIES", "default_stage_layers", "price_profile"]
