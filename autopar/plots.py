"""Pipeline schedule timelines and memory breakdowns, as data and as matplotlib figures.

Where it sits: read-only over a Plan (autopar/plan.py) or any per-stage times; used by
`autopar explain plan.json --plot out.png` and benchmarks/run_all.py. The timeline is pure
data (no matplotlib needed to compute it, so tests check it directly).

Timeline model. Stage s (pp rank s) runs its operations in the order the schedule gives
and starts each one when (a) the stage is free and (b) its input exists:
    F(c, i) needs F(c-1, i) done        (activations of microbatch i from the previous chunk)
    B(c, i) needs B(c+1, i) done        (gradients from the next chunk; the last chunk's
                                         backward needs its own forward)
where c is the virtual stage (chunk k of pp rank r is c = k * pp + r, Megatron's
interleaving). Orders: gpipe = all forwards, then all backwards; 1f1b = pp - s - 1 warm-up
forwards, then one forward / one backward, then the remaining backwards; interleaved
(v chunks) = Megatron's interleaved 1F1B (warm-up (pp - s - 1) * 2 + (v - 1) * pp chunk
forwards, microbatches taken in groups of pp per chunk). With equal stage times f, b and
m microbatches, 1F1B's makespan is (m + pp - 1)(f + b) and each stage idles for the
bubble (pp - 1)(f + b): a bubble fraction (pp - 1) / (m + pp - 1) of the makespan.

Per-stage times from a plan file alone: the critical stage's per-microbatch time is the
prediction's compute + recompute + tp/pp/zero-3 communication over m microbatches; other
stages scale by their FLOPs; forward : backward = 1 : 2 (the backward's FLOPs), recompute
added to the backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from autopar.plan import Plan

GIB = 1024**3
FORWARD_SHARE = 1 / 3
"""Forward share of a layer's forward+backward compute (backward does twice the FLOPs)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Box:
    stage: int
    """Pipeline rank."""
    chunk: int
    """Virtual stage (chunk index over the whole model)."""
    microbatch: int
    kind: str
    """"F" (forward) or "B" (backward)."""
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    boxes: tuple[Box, ...]
    pp: int

    @property
    def makespan_s(self) -> float:
        return max(b.end_s for b in self.boxes) - min(b.start_s for b in self.boxes)

    def busy_s(self, stage: int) -> float:
        return sum(b.end_s - b.start_s for b in self.boxes if b.stage == stage)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the makespan, averaged over stages."""
        span = self.makespan_s
        return sum(span - self.busy_s(s) for s in range(self.pp)) / (self.pp * span)


def stage_order(schedule: str, pp: int, stage: int, num_microbatches: int,
                interleave: int = 1) -> list[tuple[str, int, int]]:
    """The (kind, chunk, microbatch) sequence pipeline rank `stage` runs."""
    m, v = num_microbatches, interleave
    if schedule == "gpipe":
        return [("F", stage, i) for i in range(m)] + [("B", stage, i) for i in range(m)]
    if schedule == "1f1b":
        warm = min(pp - stage - 1, m)
        order = [("F", stage, i) for i in range(warm)]
        for i in range(m - warm):
            order += [("F", stage, warm + i), ("B", stage, i)]
        return order + [("B", stage, i) for i in range(m - warm, m)]
    if schedule == "interleaved":
        if m % pp:
            raise ValueError(f"interleaved 1F1B needs microbatches ({m}) to be a multiple of pp ({pp})")
        total = m * v

        def unit(k: int, forward: bool) -> tuple[int, int]:
            group, pos = divmod(k, pp * v)
            local = pos // pp
            chunk_local = local if forward else v - 1 - local
            return chunk_local * pp + stage, group * pp + pos % pp

        warm = min((pp - stage - 1) * 2 + (v - 1) * pp, total)
        order = [("F", *unit(k, True)) for k in range(warm)]
        for k in range(total - warm):
            order += [("F", *unit(warm + k, True)), ("B", *unit(k, False))]
        return order + [("B", *unit(k, False)) for k in range(total - warm, total)]
    raise ValueError(f"schedule must be gpipe, 1f1b or interleaved, got {schedule!r}")


def pipeline_timeline(schedule: str, pp: int, num_microbatches: int, forward_s: Sequence[float],
                      backward_s: Sequence[float], interleave: int = 1) -> Timeline:
    """Simulate the schedule. `forward_s[s]` / `backward_s[s]`: one microbatch through pipeline
    rank s (all its chunks); each of its `interleave` chunks takes 1/interleave of that."""
    if len(forward_s) != pp or len(backward_s) != pp:
        raise ValueError(f"need {pp} per-stage forward and backward times, got {len(forward_s)}/{len(backward_s)}")
    v = interleave
    last = pp * v - 1
    orders = [stage_order(schedule, pp, s, num_microbatches, v) for s in range(pp)]
    done: dict[tuple[str, int, int], float] = {}
    pos, free = [0] * pp, [0.0] * pp
    boxes: list[Box] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                kind, chunk, mb = orders[s][pos[s]]
                dep = (("F", chunk - 1, mb) if chunk > 0 else None) if kind == "F" else (
                    ("B", chunk + 1, mb) if chunk < last else ("F", chunk, mb))
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] if dep is not None else 0.0)
                end = start + (forward_s[s] if kind == "F" else backward_s[s]) / v
                done[(kind, chunk, mb)] = end
                boxes.append(Box(stage=s, chunk=chunk, microbatch=mb, kind=kind, start_s=start, end_s=end))
                free[s] = end
                pos[s] += 1
                remaining -= 1
                progressed = True
        assert progressed, f"schedule {schedule} deadlocks (pp {pp}, m {num_microbatches}, v {v})"
    return Timeline(boxes=tuple(sorted(boxes, key=lambda b: (b.stage, b.start_s))), pp=pp)


def stage_times(time_breakdown: dict[str, float], num_microbatches: int,
                stage_weights: Sequence[float]) -> tuple[list[float], list[float]]:
    """Per-stage forward / backward seconds per microbatch from an Estimate's (or Plan's)
    time_breakdown of the critical stage (module docstring); `stage_weights` are each
    stage's work (FLOPs or layers), the largest being the critical stage."""
    m = num_microbatches
    crit_total = sum(time_breakdown.get(k, 0.0) for k in ("compute_s", "comm_tp_s", "comm_pp_s", "comm_zero3_s")) / m
    recompute = time_breakdown.get("recompute_s", 0.0) / m
    crit = max(stage_weights)
    fwd = [crit_total * FORWARD_SHARE * w / crit for w in stage_weights]
    bwd = [(crit_total * (1 - FORWARD_SHARE) + recompute) * w / crit for w in stage_weights]
    return fwd, bwd


