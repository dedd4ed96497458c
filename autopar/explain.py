"""The text of `autopar explain`: a saved plan's decisions and their costs, for people.

Where it sits: beside autopar/plan.py, which it renders (`Plan.explain()` calls
`explain_plan`); it reads only the plan's fields, so every decision can be explained from
the plan file alone. `describe_config` is the one-line configuration label that the search
tables and the benchmarks share.

Terms as in autopar/plan.py: a *stage* is one pipeline rank's contiguous run of layers, a
*chunk* one of a stage's model pieces (several per stage under the interleaved schedule), a
*layer group* a set of parameters named alike (embedding, attention, MLP, norms, head).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from autopar import units
from autopar.config import ParallelConfig
from autopar.sharding import UPDATE_SEPARATOR
from autopar.units import GIB

if TYPE_CHECKING:  # the types rendered; plan.py imports this module to explain itself
    from autopar.plan import PipelineInfo, Plan, StageInfo


def explain_plan(plan: Plan) -> str:
    """Per stage and layer group: what was chosen and why (costs), from the plan alone."""
    c, p = plan.config, plan.predicted
    m = plan.num_microbatches
    lines = [
        f"plan for {plan.model} on {plan.cluster} (global batch {plan.global_batch} x seq {plan.seq}, "
        f"{plan.memory_limit_bytes / GIB:.1f} GiB/device budget)",
        f"mesh (pp, dp, tp) = ({c.pp}, {c.dp}, {c.tp}); tp inside a node, dp then pp across nodes",
        f"config: zero {c.zero}, micro-batch {c.micro_batch} x {m} microbatches, schedule {c.schedule}"
        + (f" (v={c.interleave})" if c.schedule == "interleaved" else "")
        + f", recompute {c.recompute}, attention {c.attention}, sequence parallel {c.sequence_parallel}, "
        f"precision {c.resolved(plan.cluster.split(':')[0]).policy().name}"
        + (", compiled by Inductor (memory-bound ops priced fused)" if c.compiled else ""),
        f"predicted: step {p.step_time_s:.4g} s, {p.tokens_per_s:,.0f} tokens/s "
        f"({p.tokens_per_s_per_device:,.0f}/device), MFU {p.mfu:.1%}, peak {p.peak_memory_bytes / GIB:.2f} GiB "
        f"({'fits' if p.fits else 'DOES NOT FIT'}), bubble {plan.bubble_fraction:.1%}",
    ]
    if p.time_breakdown:
        total = sum(v for _, v in p.time_breakdown) or 1.0
        lines.append("  time:   " + ", ".join(f"{k} {v:.4g} s ({v / total:.0%})" for k, v in p.time_breakdown))
    if p.memory_breakdown:
        lines.append("  memory: " + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in p.memory_breakdown))
    if c.pp == 1 and plan.placements:
        lines.extend(_per_op_lines(plan))
    if plan.pipeline is not None and len(plan.stages) > 1:
        lines.extend(_pipeline_lines(plan.pipeline, plan.stages))
    if c.pp > 1:
        lines.extend(_stage_placement_lines(plan))
    lines.append("stages:")
    counted = plan.stages if plan.pipeline is None else ()  # the template search's: FLOPs and parameters
    if plan.pipeline is not None and len(plan.stages) > 1:
        lines.append("  see the pipeline stages above")
    elif not counted and c.pp > 1:
        lines.append(f"  {c.pp} stages of {list(plan.stage_layers)} layers (the first also holds the embedding, "
                     "the last the head and loss)")
    elif not counted:
        held = f"{plan.num_layers} repeated layers" if plan.num_layers else "every module, no repeated layer stack"
        lines.append(f"  one stage: the whole model ({held}) on the (dp, tp) mesh")
    for s in counted:
        holds = [f"layers {s.first_layer}-{s.first_layer + s.num_layers - 1} ({s.num_layers})" if s.num_layers
                 else "every module (no repeated layer stack)"]
        if s.has_embedding:
            holds.insert(0, "embedding")
        if s.has_head:
            holds.append("final norm + head + loss")
        lines.append(f"  stage {s.index}: {', '.join(holds)}; {units.flops(s.flops_per_microbatch)}/microbatch, "
                     f"{units.count(s.num_parameters)} params, ~{s.memory_bytes / GIB:.2f} GiB/device")
    if len(set(plan.stage_layers)) > 1:
        lines.append("  why non-uniform: the cut balances per-stage time (embedding and head are extra work "
                     "on the end stages) and memory (stage 0 keeps the most microbatches in flight)")
    s = plan.search
    lines.append(
        f"search ({s.cost_model}): {s.num_candidates} candidates, {s.num_priced} priced, "
        f"{s.num_pruned_memory} pruned by memory bound, {s.num_pruned_dominated} dominated, "
        f"{s.num_not_fitting} priced but over the memory budget"
        + ("" if s.complete else "; STOPPED by the time limit, the space was not fully searched"))
    if plan.pipeline is not None and plan.pipeline.runners_up:
        lines.append("why the runners-up lost (priced by the same ILP stage costs):")
        for label, step, why in plan.pipeline.runners_up:
            lines.append(f"  {label}: step {step:.4g} s, {why}")
    elif s.alternatives:
        lines.append("runners-up (why not these):")
        for a in s.alternatives:
            rel = a.step_time_s / p.step_time_s - 1 if p.step_time_s else 0.0
            lines.append(f"  {describe_config(a.config, a.stage_layers, plan.global_batch)}: step "
                         f"{a.step_time_s:.4g} s ({rel:+.1%}), peak {a.peak_memory_bytes / GIB:.2f} GiB")
    return "\n".join(lines)


def _per_op_lines(plan: Plan) -> list[str]:
    info = plan.intra_op_info
    lines = [f"per-op placements (the program that runs): {len(plan.chunk_placements(0))} ops chosen by the "
             "intra-op ILP"]
    if info is None:
        return lines
    lines[0] += (f", {info.status}" + (" (STOPPED by the time limit: feasible, not proven optimal)"
                                      if info.status == "time_limit" else ""))
    lines.append(f"  coverage: {info.coverage:.1%} of the step's FLOPs in ops with a sharded strategy"
                 + (f"; replicated for lack of a strategy: {', '.join(info.fallback_ops)}" if info.fallback_ops else ""))
    if info.time_s:
        lines.append("  ILP per step: " + ", ".join(f"{k} {v:.4g}" for k, v in info.time_s))
    if info.collectives:
        lines.append("  collectives per step: " + ", ".join(
            f"{kind} over {axis} x{n} ({b / 2**20:.2f} MiB)" for kind, axis, n, b in info.collectives))
    else:
        lines.append("  collectives per step: none (every rank computes the whole step)")
    if info.parameters:
        moves = any(kind == "all_to_all" and axis == "dp" for kind, axis, *_ in info.collectives)
        lines.append("  per layer group: " + "; ".join(summarize_placements(info.parameters,
                                                                             tokens_move_over_dp=moves)))
        lines.append("  parameters (dp, tp), with their weight-update placement where it differs:")
        lines.extend(f"    {name}: {placement}" for name, placement in info.parameters)
    return lines


_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("norms", ("norm", "ln_", ".ln")),
    ("embedding", ("embed", "wte", "wpe", "tok_")),
    ("head", ("lm_head", "output.", "head")),
    ("attention", ("attn", "attention", "q_proj", "k_proj", "v_proj", "o_proj")),
    ("routed experts", ("moe.w1", "moe.w2", "moe.w3")),  # the zoo MoE's stacked [E, d, f] weights
    ("MLP", ("mlp", "feed_forward", "ffn", "fc", "gate_proj", "up_proj", "down_proj")),
)


def _tp_words(group: str, name: str, tp: str) -> str:
    if tp == "R":
        return "replicated over tp"
    if group == "embedding":
        return {"S(0)": "vocab over tp", "S(1)": "hidden over tp"}.get(tp, f"{tp} over tp")
    if group == "head":
        return {"S(0)": "vocab over tp (vocab-parallel)", "S(1)": "hidden over tp"}.get(tp, f"{tp} over tp")
    if group == "routed experts":  # [E, d, f]: dim 0 is the expert
        return "experts over tp (E split: expert parallelism)" if tp == "S(0)" else f"{tp} over tp (inside each expert)"
    if group == "attention":
        return {"S(0)": "heads over tp (column)", "S(1)": "heads over tp (row)"}.get(tp, f"{tp} over tp")
    return {"S(0)": "column over tp", "S(1)": "row over tp"}.get(tp, f"{tp} over tp")


def placement_axes(text: str) -> list[str]:
    """The per-axis entries of a placement text: "(R, S(0))" -> ["R", "S(0)"]."""
    inner = text.strip()
    if inner.startswith("(") and inner.endswith(")"):
        inner = inner[1:-1]
    return [p.strip() for p in inner.split(",")]


def summarize_placements(params: Sequence[tuple[str, str]], *, tokens_move_over_dp: bool = False) -> list[str]:
    """One line per layer group (embedding, attention, MLP, norms, head, other): how its
    parameters sit on the (dp, tp) mesh, e.g. "MLP: column/row over tp; replicated over dp", or
    "...; weights replicated over dp, update S(0) over dp (ZeRO-1)" where the weight update
    is sharded (a placement text "compute update update-placement",
    autopar.sharding.parameter_placement_text). Routed experts split on E over dp are
    expert parallelism where `tokens_move_over_dp` (the stage runs all-to-alls over dp),
    else ZeRO-3 storage."""
    found: dict[str, list[tuple[str, str, str]]] = {}
    for name, text in params:
        compute, _, update = text.partition(UPDATE_SEPARATOR)
        dp, tp = (placement_axes(compute) + ["R", "R"])[:2]
        update_dp = (placement_axes(update) + ["R"])[0] if update else dp
        low = name.lower()
        group = next((g for g, keys in _GROUPS if any(k in low for k in keys)), "other")
        if dp == "R" and update_dp != "R":
            dp = f"weights replicated over dp, update {update_dp} over dp (ZeRO-1)"
        elif dp == "S(0)" and group == "routed experts" and tokens_move_over_dp:
            dp = "S(0) over dp (expert parallelism: tokens sent to their experts by all-to-all)"
        elif dp != "R":
            dp = f"{dp} over dp (sharded: ZeRO-3)"
        else:
            dp = "replicated over dp"
        found.setdefault(group, []).append((name, dp, tp))
    out = []
    for group in [g for g, _ in _GROUPS] + ["other"]:
        if group not in found:
            continue
        rows = found[group]
        tp_desc = list(dict.fromkeys(_tp_words(group, n, tp) for n, _, tp in rows))
        dp_desc = list(dict.fromkeys(dp for _, dp, _ in rows))
        if len(tp_desc) > 1 and all("over tp" in d and "replicated" not in d for d in tp_desc) and group == "MLP":
            tp_text = "column/row over tp"
        else:
            tp_text = " / ".join(tp_desc)
        out.append(f"{group} ({len(rows)} params): {tp_text}; {' / '.join(dp_desc)}")
    return out


def _stage_placement_lines(plan: Plan) -> list[str]:
    if not plan.placements:
        return ["per-stage per-op placements: not in this plan (a file from before version 4, or a model the search "
                "did not trace by chunks); every run solves each chunk's intra-op ILP under the configuration's "
                "rules before its ranks build (same solver, so the same program; re-run `autopar search` to record "
                "them)"]
    lines = [f"per-stage per-op placements (the program each stage runs, replayed at build): "
             f"{len(plan.placements)} chunks"]
    for s in plan.placements:
        lines.append(f"  chunk {s.chunk} (stage {s.chunk % plan.config.pp}): {len(s.placements)} ops; collectives per "
                     "step: " + (", ".join(f"{kind} over {axis} x{n} ({b / 2**20:.2f} MiB)"
                                           for kind, axis, n, b in s.collectives) or "none"))
    return lines


def _pipeline_lines(pipe: PipelineInfo, stages: Sequence[StageInfo]) -> list[str]:
    sched = pipe.schedule + (f" (v={pipe.chunks})" if pipe.schedule == "interleaved" else "")
    lines = [f"pipeline: {len(stages)} stages, schedule {sched}, {pipe.num_microbatches} microbatches of "
             f"{pipe.microbatch} sequences; bubble {pipe.bubble_s:.4g} s, p2p on the critical stage {pipe.p2p_s:.4g} s "
             "per step"]
    for st in stages:
        holds = ([f"embedding"] if st.has_embedding else []) + [
            f"layers {st.first_layer}-{st.first_layer + st.num_layers - 1} ({st.num_layers})"] + (
            ["final norm + head + loss"] if st.has_head else [])
        lines.append(f"  stage {st.index}: {', '.join(holds)} on submesh (dp, tp) = {st.submesh}, recompute "
                     f"{st.recompute}, zero {st.zero}: {st.time_per_microbatch_s:.4g} s/microbatch, "
                     f"{st.memory_bytes / GIB:.2f} GiB/device with {st.inflight_microbatches:g} microbatches in flight")
        moves = any(kind == "all_to_all" and axis == "dp" for kind, axis, *_ in st.collectives)
        lines.extend(f"    {line}" for line in summarize_placements(st.placements, tokens_move_over_dp=moves))
        if st.collectives:
            lines.append("    collectives per microbatch: " + ", ".join(
                f"{kind} over {axis} x{n} ({b / 2**20:.2f} MiB)" for kind, axis, n, b in st.collectives))
    return lines


def describe_config(config: ParallelConfig, stage_layers: Sequence[int], global_batch: int) -> str:
    """One-line summary used in tables and explain output."""
    c = config
    m = global_batch // (c.dp * c.micro_batch)
    sched = f"{c.schedule}" + (f"/v{c.interleave}" if c.schedule == "interleaved" else "")
    cuts = "" if len(set(stage_layers)) <= 1 else " cuts " + "/".join(str(n) for n in stage_layers)
    return (f"tp{c.tp} pp{c.pp} dp{c.dp} z{c.zero} mb{c.micro_batch}x{m} "
            f"{sched if c.pp > 1 else 'no-pp'} rc-{c.recompute}{cuts}")
