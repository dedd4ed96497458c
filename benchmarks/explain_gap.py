"""A one-stage plan's predicted step against its measured step, term by term (a benchmark, not a test).

    .venv/bin/python benchmarks/explain_gap.py [--model llama-small] [--cluster cpu:4]
        [--global-batch 8] [--plan plan.json] [--warmup 3] [--steps 10] [--runs 3]
        [--json out.json]

The plan (searched, or `--plan`) is priced by the intra-op ILP that ranked it
(solver/forced.py `solve_one_stage` on the graph the search traced) and run on spawned gloo
ranks by `autopar.compile(..., plan=)`, as `autopar train --plan` runs it. Each rank
profiles `--steps` steps after `--warmup` (torch.profiler, CPU: every ATen op's own time,
wall clock on its thread). Both sides are split into the same terms, per rank per step:

- gemm, attention, memory-bound ops, views: the ILP's node times (`NodeChoice.compute_s` x
  multiplicity x microbatches; they include `core_share`, ranks per core) against the
  profiled self time of the ATen ops of that class (autopar/ir.py GEMM_OPS,
  ATTENTION_OPS; views by name);
- collectives: the ILP's reshard time (gradient sync included) and the loss report's
  all-reduce against the profiled collective and wait ops;
- optimizer: `optimizer_s` against the optimizer's ops (fused AdamW, foreach);
- the microbatches' gradient accumulation is priced with the memory-bound ops;
- not priced: the measured step minus the profiled ops: the program's Python (the
  generated graph code, the optimizer's Python, the runtime's step epilogue) and the
  timing barrier's wait for the slowest rank.

A second table splits the measured step by the runtime's own phases (the
`autopar::microbatch`, `grad_sync`, `loss_report`, `optimizer`, ... ranges that
autopar/runtime/spmd.py names in every profiler trace): each phase's inclusive time, the
ops inside it, and the rest (Python, or waiting in an unprofiled call).

The measured step is the median over steps of rank 0's barrier-to-barrier wall time; each
term's measured figure is the median over ranks of the mean over the profiled steps.
Repeated `--runs` times (fresh ranks each); the report gives the median of each figure.
Profiling adds a per-op cost of its own, so the profiled runs' step is also reported
beside an unprofiled timing of the same steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autopar.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sweep_cpu import REFERENCE_RANKS, load_factor  # noqa: E402  (the sweep's machine-speed reading)

VIEW_OPS = frozenset({
    "aten::view", "aten::_unsafe_view", "aten::t", "aten::transpose", "aten::expand", "aten::unsqueeze",
    "aten::squeeze", "aten::slice", "aten::select", "aten::as_strided", "aten::permute", "aten::reshape",
    "aten::alias", "aten::detach", "aten::split", "aten::split_with_sizes", "aten::unbind", "aten::chunk",
    "aten::narrow", "aten::view_as_real", "aten::view_as_complex", "aten::_reshape_alias", "aten::flatten",
    "aten::lift_fresh", "aten::empty", "aten::empty_strided", "aten::resolve_conj", "aten::resolve_neg",
})
"""ATen ops that move no data (views and allocations): the ILP charges them the view host cost."""
TERMS = ("gemm", "attention", "memory", "views", "collectives", "optimizer", "not priced")


def op_class(name: str) -> str:
    """The term an ATen op's profiled time belongs to (module docstring)."""
    from autopar.ir import ATTENTION_OPS, GEMM_OPS

    low = name.lower()
    if any(k in low for k in ("c10d", "gloo", "wait_tensor", "all_reduce", "all_gather", "reduce_scatter",
                              "all_to_all", "broadcast", "_functional")):
        return "collectives"
    if "adam" in low or "_foreach" in low:
        return "optimizer"
    bare = name.removeprefix("aten::")
    if any(op.split(".")[1] == bare for op in GEMM_OPS if op.startswith("aten.")):
        return "gemm"
    if any(op.split(".")[1] == bare for op in ATTENTION_OPS if op.startswith("aten.")):
        return "attention"
    if name in VIEW_OPS:
        return "views"
    return "memory"


