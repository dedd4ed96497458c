"""A closed-form stand-in cost model for the template grid search: a test oracle.

Where it sits: tests/, beside the tests that use it (tests/unit/test_template_search.py);
no product module imports it. The template grid (benchmarks/baselines/template/search.py)
prices candidates through a `PriceFn` callable; the real one is the baseline's
`analytic.price` (benchmarks/baselines/analytic/; graph-derived). This toy exists so the
search can be tested against brute force with a cost that is cheap, fully known and
independent of the real model. It is NOT the project's prediction of record.

Math (textbook formulas from notes/cost-model-facts.md; b micro-batch, s seq, h hidden,
t/p/d the tp/pp/dp degrees, m microbatches, v interleave, P parameters):

    stage time per microbatch  t_k = F_k * b / (t * peak * EFFICIENCY) + tp_comm + pp_p2p
        tp_comm  = (4 all-reduces fwd+bwd, 6 with full recompute) * 2(t-1)/t * b*s*h*2 B / bw_tp
        pp_p2p   = 2 * b*s*h*2 B / t / bw_pp                      (activation out, gradient in)
    pipeline   = (m + (p - 1) / v) * max_k t_k                    (bubble (p-1)/(v m))
    dp sync    = 2 * (d-1)/d * P_stage/t * 2 B / bw_dp             (zero 0/1, once per step)
               + zero 2: gradients reduce-scattered once per microbatch (m x half the volume)
               + zero 3: parameters all-gathered in forward and backward of every microbatch
    optimizer  = 16 B * P_stage/t / shards / HBM bandwidth
    memory     = P_stage/t * (16 | 4 + 12/d | 2 + 14/d | 16/d)  (ZeRO 0..3)
               + per layer activations s*b*h*(34/t) (none), 2*s*b*h/t... (selective: 34/t
                 without attention scores; full: 2*s*b*h only) times microbatches in flight
                 (1f1b: min(p - k, m); gpipe: m; interleaved: p*(1 + (p-1)/(p v)))
               + logits 4*s*b*V/t on the last stage
"""

from __future__ import annotations

from autopar.cluster import Cluster
from autopar.config import ParallelConfig, default_stage_layers
from autopar.ir import Graph
from cost_model import state_bytes_per_param
from autopar.estimate import Estimate
from benchmarks.baselines.template.inter_op import StageWork, stage_work

EFFICIENCY = 0.5
"""Fraction of dense peak that layer compute reaches in the toy (one global factor)."""
BF16_BYTES = 2


def _inflight(schedule: str, pp: int, stage: int, m: int, v: int) -> float:
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved":
        return min(float(m), pp * (1 + (pp - 1) / (pp * v)))
    return float(min(pp - stage, m))


def toy_price(graph: Graph, config: ParallelConfig, cluster: Cluster, *, global_batch: int,
              stage_layers: tuple[int, ...] | None = None, work: StageWork | None = None) -> Estimate:
    """Price one configuration with the closed forms of the module docstring."""
    c = config
    info = graph.model
    m = c.check(global_batch=global_batch, num_devices=cluster.num_devices, heads=info.heads,
                kv_heads=info.kv_heads, num_layers=info.num_layers)
    work = work or stage_work(graph)
    cuts = stage_layers or default_stage_layers(info.num_layers, c.pp)
    hw = cluster.hardware
    s, h, b, t, p, d, v = info.seq, max(info.hidden, 1), c.micro_batch, c.tp, c.pp, c.dp, c.interleave
    peak = hw.peak_flops(info.dtype)
    intra, inter = hw.intra_node_bandwidth_bytes_per_s, hw.inter_node_bandwidth_bytes_per_s
    tp_bw = intra if t <= cluster.devices_per_node else inter
    dp_bw = intra if t * d <= cluster.devices_per_node else inter
    act_bytes = s * b * h * BF16_BYTES

    tp_comm = (6 if c.recompute == "full" else 4) * 2 * (t - 1) / t * act_bytes / tp_bw if t > 1 else 0.0
    pp_p2p = 2 * act_bytes / t / inter * v if p > 1 else 0.0
    stage_times = [work.stage_flops(cuts, k, c.recompute) * b / (t * peak * EFFICIENCY)
                   + cuts[k] * tp_comm / 1 + pp_p2p for k in range(p)]
    compute = max(stage_times) * m
    bubble = max(stage_times) * (p - 1) / v

    stage_params = max(work.stage_params(cuts, k) for k in range(p)) / t
    ring = 2 * (d - 1) / d if d > 1 else 0.0
    grad_bytes = stage_params * BF16_BYTES
    dp_sync = ring * grad_bytes / dp_bw
    if c.zero == 2 and m > 1:
        dp_sync += (m - 1) * ring / 2 * grad_bytes / dp_bw  # gradients re-reduced per microbatch
    if c.zero == 3:
        dp_sync += m * 2 * ring / 2 * grad_bytes / dp_bw   # all-gather params fwd + bwd per microbatch
    shards = d if c.zero >= 1 else 1
    optimizer = 16 * stage_params / shards / hw.memory_bandwidth_bytes_per_s
    step = compute + bubble + dp_sync + optimizer

    state_per_param = state_bytes_per_param(c.zero, d)
    per_layer_act = {"none": 34.0 / t + (5 * info.heads * s / (h * t) if c.attention == "math" else 0.0),
                     "selective": 34.0 / t, "full": 2.0}[c.recompute] * s * b * h
    mem_by_stage = []
    for k in range(p):
        layers_on_rank = cuts[k]
        act = per_layer_act * layers_on_rank * _inflight(c.schedule, p, k, m, v)
        if c.recompute == "full":  # one layer's full activations live during its recompute
            act += 34.0 / t * s * b * h
        logits = 4 * s * b * info.vocab / t if k == p - 1 else 0
        state = work.stage_params(cuts, k) / t * state_per_param
        mem_by_stage.append((state + act + logits, state, act, logits))
    peak_mem, state, act, logits = max(mem_by_stage)
    tokens = global_batch * s
    model_flops = (work.num_layers * work.layer_flops + work.pre_flops + work.post_flops) * global_batch
    tflops = model_flops / step / cluster.num_devices / 1e12
    return Estimate(  # the real model's result type, so the search treats both alike
        step_time_s=step, tokens_per_s=tokens / step, tokens_per_s_per_device=tokens / step / cluster.num_devices,
        model_tflops_per_device=tflops, mfu=tflops * 1e12 / peak, peak_memory_bytes=int(peak_mem),
        fits=peak_mem <= cluster.device_memory_bytes, memory_limit_bytes=cluster.device_memory_bytes,
        time_breakdown=(("bubble", bubble), ("compute", compute), ("dp", dp_sync), ("optimizer", optimizer)),
        memory_breakdown=(("activations", int(act)), ("logits", int(logits)), ("model_state", int(state))),
        config=tuple(sorted({**c.to_json(), "num_microbatches": m}.items())),
    )
