"""Step time, throughput and memory of one full parallel configuration.

Where it sits: cost_model/; `price_profile(profile, config, cluster, global_batch=...)`
is what `autopar price` and the whole-plan search call (thousands of times: a few ms).

Math. Mesh (pp, dp, tp), tp fastest over device ids (Megatron's order), so tp sits in a
node when tp <= devices per node. Per microbatch (b sequences, r = b / traced batch)
and per layer, with t = tp:
    compute  F, B   = sum over the layer's forward / backward ops of compute_time_s at
                      r/t of their FLOPs and bytes (residual-stream ops r/1 without
                      sequence parallelism); pointwise bytes times POINTWISE_FUSION_FACTOR
    recompute R     = F / k (full; k = checkpoint_every, 1 by default) | the recomputable
                      ops' forward time, plus every second GEMM under "alternate-mm"
                      (selective) | 0
    tp comm         2 all-reduces (or reduce-scatter + all-gather with SP) of b*s*h in
                    the forward, 2 in the backward, 2 more when the forward is recomputed
    zero-3          all-gather the layer's weights before forward and backward, reduce-
                    scatter its gradients after backward, as the runtime issues them
                    (granularity, prefetch window, overlap: cost_model/zero3.py)
A stage i of n_i layers (plus embedding on the first, head+loss on the last, and the
pipeline send/recv of b*s*h/t per chunk boundary, v per stage when interleaved) takes
T_i per microbatch. With m microbatches and v chunks per stage:
    pipeline  = m * max_i T_i + (sum_i T_i - max_i T_i) / v      (bubble: second term;
                gives (m + (p-1)/v) T for uniform stages: SC'21's bubble (p-1)/(v m))
    dp sync   = all-reduce (zero 0-1) of the stage's gradients once per step, or
                reduce-scatter per microbatch (zero 2-3), hidden behind the last
                microbatch's backward up to OVERLAP_EFFICIENCY; zero 1-2 all-gather
                updated weights after the step
    optimizer = local parameters * OPTIMIZER_BYTES_PER_PARAM / achievable HBM bandwidth
    step      = pipeline + exposed dp sync + optimizer
Model FLOPs are the traced forward+backward FLOPs (attention counted as the full s x s
square, the convention of torchtitan, llm-foundry and Megatron); MFU divides them per
device per second by the dense peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from cost_model.collectives import (
    AxisLink,
    all_gather_time_s,
    all_reduce_time_s,
    mesh_axis_links,
    reduce_scatter_time_s,
    send_recv_time_s,
)
from cost_model.compute import compute_time_s
from cost_model.efficiency import (
    MATH_ATTENTION_PASSES,
    MEMORY_EFFICIENCY,
    OPTIMIZER_BYTES_PER_PARAM,
    OVERLAP_EFFICIENCY,
    POINTWISE_FUSION_FACTOR,
    TP_COMM_OVERLAP,
)
from cost_model.estimate import Estimate
from cost_model.memory import BYTES_GRAD, BYTES_WEIGHT, stage_memory, stage_params
from cost_model.profile import GraphProfile, OpItem, SegmentProfile
from cost_model.zero3 import Zero3Runtime, zero3_layer_times, zero3_runtime

SELECTIVE_POLICIES = ("pointwise", "alternate-mm")

MATH_FORWARD_PASSES = 4.0
"""Of MATH_ATTENTION_PASSES, the forward's share (write, softmax read+write, read)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _SegTimes:
    forward_s: float
    backward_s: float
    recompute_s: float


def _items_time(items: tuple[OpItem, ...], config: ParallelConfig, cluster: Cluster, ratio: float,
                dtype: str, dtype_bytes: int, phase: str | None) -> float:
    hw = cluster.hardware
    t = config.tp
    total = 0.0
    for it in items:
        if phase is not None and it.phase != phase:
            continue
        div = t if (not it.stream or config.sequence_parallel) else 1
        flops = it.flops * ratio / div
        moved = ((it.bytes_moved - it.fixed_bytes) * ratio + it.fixed_bytes) / div
        if it.op_class == "memory":
            # fused stacks move a fraction of the op-by-op bytes in a fraction of the kernels
            total += it.weight * POINTWISE_FUSION_FACTOR * compute_time_s(0.0, moved, hw, dtype)
        elif it.op_class == "attention" and config.attention == "math":
            share = MATH_FORWARD_PASSES if it.phase == "forward" else MATH_ATTENTION_PASSES - MATH_FORWARD_PASSES
            scores = it.score_elems * ratio / t * dtype_bytes * share
            total += it.weight * (compute_time_s(flops, 0.0, hw, dtype, op_class="gemm")
                                  + scores / (hw.memory_bandwidth_bytes_per_s * MEMORY_EFFICIENCY))
        else:
            total += it.weight * compute_time_s(flops, moved, hw, dtype, op_class=it.op_class, causal=it.causal)
    return total


def _segment_times(seg: SegmentProfile, config: ParallelConfig, cluster: Cluster, ratio: float,
                   profile: GraphProfile, recompute: bool, checkpoint_every: int = 1,
                   selective_policy: str = "pointwise") -> _SegTimes:
    args = (config, cluster, ratio, profile.dtype, profile.dtype_bytes)
    fwd = _items_time(seg.items, *args, "forward")
    bwd = _items_time(seg.items, *args, "backward")
    rec = 0.0
    if recompute and config.recompute == "full":
        rec = fwd / checkpoint_every  # the average layer: 1 in k re-runs its forward
    elif recompute and config.recompute == "selective":
        rec = _items_time(seg.recompute_items, *args, "forward")
        if selective_policy == "alternate-mm":
            rec += _items_time(seg.alternate_gemm_items, *args, "forward")
        if config.attention == "math":  # Korthikanti's selective recompute: the attention core
            rec += _items_time(tuple(i for i in seg.items if i.op_class == "attention"), *args, "forward")
    return _SegTimes(forward_s=fwd, backward_s=bwd, recompute_s=rec)


