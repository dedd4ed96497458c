"""The benchmark figures (PNG, matplotlib Agg) written next to the tables in benchmarks/results/.

- validation_scatter.png: out-of-sample (leave-one-source-out) predicted vs reported
  tokens/s per GPU for the published runs (read from the table
  benchmarks/validate_cost_model.py writes), log axes, y = x and +-25% lines, one colour
  per source.
- sweep_cpu.png: this machine's sweep (benchmarks/sweep_cpu.py): predicted (calibrated
  profile, load-corrected) vs measured step time, one colour per model size and process count.
- measured_cpu.png: autopar vs hand-tuned tokens/s per configuration measured on this
  machine (from measure_cpu.py's JSON), ratio over each pair, and peak RSS growth per rank.
- pipeline_timeline.png: 1F1B and interleaved timelines of one pipeline plan from the cost
  model's per-stage times, plus the predicted per-stage memory breakdown (stacked bars).
- predicted_vs_measured_cpu.png: the calibrated cost model's step time vs the measured one.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `benchmarks.*`
RESULTS = Path(__file__).resolve().parent / "results"


def validation_rows(md_path: Path) -> list[dict[str, Any]]:
    """(source, reported, predicted) rows of cost_model_validation.md's table: the
    out-of-sample (LOSO) prediction where the table has one, flagged rows left out."""
    lines = md_path.read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| # |"))
    cols = [c.strip() for c in lines[header].strip("|").split("|")]
    rows = []
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        cells = dict(zip(cols, (c.strip() for c in line.strip("|").split("|"))))
        if "fp8" in cells.get("flags", "") or "power-capped" in cells.get("flags", ""):
            continue  # not in the error statistics either (validate_cost_model.py)
        pred, err = ("LOSO predicted", "LOSO error") if cells.get("LOSO predicted", "-") != "-" else (
            "predicted", "error")
        try:
            rows.append({"source": cells["source"], "reported": float(cells["reported tok/s/GPU"]),
                         "predicted": float(cells[pred]), "model": cells["model"],
                         "error": float(cells[err].rstrip("%")) / 100})
        except (KeyError, ValueError):
            continue
    return rows


def validation_scatter(md_path: Path, out: Path) -> dict[str, float]:
    rows = validation_rows(md_path)
    fig, ax = plt.subplots(figsize=(6.5, 6))
    sources = sorted({r["source"] for r in rows})
    for k, src in enumerate(sources):
        mine = [r for r in rows if r["source"] == src]
        ax.scatter([r["reported"] for r in mine], [r["predicted"] for r in mine], s=22, label=f"{src} ({len(mine)})",
                   color=plt.get_cmap("tab10")(k % 10), alpha=0.85, edgecolors="black", linewidths=0.3)
    lo = min(min(r["reported"], r["predicted"]) for r in rows) / 1.5
    hi = max(max(r["reported"], r["predicted"]) for r in rows) * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="y = x")
    for f, style in ((1.25, ":"), (1 / 1.25, ":")):
        ax.plot([lo, hi], [lo * f, hi * f], color="gray", linestyle=style, linewidth=1)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi),
           xlabel="reported throughput (tokens/s per GPU)",
           ylabel="predicted out of sample (tokens/s per GPU)")
    # the table's own error column (computed before rounding), so the title matches the table
    median = statistics.median(abs(r["error"]) for r in rows)
    ax.set_title(f"cost model vs {len(rows)} published runs, leave-one-source-out (dotted: +-25%)\n"
                 f"median |error| {median:.1%}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, which="both", alpha=0.2)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return {"rows": len(rows), "median_abs_error": median}


def sweep_scatter(data: dict[str, Any], out: Path) -> None:
    key = "predicted_calibrated_s" if all("predicted_calibrated_s" in r for r in data["rows"]) else "predicted_default_s"
    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    groups = sorted({(r["size"], r["world"]) for r in data["rows"]})
    for k, (size, world) in enumerate(groups):
        mine = [r for r in data["rows"] if (r["size"], r["world"]) == (size, world)]
        ax.scatter([r[key] * 1e3 for r in mine], [r["measured_s"] * 1e3 for r in mine], s=26,
                   color=plt.get_cmap("tab10")(k % 10), label=f"{size} on {world} processes", zorder=3,
                   marker="o" if world == 4 else "s")
    values = [v * 1e3 for r in data["rows"] for v in (r[key], r["measured_s"])]
    lo, hi = min(values) / 1.5, max(values) * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="y = x")
    for f in (1.25, 1 / 1.25):
        ax.plot([lo, hi], [lo * f, hi * f], color="gray", linestyle=":", linewidth=1)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi),
           xlabel=f"predicted step time (ms), {key.removeprefix('predicted_').removesuffix('_s')} cpu profile",
           ylabel="measured step time (ms)")
    ax.grid(True, which="both", alpha=0.2)
    ax.set_title("this machine's sweep: 3 sizes x 4 and 8 processes (dotted: +-25%)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def measured_bars(data: dict[str, Any], out: Path) -> None:
    rows = data["rows"]
    labels = [f"{r['label']}\n({r['world']} proc)" for r in rows]
    x = range(len(rows))
    fig, (ax, ax_mem) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    w = 0.38
    a = [r["autopar_tokens_per_s"] for r in rows]
    h = [r["hand_tokens_per_s"] or 0 for r in rows]
    ax.bar([i - w / 2 for i in x], a, w, label="autopar (compiled program)", color="#4c72b0")
    ax.bar([i + w / 2 for i in x], h, w, label="hand-tuned (torchtitan-style)", color="#dd8452")
    for i, r in enumerate(rows):
        if r["ratio"]:
            ax.text(i, max(a[i], h[i]) * 1.02, f"x{r['ratio']:.2f}", ha="center", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("tokens/s (whole job)")
    ax.set_ylim(0, max(a + h) * 1.15)
    ax.set_title(f"measured on this machine (2 cores, gloo): median of {data['timed_steps']} steps after warm-up; "
                 "label = autopar / hand-tuned", fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    am = [(r["autopar_peak_rss_delta_bytes"] or 0) / 2**20 for r in rows]
    hm = [(r["hand_peak_rss_delta_bytes"] or 0) / 2**20 for r in rows]
    ax_mem.bar([i - w / 2 for i in x], am, w, label="autopar", color="#4c72b0")
    ax_mem.bar([i + w / 2 for i in x], hm, w, label="hand-tuned", color="#dd8452")
    ax_mem.set_xticks(list(x), labels, fontsize=7, rotation=30, ha="right")
    ax_mem.set_ylabel("MiB per rank (max over ranks)")
    ax_mem.set_title("peak resident-set growth per rank (build + steps)", fontsize=9)
    ax_mem.legend(fontsize=8)
    fig.suptitle(f"{data['model']}, global batch {data['global_batch']} x seq {data['seq']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def predicted_vs_measured(data: dict[str, Any], out: Path) -> None:
    rows, seen = [], {}
    for r in data["rows"]:  # a searched plan identical to a measured configuration: one point, both names
        if not r["predicted_step_time_s"]:
            continue
        key = (r["world"], json.dumps(r["config"], sort_keys=True), r["autopar_step_time_s"])
        if key in seen:
            seen[key]["label"] += f" = {r['label']}"
            continue
        seen[key] = dict(r)
        rows.append(seen[key])
    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    # labels of nearby points go to alternating sides, in measured order, so they do not overlap
    for k, r in enumerate(sorted(rows, key=lambda r: r["autopar_step_time_s"])):
        x, y = r["predicted_step_time_s"] * 1e3, r["autopar_step_time_s"] * 1e3
        ax.scatter(x, y, s=30, color="#4c72b0" if r["world"] == 4 else "#c44e52", zorder=3)
        left = k % 2 == 1
        ax.annotate(r["label"], (x, y), fontsize=7, xytext=(-6 if left else 6, -3 if left else 3),
                    textcoords="offset points", ha="right" if left else "left")
    lo = min(min(r["predicted_step_time_s"], r["autopar_step_time_s"]) for r in rows) * 1e3 / 1.6
    hi = max(max(r["predicted_step_time_s"], r["autopar_step_time_s"]) for r in rows) * 1e3 * 1.6
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="y = x")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi),
           xlabel="predicted step time (ms, log), calibrated cpu profile",
           ylabel="measured step time (ms, log), autopar program")
    ticks = [t for t in (50, 100, 200, 300, 500, 1000, 2000, 3000, 5000, 10000) if lo <= t <= hi]
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
        axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:.0f}"))
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(True, which="both", alpha=0.2)
    ax.set_title(f"calibrated cost model on this machine: Spearman {data['spearman']:.2f}\n"
                 "(blue: 4 processes, red: 8)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def pipeline_figure(out: Path, model: str = "llama3-70b", cluster_spec: str = "h100:8x8",
                    global_batch: int = 32) -> dict[str, Any]:
    """Timelines of one plan under 1F1B and interleaved 1F1B (tp 8, pp 4, dp 2, m 16) with
    per-stage times from the cost model, and its predicted per-stage memory."""
    from autopar.cluster import Cluster  # autopar before cost_model (import cycle)
    from benchmarks.baselines import analytic
    from autopar.config import ParallelConfig, default_stage_layers
    from autopar.models import resolve
    from autopar.plots import draw_memory, draw_timeline, pipeline_timeline, stage_times
    from autopar.trace import trace_model
    from benchmarks.baselines.analytic.memory import stage_memory

    graph = trace_model(resolve(model), batch=1, dtype="bfloat16", layers_traced=2)
    profile = analytic.profile_graph(graph)
    cluster = Cluster.parse(cluster_spec)
    fig, axes = plt.subplots(3, 1, figsize=(14, 10), gridspec_kw={"height_ratios": [1, 1, 1.1]})
    info: dict[str, Any] = {}
    for ax, (schedule, v) in zip(axes[:2], (("1f1b", 1), ("interleaved", 2))):
        config = ParallelConfig(tp=8, pp=4, dp=2, micro_batch=1, schedule=schedule, interleave=v,
                                recompute="selective")
        est = analytic.price_profile(profile, config, cluster, global_batch=global_batch)
        m = config.num_microbatches(global_batch)
        layers = default_stage_layers(profile.num_layers, config.pp)
        fwd, bwd = stage_times(dict(est.time_breakdown), m, [float(n) for n in layers])
        t = pipeline_timeline(schedule, config.pp, m, fwd, bwd, v)
        draw_timeline(ax, t, title=(
            f"{model} on {cluster_spec}: tp 8, pp 4, dp 2, {m} microbatches, {schedule} (v={v}); predicted step "
            f"{est.step_time_s:.2f} s, bubble {t.bubble_fraction:.1%} of the timeline "
            f"(SC'21: (p-1)/(v m) = {(config.pp - 1) / (v * m):.1%} of the compute)\n"
            "solid = forward, hatched = backward, colour = microbatch"))
        info[schedule] = {"bubble_fraction": t.bubble_fraction, "step_time_s": est.step_time_s, "boxes": len(t.boxes)}
        if schedule == "1f1b":
            mems = [stage_memory(profile, config, stage=i, layers=n, num_microbatches=m) for i, n in enumerate(layers)]
            bars = [(f"stage {i} ({n} layers)", {"params_bytes": s.params_bytes, "grads_bytes": s.grads_bytes,
                                                 "optimizer_bytes": s.optimizer_bytes,
                                                 "activations_bytes": s.activations_bytes,
                                                 "temporary_bytes": s.temporary_bytes})
                    for i, (s, n) in enumerate(zip(mems, layers))]
    draw_memory(axes[2], bars, limit_bytes=cluster.device_memory_bytes,
                title="1F1B plan: predicted memory per device by pipeline stage (stage 0 holds the most "
                      "microbatches in flight)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return info


def explain_figure(out: Path, model: str = "llama3-70b", cluster_spec: str = "h100:8x8",
                   global_batch: int = 32) -> str:
    """What `autopar explain plan.json --plot` draws, for a searched plan with pipelining
    (search restricted to ZeRO 0, so that the plan pipelines)."""
    from autopar.cluster import Cluster  # autopar before cost_model (import cycle)
    from autopar.models import resolve
    from autopar.explain import describe_config
    from autopar.plan import fingerprint_source
    from autopar.plots import plot_plan
    from autopar.trace import trace_model
    from benchmarks.baselines import analytic
    from benchmarks.baselines.template.search import SearchSpace, search

    source = resolve(model)
    graph = trace_model(source, batch=1, dtype="bfloat16", layers_traced=2)
    profile = analytic.profile_graph(graph)
    cluster = Cluster.parse(cluster_spec)

    def price(config: Any, stage_layers: tuple[int, ...]) -> Any:
        return analytic.price_profile(profile, config, cluster, global_batch=global_batch, stage_layers=stage_layers)

    result = search(graph, cluster, global_batch=global_batch, price=price, model=model,
                    fingerprint=fingerprint_source(source), cost_model_name="analytic.price_profile",
                    space=SearchSpace(zero_stages=(0,)))
    plan = result.plan
    plot_plan(plan, str(out))
    return describe_config(plan.config, plan.stage_layers, global_batch)


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    md = RESULTS / "cost_model_validation.md"
    if md.exists():
        print("validation scatter:", validation_scatter(md, RESULTS / "validation_scatter.png"))
    sweep = RESULTS / "sweep_cpu.json"
    if sweep.exists():
        sweep_scatter(json.loads(sweep.read_text()), RESULTS / "sweep_cpu.png")
    measured = RESULTS / "measured_cpu.json"
    if measured.exists():
        data = json.loads(measured.read_text())
        measured_bars(data, RESULTS / "measured_cpu.png")
        predicted_vs_measured(data, RESULTS / "predicted_vs_measured_cpu.png")
    print("pipeline timeline:", pipeline_figure(RESULTS / "pipeline_timeline.png"))
    print("explain --plot of a searched plan (ZeRO 0):", explain_figure(RESULTS / "explain_plan.png"))


if __name__ == "__main__":
    main()