def plan_stage_times(plan: Plan) -> tuple[list[float], list[float]]:
    """`stage_times` from a Plan file: its prediction and its stages' FLOPs."""
    flops = [s.flops_per_microbatch for s in plan.stages]
    if not any(flops):  # none counted (the inter-op DP prices stage time, not FLOPs): equal stages
        flops = [1.0] * plan.config.pp
    return stage_times(dict(plan.predicted.time_breakdown), plan.num_microbatches, flops)


def draw_timeline(ax: Any, timeline: Timeline, *, title: str = "") -> None:
    import matplotlib.pyplot as plt  # lazy: matplotlib (the optional plot extra), only to draw

    cmap = plt.get_cmap("tab10")
    scale, unit = (1e3, "ms") if timeline.makespan_s < 10 else (1.0, "s")
    for b in timeline.boxes:
        color = cmap(b.microbatch % 10)
        ax.barh(b.stage, (b.end_s - b.start_s) * scale, left=b.start_s * scale, height=0.8, color=color,
                alpha=1.0 if b.kind == "F" else 0.55, edgecolor="black", linewidth=0.5,
                hatch=None if b.kind == "F" else "//")
        if (b.end_s - b.start_s) * scale > timeline.makespan_s * scale / 60:
            ax.text((b.start_s + b.end_s) / 2 * scale, b.stage, f"{b.kind}{b.microbatch}", ha="center",
                    va="center", fontsize=7)
    ax.set_yticks(range(timeline.pp), [f"stage {s}" for s in range(timeline.pp)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title or f"pipeline timeline, bubble {timeline.bubble_fraction:.0%} of the makespan "
                 "(white gaps); solid = forward, hatched = backward, colour = microbatch", fontsize=9)


MEMORY_COLORS = {"params_bytes": "#4c72b0", "grads_bytes": "#dd8452", "optimizer_bytes": "#55a868",
                 "activations_bytes": "#c44e52", "temporary_bytes": "#8172b3"}


def draw_memory(ax: Any, bars: Sequence[tuple[str, dict[str, float]]], *, limit_bytes: float | None = None,
                title: str = "predicted memory per device") -> None:
    """Stacked bars, one per (label, memory_breakdown) in bytes; plotted in GiB (MiB if small)."""
    peak = max((sum(b.values()) for _, b in bars), default=0.0)
    scale, unit = (GIB, "GiB") if peak >= GIB / 4 else (2**20, "MiB")
    keys = [k for k in MEMORY_COLORS if any(k in b for _, b in bars)]
    keys += sorted({k for _, b in bars for k in b} - set(keys))
    bottoms = [0.0] * len(bars)
    for k in keys:
        values = [b.get(k, 0.0) / scale for _, b in bars]
        ax.bar(range(len(bars)), values, bottom=bottoms, label=k.removesuffix("_bytes"),
               color=MEMORY_COLORS.get(k))
        bottoms = [a + v for a, v in zip(bottoms, values)]
    if limit_bytes is not None and limit_bytes / scale < 4 * max(bottoms, default=1.0):
        ax.axhline(limit_bytes / scale, color="red", linestyle="--", label="budget")
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], rotation=20 if len(bars) > 3 else 0,
                  fontsize=8)
    ax.set_ylabel(f"{unit} per device")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot_plan(plan: Plan, path: str) -> Timeline | None:
    """`autopar explain --plot`: the pipeline timeline (if pp > 1) and the peak device's
    predicted memory breakdown, side by side, written as PNG."""
    import matplotlib  # lazy: matplotlib (the optional plot extra), only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib (the optional plot extra), only to draw

    c = plan.config
    timeline = None
    if c.pp > 1:
        fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(14, 4.5), gridspec_kw={"width_ratios": [3, 1]})
        fwd, bwd = plan_stage_times(plan)
        timeline = pipeline_timeline(c.schedule, c.pp, plan.num_microbatches, fwd, bwd, c.interleave)
        draw_timeline(ax_time, timeline)
        ax_time.set_title(f"{c.schedule} (v={c.interleave}), pp {c.pp}, {plan.num_microbatches} microbatches "
                          f"(predicted stage times): bubble {timeline.bubble_fraction:.0%} of the makespan\n"
                          "solid = forward, hatched = backward, colour = microbatch", fontsize=9)
    else:  # no pipeline, no schedule to draw
        fig, ax_mem = plt.subplots(1, 1, figsize=(6, 4.5))
    breakdown = dict(plan.predicted.memory_breakdown)
    draw_memory(ax_mem, [("peak device", breakdown)], limit_bytes=plan.memory_limit_bytes)
    fig.suptitle(f"{plan.model} on {plan.cluster}: dp {c.dp} x tp {c.tp} x pp {c.pp}, zero {c.zero}, "
                 f"micro-batch {c.micro_batch}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return timeline


__all__ = ["Box", "Timeline", "draw_memory", "draw_timeline", "pipeline_timeline", "plan_stage_times",
           "plot_plan", "stage_order", "stage_times"]