def predicted_terms(model: str, cluster_spec: str, global_batch: int, plan: Plan) -> dict[str, float]:
    """The ILP's price of `plan` split into the terms (seconds per step per rank)."""
    from autopar.api import LAYERS_TRACED, _cluster_of
    from autopar.ir import ATTENTION_OPS, GEMM_OPS, Role
    from autopar.models import resolve
    from autopar.trace import trace_model, with_precision
    from solver.forced import solve_one_stage
    from solver.spmd_search import SpmdCandidate, estimate

    config = plan.config
    cluster = _cluster_of(cluster_spec)
    named = config.resolved(cluster.hardware.name)
    policy = named.policy()
    g = config.micro_batch * config.dp
    m = global_batch // g
    graph = with_precision(trace_model(resolve(model), batch=g, dtype=policy.compute, layers_traced=LAYERS_TRACED),
                           policy)
    solution = solve_one_stage(graph, config, cluster, num_microbatches=m, update_free=False,
                               memory_budget_bytes=cluster.device_memory_bytes)
    est = estimate(graph, solution, SpmdCandidate(mesh=(config.dp, config.tp), microbatch=g, num_microbatches=m),
                   cluster, global_batch)
    out = {t: 0.0 for t in TERMS}
    for c in solution.choices:
        node = graph[c.node]
        if node.role is Role.PARAMETER:
            continue
        cls = "gemm" if node.op in GEMM_OPS else "attention" if node.op in ATTENTION_OPS else \
            "views" if node.is_view else "memory"
        out[cls] += m * c.weight * (c.compute_s + c.comm_s)
    terms = dict(est.time_breakdown)
    out["collectives"] = terms["reshard_s"] + terms.get("loss_report_s", 0.0)
    out["optimizer"] = terms["optimizer_s"]
    out["memory"] += terms.get("grad_accum_s", 0.0)
    out["step"] = est.step_time_s
    out["plan_step"] = plan.predicted.step_time_s
    return out