def default_stage_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    base, extra = divmod(num_layers, pp)
    return tuple(base + (1 if i < extra else 0) for i in range(pp))


def price_profile(profile: GraphProfile, config: ParallelConfig, cluster: Cluster, *, global_batch: int,
                  stage_layers: tuple[int, ...] | None = None, zero3: str | Zero3Runtime = "fsdp",
                  checkpoint_every: int = 1, selective_policy: str = "pointwise") -> Estimate:
    """Price one configuration from a precomputed profile (see module docstring).

    Keyword options describe what the runtime does where ParallelConfig leaves it open:
    `zero3` names the sharded-parameter runtime ("fsdp" or "deepspeed-2021", zero3.py);
    `checkpoint_every` = k with recompute "full" checkpoints only every k-th layer
    (torchtitan's per-layer selective AC, `selective_ac_option = k`), the others keep
    all their activations; `selective_policy` with recompute "selective" is "pointwise"
    (re-run memory-bound ops: norms, activation functions) or "alternate-mm" (torchtitan's
    per-op policy: also re-run every second matmul of each layer).
    """
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be a positive integer (checkpoint every k-th layer), "
                         f"got {checkpoint_every}")
    if selective_policy not in SELECTIVE_POLICIES:
        raise ValueError(f"unknown selective_policy {selective_policy!r}; known: {', '.join(SELECTIVE_POLICIES)}")
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
    pp_link, dp_link, tp_link = mesh_axis_links(cluster, (p, d, t))
    ratio = config.micro_batch / profile.batch
    hw = cluster.hardware
    layer = _segment_times(profile.layer, config, cluster, ratio, profile, recompute=True,
                           checkpoint_every=checkpoint_every, selective_policy=selective_policy)
    pre = _segment_times(profile.pre, config, cluster, ratio, profile, recompute=False)
    post = _segment_times(profile.post, config, cluster, ratio, profile, recompute=False)

    # tensor-parallel collectives per layer per microbatch (Megatron: 2 per pass)
    stream_bytes = config.micro_batch * profile.seq * profile.hidden * profile.dtype_bytes
    if config.sequence_parallel:
        one = all_gather_time_s(stream_bytes, tp_link) + reduce_scatter_time_s(stream_bytes, tp_link)
    else:
        one = all_reduce_time_s(stream_bytes, tp_link)
    tp_fwd = 2 * one * (1 - TP_COMM_OVERLAP)
    tp_bwd = 2 * one * (1 - TP_COMM_OVERLAP) + (tp_fwd / checkpoint_every if config.recompute == "full" else 0.0)
    tp_edge = one if t > 1 else 0.0  # vocab-parallel embedding / head reductions, per pass

    # ZeRO-3: per layer gathers and gradient reduce-scatters as the runtime issues them (zero3.py)
    layer_params = profile.layer.params_split / t + profile.layer.params_replicated
    z3_layer = zero3_layer_times(zero3_runtime(zero3), layer_params=layer_params,
                                 param_tensors=profile.layer.param_tensors, link=dp_link,
                                 forward_s=layer.forward_s, backward_s=layer.backward_s + layer.recompute_s,
                                 weight_bytes=BYTES_WEIGHT,
                                 recompute_share=1 / checkpoint_every if config.recompute == "full" else 0.0,
                                 comm_overlap=hw.comm_overlap) if config.zero >= 3 else None
    z3_fwd = z3_layer.forward_exposed_s if z3_layer else 0.0
    z3_bwd = z3_layer.backward_exposed_s if z3_layer else 0.0

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

    # data-parallel gradient sync and optimizer on the critical stage
    psi = stage_params(profile, config, stage_layers[crit], crit == 0, crit == p - 1)
    last_bwd = stage_layers[crit] * (layer.backward_s + layer.recompute_s)
    dp_sync = 0.0
    if d > 1:
        if config.zero <= 1:
            grads = psi * BYTES_GRAD
            sync = all_reduce_time_s(grads, dp_link)
            dp_sync = max(0.0, sync - OVERLAP_EFFICIENCY * hw.comm_overlap * last_bwd)
        elif config.zero == 2:
            # ZeRO-2 runs as FSDP2 without resharding after forward: one reduce-scatter and one
            # all-gather per module (each layer and the stage's root), each paying the ring latency
            modules = stage_layers[crit] + 1
            sync = modules * reduce_scatter_time_s(psi * BYTES_GRAD / modules, dp_link)
            dp_sync = m * max(0.0, sync - OVERLAP_EFFICIENCY * hw.comm_overlap * last_bwd)
            dp_sync += modules * all_gather_time_s(psi * BYTES_WEIGHT / modules, dp_link)
        if config.zero == 1:
            dp_sync += all_gather_time_s(psi * BYTES_WEIGHT, dp_link)
        if z3_layer is not None:  # the first layer's gather before each forward cannot hide
            dp_sync = m * z3_layer.gather_s
    local = psi / (d if config.zero >= 1 else 1)
    optimizer = local * OPTIMIZER_BYTES_PER_PARAM / (hw.memory_bandwidth_bytes_per_s * MEMORY_EFFICIENCY)
    step = m * t_max + bubble + dp_sync + optimizer

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


__all__ = ["AxisLink", "default_stage_layers", "price_profile"]
