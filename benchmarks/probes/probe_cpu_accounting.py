"""Where a step's wall time goes on this machine: core work or waiting (a probe, not a test).

For each configuration of one sweep group (benchmarks/sweep_cpu.py's model sizes and
configurations), compiled through `autopar.compile` on spawned gloo ranks as the sweep
compiles it, every rank times `compiled.step` in interleaved rounds and records, per step:
- wall: barrier to barrier, as the sweep measures it (the minimum over rounds and ranks);
- main-thread CPU (`time.thread_time`): the program's ops, the collectives' Python and
  enqueue work, what the rank's thread spends spinning;
- process CPU (`time.process_time`, every thread of the rank): the above plus gloo's own
  threads (the collectives' copies, reductions and socket work);
- the ATen ops and collectives its program runs per step (`graph_ops_per_step`, the most
  of any rank), against the traced model's nodes the ILP charges a time (views at their
  host cost).
The medians over rounds and ranks are compared against wall: if `ranks x process CPU /
cores` is close to wall, the step is bound by core work (what the ranks compute and what
their collectives cost the cores), not by waiting; a step with idle cores measures wall
well above it. The cost model prices one-stage programs as local work (x the ranks per
core) plus each collective's isolated latency (calibrate's timing windows), and pipelines
as max(critical path / share, all work / cores) (solver/stage_dp.py).

    .venv/bin/python benchmarks/probes/probe_cpu_accounting.py --size S --world 4 \
        [--only "dp4 mb4,dp4 z1"] [--rounds 6] [--warmup 2]

Prints one row per configuration. What its runs found is in the cpu profile's terms
(autopar/cpu_profile.json, cost_model/efficiency.py) and docs/cost-model.md.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _worker(rank: int, spec: str, cases: list[Any], warmup: int, rounds: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import autopar
    from benchmarks import sweep_cpu as sc
    from autopar.calibrate_rank import reference_time, reference_workload
    from autopar.models import resolve

    # the machine's speed now, as the sweep times it (on REFERENCE_RANKS ranks; the others
    # meet the same barriers)
    reference = reference_workload() if rank < sc.REFERENCE_RANKS else (lambda: None)
    reference_s = reference_time(reference, dist.barrier)
    source = resolve(spec)
    batch = source.example_inputs(sc.GLOBAL_BATCH, generator=torch.Generator().manual_seed(1))
    programs = []
    for case in cases:
        torch.manual_seed(0)
        programs.append((case.label, autopar.compile(
            source.build(), f"cpu:{case.world}", example_inputs=batch, config=case.config,
            optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))))
    out: dict[str, dict[str, list[float]]] = {label: {"wall": [], "thread": [], "process": []} for label, _ in programs}
    ops = {label: graph_ops_per_step(compiled, case.config) for (label, compiled), case in zip(programs, cases)}
    for k in range(warmup + rounds):
        order = programs if k % 2 == 0 else programs[::-1]
        for label, compiled in order:
            dist.barrier()
            wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
            compiled.step(batch)
            thread, process = time.thread_time() - thread, time.process_time() - process
            dist.barrier()
            wall = time.perf_counter() - wall
            if k >= warmup:
                row = out[label]
                row["wall"].append(wall)
                row["thread"].append(thread)
                row["process"].append(process)
    return {"steps": out, "ops": ops, "reference_s": reference_s,
            "reference_ranks": min(sc.REFERENCE_RANKS, dist.get_world_size())}


def graph_ops_per_step(compiled: Any, config: Any) -> int:
    """ATen ops and collectives this rank's program runs per training step: a one-stage
    program's step graph once per microbatch plus its gradient-sync graph
    (codegen/apply.py `RankGraphs`, call_function nodes, the tuple `getitem`s included); a
    pipeline's chunk sources (`compiled.code`, one call per `torch.ops.` in them, so no
    `getitem`s) once per microbatch. The
    intra-op ILP prices the traced model's op nodes, views at their host cost
    (cost_model/table.py `view_host_s`), so the rest
    of these (the local chunking, slicing and copies around collectives that
    codegen/apply.py adds) are not in its price."""
    import re

    from benchmarks import sweep_cpu as sc

    m = sc.GLOBAL_BATCH // (config.dp * config.micro_batch)
    program = compiled.program
    if config.pp == 1:
        def calls(gm: Any) -> int:
            return 0 if gm is None else sum(1 for n in gm.graph.nodes if n.op == "call_function")
        return calls(program.graphs.step) * m + calls(program.graphs.grad_sync)
    return m * sum(len(re.findall(r"torch\.ops\.", source)) for source in compiled.code.values())


def summarize(per_rank: list[dict[str, dict[str, list[float]]]], cores: int) -> list[dict[str, Any]]:
    """`per_rank`: each rank's {configuration: {"wall" | "thread" | "process": [seconds per
    timed round]}}.

    One row per configuration: wall (minimum over rounds and ranks, the sweep's
    estimator; and the median over rounds, then ranks), per-rank main-thread and process CPU
    (medians over rounds, then ranks), and `core_bound_s` = ranks x process CPU / cores with
    its ratio to the median wall (medians on both sides: like with like)."""
    ranks = len(per_rank)
    rows = []
    for label in per_rank[0]:
        wall = min(min(r[label]["wall"]) for r in per_rank)
        wall_median = statistics.median(statistics.median(r[label]["wall"]) for r in per_rank)
        thread = statistics.median(statistics.median(r[label]["thread"]) for r in per_rank)
        process = statistics.median(statistics.median(r[label]["process"]) for r in per_rank)
        bound = ranks * process / cores
        rows.append({"label": label, "wall_s": wall, "wall_median_s": wall_median, "thread_cpu_s": thread,
                     "process_cpu_s": process, "core_bound_s": bound,
                     "core_bound_over_wall": bound / wall_median if wall_median else 0.0})
    return rows


def ilp_priced_nodes(spec: str, config: Any) -> int:
    """Nodes of the traced step (one microbatch) that the intra-op ILP's cost table charges
    a time (cost_model/table.py `strategy_cost`): not parameters; views that are an op call
    (`view_host_s`), and other nodes that compute or move something."""
    from benchmarks import sweep_cpu as sc
    from autopar.ir import Role
    from cost_model.table import HOSTLESS_VIEWS

    graph = sc._step_graph(spec, config)
    return sum(1 for n in graph.nodes
               if n.role is not Role.PARAMETER and (n.op not in HOSTLESS_VIEWS if n.is_view
                                                    else not (n.bytes_moved == 0 and n.flops == 0)))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    import os

    from benchmarks import sweep_cpu as sc
    from autopar.cluster import HARDWARE
    from autopar.runtime.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sc.add_probe_arguments(ap, rounds=6)
    args = ap.parse_args(argv)
    cases = sc.probe_cases(ap, args)
    spec = sc.SIZES[args.size]
    results = spawn(_worker, args.world, (spec, cases, args.warmup, args.rounds), collective_timeout_s=300.0)
    cores = os.cpu_count() or 1
    rows = summarize([r["steps"] for r in results], cores)
    for row in rows:
        row["graph_ops_per_step"] = max(r["ops"][row["label"]] for r in results)
    timed = results[0]
    priced = ilp_priced_nodes(spec, cases[0].config)
    load = sc.load_factor(HARDWARE["cpu"], timed["reference_ranks"], [timed["reference_s"]])
    print(f"{args.size} x {args.world} on {cores} cores ({args.rounds} rounds after {args.warmup} warm-up); "
          f"reference workload {timed['reference_s'] * 1e3:.2f} ms on {timed['reference_ranks']} ranks: "
          f"x{load:.2f} the built-in profile's (load factor); the intra-op ILP prices {priced} nodes of the "
          f"traced step per microbatch (its op calls, views included)")
    print(f"{'configuration':<20} {'wall ms (min)':>13} {'(median)':>9} {'thread CPU':>11} {'process CPU':>12} "
          f"{'ranks x process / cores':>24} {'/ median wall':>14} {'graph ops / step':>17}")
    for r in rows:
        print(f"{r['label']:<20} {r['wall_s'] * 1e3:>13.1f} {r['wall_median_s'] * 1e3:>9.1f} "
              f"{r['thread_cpu_s'] * 1e3:>11.1f} {r['process_cpu_s'] * 1e3:>12.1f} {r['core_bound_s'] * 1e3:>24.1f} "
              f"{r['core_bound_over_wall']:>14.2f} {r['graph_ops_per_step']:>17}")
    return rows


if __name__ == "__main__":
    main()