def _worker(rank: int, model: str, cluster_spec: str, global_batch: int, plan_json: str, warmup: int,
            steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import autopar
    from autopar.models import resolve
    from autopar.plan import Plan

    from autopar.calibrate_rank import reference_time, reference_workload

    # the machine's speed now, against the profile's calibration (benchmarks/sweep_cpu.py)
    reference = reference_workload() if rank < REFERENCE_RANKS else (lambda: None)
    reference_s = reference_time(reference, dist.barrier)
    source = resolve(model)
    plan = Plan.loads(plan_json)
    batch = source.example_inputs(global_batch, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    compiled = autopar.compile(source.build(), cluster_spec, example_inputs=batch, plan=plan)

    def timed(n: int) -> list[float]:
        walls = []
        for _ in range(n):
            dist.barrier()
            t = time.perf_counter()
            compiled.step(batch)
            dist.barrier()
            walls.append(time.perf_counter() - t)
        return walls

    timed(warmup)
    plain = timed(steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = timed(steps)
    per_class = {t: 0.0 for t in TERMS}
    per_op: dict[str, float] = {}
    phases: dict[str, list[float]] = {}  # autopar's phase: [inclusive, ATen ops inside] seconds per step
    for ev in prof.events():
        if _is_op(ev.name):
            per_class[op_class(ev.name)] += ev.self_cpu_time_total / 1e6 / steps
            per_op[ev.name] = per_op.get(ev.name, 0.0) + ev.self_cpu_time_total / 1e6 / steps
        elif ev.name.startswith("autopar::"):
            row = phases.setdefault(ev.name.removeprefix("autopar::"), [0.0, 0.0])
            row[0] += ev.cpu_time_total / 1e6 / steps
            row[1] += _ops_below(ev) / 1e6 / steps
    ops_s = sum(per_class.values())
    per_class["not priced"] = max(0.0, statistics.fmean(profiled) - ops_s)
    return {"plain": plain, "profiled": profiled, "terms": per_class, "phases": phases, "ops": per_op,
            "reference_s": reference_s}


def _is_op(name: str) -> bool:
    """A profiled op of the program (ATen, c10d, gloo), not a Python range (autopar's phases,
    the optimizer's `Optimizer.step#...`) and not the timing's own barrier (its wait for the
    slowest rank stays in the step, under "not priced")."""
    return "::" in name and not name.startswith(("autopar::", "ProfilerStep")) and name != "c10d::barrier"


def _ops_below(ev: Any) -> float:
    """Microseconds of op self time under a profiler range (its children, recursively)."""
    total = 0.0
    for child in ev.cpu_children:
        total += (child.self_cpu_time_total if _is_op(child.name) else 0.0) + _ops_below(child)
    return total


def run_once(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    from autopar.api import _cluster_of
    from autopar.runtime.launch import spawn

    world = _cluster_of(args.cluster).num_devices
    results = spawn(_worker, world, (args.model, args.cluster, args.global_batch, plan.dumps(), args.warmup,
                                     args.steps), collective_timeout_s=300.0)
    names = list(results[0]["phases"])
    return {
        "reference_s": results[0]["reference_s"],
        "step_s": statistics.median(results[0]["plain"]),
        "fastest_step_s": min(results[0]["plain"]),
        "profiled_step_s": statistics.median(results[0]["profiled"]),
        "terms": {t: statistics.median(r["terms"][t] for r in results) for t in TERMS},
        "ops": {name: statistics.median(r["ops"].get(name, 0.0) for r in results) for name in results[0]["ops"]},
        "phases": {name: [statistics.median(r["phases"][name][k] for r in results) for k in (0, 1)]
                   for name in names},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--cluster", default="cpu:4")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--plan", default=None, help="a saved one-stage plan (default: search one)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from autopar.api import search_plans
    from autopar.explain import describe_config
    from autopar.plan import Plan

    try:
        plan = Plan.load(args.plan) if args.plan else search_plans(args.model, args.cluster,
                                                                    global_batch=args.global_batch).plan
    except (OSError, ValueError) as exc:
        ap.error(f"{args.plan or args.model}: {exc}")
    if plan.config.pp != 1:
        ap.error(f"explain_gap prices one-stage plans; {args.plan or 'the searched plan'} has pp={plan.config.pp} "
                 "(search with --max-pp 1, or give a one-stage plan)")
    if args.runs < 1 or args.steps < 1 or args.warmup < 0:
        ap.error(f"--runs and --steps must be at least 1 and --warmup at least 0, got --runs {args.runs} "
                 f"--steps {args.steps} --warmup {args.warmup}")
    label = describe_config(plan.config, plan.stage_layers, args.global_batch)
    predicted = predicted_terms(args.model, args.cluster, args.global_batch, plan)
    runs = [run_once(args, plan) for _ in range(args.runs)]
    measured = {t: statistics.median(r["terms"][t] for r in runs) for t in TERMS}
    step = statistics.median(r["step_s"] for r in runs)
    from autopar.api import _cluster_of

    cluster = _cluster_of(args.cluster)
    load = load_factor(cluster.hardware, min(REFERENCE_RANKS, cluster.num_devices), [r["reference_s"] for r in runs])
    profiled = statistics.median(r["profiled_step_s"] for r in runs)
    print(f"{args.model} on {args.cluster}, global batch {args.global_batch}: {label}")
    print(f"predicted step {predicted['step'] * 1e3:.2f} ms (the plan says {predicted['plan_step'] * 1e3:.2f}); "
          f"measured {step * 1e3:.2f} ms (median of {args.runs} runs x {args.steps} steps; "
          f"{profiled * 1e3:.2f} ms under the profiler): measured / predicted {step / predicted['step']:.2f}")
    fastest = statistics.median(r["fastest_step_s"] for r in runs)
    print(f"the fastest step (the CPU sweep's estimator, benchmarks/sweep_cpu.py): {fastest * 1e3:.2f} ms, "
          f"{fastest / predicted['step']:.2f} x predicted")
    print(f"the machine now runs the reference workload x{load:.2f} as slow as when the profile was calibrated "
          f"(load factor, benchmarks/sweep_cpu.py): measured / (predicted x load) "
          f"{step / predicted['step'] / load:.2f}")
    print(f"{'term':<12} {'predicted ms':>13} {'measured ms':>12} {'measured - predicted':>21}")
    ops = {name: statistics.median(r["ops"].get(name, 0.0) for r in runs) for name in runs[0]["ops"]}
    for t in TERMS:
        p, q = predicted[t] * 1e3, measured[t] * 1e3
        top = sorted((name for name in ops if op_class(name) == t), key=lambda name: -ops[name])[:3]
        largest = ", ".join(f"{name} {ops[name] * 1e3:.2f}" for name in top) if t != "not priced" else ""
        print(f"{t:<12} {p:>13.2f} {q:>12.2f} {q - p:>+21.2f}   {largest}")
    print(f"{'sum':<12} {sum(predicted[t] for t in TERMS) * 1e3:>13.2f} {sum(measured.values()) * 1e3:>12.2f}")
    phases = {name: [statistics.median(r["phases"][name][k] for r in runs) for k in (0, 1)]
              for name in runs[0]["phases"]}
    print(f"measured by phase of the runtime's step (ms per step): {'phase':<15} {'inclusive':>10} "
          f"{'ATen ops':>9} {'the rest (Python)':>18}")
    for name, (total, ops) in phases.items():
        print(f"{'':<55}{name:<15} {total * 1e3:>10.2f} {ops * 1e3:>9.2f} {(total - ops) * 1e3:>18.2f}")
    inside = sum(total for total, _ in phases.values())
    print(f"{'':<55}{'outside phases':<15} {(profiled - inside) * 1e3:>10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "cluster": args.cluster, "plan": label,
                                               "predicted": predicted, "measured": measured, "phases": phases,
                                               "step_s": step, "fastest_step_s": fastest, "load_factor": load,
                                               "profiled_step_s": profiled, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
