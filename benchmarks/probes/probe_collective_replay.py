"""The collectives a per-rank program runs, replayed alone on the same ranks (a probe, not a test).

For every one-stage configuration (pp = 1) of a sweep group (benchmarks/sweep_cpu.py), each
rank compiles the program as the sweep does and reads from its graphs the collectives it
runs per step: every `_c10d_functional` op of the step graph once per microbatch and of the
gradient-sync graph once (codegen/apply.py `RankGraphs`), with its kind, process group and
input bytes. Then, in interleaved rounds, it times one training step and one replay: the same
ops on the same groups in the same order, each waited at once, on buffers of the same
shapes, with no compute between them. Per configuration it prints:
- the step (fastest round, and the median) and the replay (the same);
- the ILP's price of the program's collectives (`m` x its per-microbatch reshard cost:
  solver/spmd_search.py `estimate`'s `reshard_s`, built-in profile; the loss report is apart);
- per rank, the main thread's CPU and the process's (every thread, gloo's included) during
  the step and during the replay (median over rounds, then ranks);
- the same collectives priced at the built-in profile's measured points
  (`autopar/cpu_profile.json` `measurements.collective_s`, linear between calibrate's sizes),
  where the profile measured the kind on a group of that size.

    .venv/bin/python benchmarks/probes/probe_collective_replay.py [--size S] [--world 4]
        [--only "dp4 z1,tp4"] [--rounds 5] [--warmup 2]

What its runs found is in docs/cost-model.md (the `cpu` profile) and in the demo's gap
(docs/benchmarks.md): collectives replayed alone take about their price, inside the
program about twice it, the rest being the contention of ranks sharing the cores.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

KINDS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
         "all_reduce": "all_reduce", "all_reduce_": "all_reduce"}
"""The `_c10d_functional` ops the programs record, by calibrate's kind names."""


def census(step: Any, grad_sync: Any, microbatches: int) -> list[dict[str, Any]]:
    """The collectives of a one-stage program's graphs in the order one step runs them: the
    step graph's `microbatches` times, then the gradient-sync graph's once. Each entry: the
    op's name, kind, group name, input shape and dtype (from the recorded `val`)."""
    one: list[dict[str, Any]] = []
    sync: list[dict[str, Any]] = []
    for gm, out in ((step, one), (grad_sync, sync)):
        if gm is None:
            continue
        for node in gm.graph.nodes:
            target = str(node.target)
            if node.op != "call_function" or "_c10d_functional" not in target:
                continue
            op = target.split(".")[-2]
            if op not in KINDS:
                if op == "wait_tensor":
                    continue
                raise ValueError(f"collective {target} is not one this probe replays ({sorted(KINDS)})")
            val = node.args[0].meta["val"]
            out.append({"op": op, "kind": KINDS[op], "group": node.args[-1], "shape": tuple(val.shape),
                        "dtype": val.dtype, "bytes": val.numel() * val.element_size()})
    return one * microbatches + sync


def interpolate(points: list[tuple[int, float]], nbytes: float) -> float:
    """Seconds at `nbytes` from measured (bytes, seconds) points: linear between neighbours,
    the smallest point below them, the last two points' line above them."""
    points = sorted(points)
    if nbytes <= points[0][0]:
        return points[0][1]
    for (b0, s0), (b1, s1) in zip(points, points[1:]):
        if nbytes <= b1:
            return s0 + (s1 - s0) * (nbytes - b0) / (b1 - b0)
    (b0, s0), (b1, s1) = points[-2], points[-1]
    return s1 + (s1 - s0) * (nbytes - b1) / (b1 - b0)


def table_price(counts: list[tuple[str, int, int, int]], measured: list[list[Any]]) -> float | None:
    """`counts`: (kind, group size, input bytes, per step) rows; `measured`: calibrate's
    [kind, group size, bytes, seconds] rows, where bytes is the full tensor (the gathered
    one for all-gather, the input for reduce-scatter and all-reduce). None when a row's
    (kind, group size) was not measured."""
    points: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for kind, size, nbytes, seconds in measured:
        points.setdefault((kind, size), []).append((nbytes, seconds))
    total = 0.0
    for kind, size, nbytes, per_step in counts:
        if (kind, size) not in points:
            return None
        full = nbytes * size if kind == "all_gather" else nbytes
        total += per_step * interpolate(points[(kind, size)], full)
    return total


def _worker(rank: int, spec: str, cases: list[Any], warmup: int, rounds: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    import autopar
    from benchmarks import sweep_cpu as sc
    from autopar.calibrate_rank import reference_time, reference_workload
    from autopar.models import resolve

    # the machine's speed now, as the sweep times it (the other ranks meet the same barriers)
    reference = reference_workload() if rank < sc.REFERENCE_RANKS else (lambda: None)
    reference_s = reference_time(reference, dist.barrier)
    ops = torch.ops._c10d_functional
    source = resolve(spec)
    batch = source.example_inputs(sc.GLOBAL_BATCH, generator=torch.Generator().manual_seed(1))
    programs = []
    for case in cases:
        torch.manual_seed(0)
        compiled = autopar.compile(source.build(), f"cpu:{case.world}", example_inputs=batch, config=case.config,
                                   optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
        m = sc.GLOBAL_BATCH // (case.config.dp * case.config.micro_batch)
        graphs = compiled.program.graphs
        programs.append((case.label, compiled, census(graphs.step, graphs.grad_sync, m)))
    sizes = {}
    buffers: dict[tuple[Any, ...], Any] = {}

    for _, _, colls in programs:  # groups and buffers made before any timing
        for c in colls:
            if c["group"] not in sizes:
                sizes[c["group"]] = _resolve_process_group(c["group"]).size()
            if (c["shape"], c["dtype"]) not in buffers:
                buffers[(c["shape"], c["dtype"])] = torch.ones(c["shape"], dtype=c["dtype"])

    def replay(colls: list[dict[str, Any]]) -> None:
        for c in colls:
            size, x = sizes[c["group"]], buffers[(c["shape"], c["dtype"])]
            if c["kind"] == "all_gather":
                y = ops.all_gather_into_tensor(x, size, c["group"])
            elif c["kind"] == "reduce_scatter":
                y = ops.reduce_scatter_tensor(x, "sum", size, c["group"])
            else:
                y = ops.all_reduce(x, "sum", c["group"])
            ops.wait_tensor(y)

    out: dict[str, dict[str, list[float]]] = {
        label: {f"{what}{clock}": [] for what in ("step", "replay") for clock in ("", "_thread", "_process")}
        for label, _, _ in programs}
    for k in range(warmup + rounds):
        order = programs if k % 2 == 0 else programs[::-1]
        for label, compiled, colls in order:
            for what, run in (("step", lambda: compiled.step(batch)), ("replay", lambda: replay(colls))):
                dist.barrier()
                start, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
                run()
                thread, process = time.thread_time() - thread, time.process_time() - process
                dist.barrier()
                if k >= warmup:
                    out[label][what].append(time.perf_counter() - start)
                    out[label][f"{what}_thread"].append(thread)
                    out[label][f"{what}_process"].append(process)
    counts = {}
    for label, _, colls in programs:
        per = Counter((c["kind"], sizes[c["group"]], c["bytes"]) for c in colls)
        counts[label] = [[kind, size, nbytes, n] for (kind, size, nbytes), n in sorted(per.items())]
    return {"times": out, "counts": counts, "reference_s": reference_s,
            "reference_ranks": min(sc.REFERENCE_RANKS, dist.get_world_size())}


def cpu_median(per_rank: list[dict[str, Any]], label: str, key: str) -> float:
    """A rank's CPU seconds of one configuration's step or replay (`key`: "step_thread",
    "replay_process", ...): the median over rounds, then over ranks."""
    return statistics.median(statistics.median(r["times"][label][key]) for r in per_rank)


def ilp_reshard_s(spec: str, case: Any) -> float:
    """The ILP's price of the program's collectives per step: m x the solution's
    per-microbatch reshard cost (gradient syncs weighted 1/m), built-in profile."""
    from benchmarks import sweep_cpu as sc
    from autopar.cluster import Cluster
    from autopar.placing import solve_config
    from solver.spmd_search import SpmdCandidate, estimate

    config = case.config
    graph = sc._step_graph(spec, config)
    m = sc.GLOBAL_BATCH // (config.dp * config.micro_batch)
    cluster = Cluster.parse(f"cpu:{case.world}")
    solution = solve_config(graph, config, cluster, num_microbatches=m)
    cand = SpmdCandidate(mesh=(config.dp, config.tp), microbatch=config.dp * config.micro_batch, num_microbatches=m)
    return dict(estimate(graph, solution, cand, cluster, sc.GLOBAL_BATCH).time_breakdown)["reshard_s"]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from benchmarks import sweep_cpu as sc
    from autopar.cluster import HARDWARE
    from autopar.runtime.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sc.add_probe_arguments(ap, rounds=5)
    ap.add_argument("--json", default="", help="write the rows here too")
    args = ap.parse_args(argv)
    cases = sc.probe_cases(ap, args, one_stage=True)
    if args.json and not Path(args.json).resolve().parent.is_dir():
        ap.error(f"--json: the folder of {args.json!r} does not exist; create it or give a path in an existing one")
    spec = sc.SIZES[args.size]
    per_rank = spawn(_worker, args.world, (spec, cases, args.warmup, args.rounds), collective_timeout_s=300.0)
    result = per_rank[0]
    measured = json.loads((ROOT / "autopar" / "cpu_profile.json").read_text())["measurements"]["collective_s"]
    rows = []
    load = sc.load_factor(HARDWARE["cpu"], result["reference_ranks"], [result["reference_s"]])
    print(f"{args.size} x {args.world}: step and replayed collectives, {args.rounds} interleaved rounds after "
          f"{args.warmup} warm-up (rank 0); priced per step with the built-in profile, unloaded; reference "
          f"workload {result['reference_s'] * 1e3:.2f} ms on {result['reference_ranks']} ranks: x{load:.2f} the "
          f"built-in profile's")
    print(f"{'configuration':<14} {'step ms':>8} {'(median)':>9} {'replay ms':>10} {'(median)':>9} "
          f"{'ILP price':>10} {'at measured points':>19} {'CPU step':>14} {'CPU replay':>14}  "
          f"collectives per step (kind, ranks, input bytes x count)")
    for case in cases:
        times, counts = result["times"][case.label], result["counts"][case.label]
        table = table_price([tuple(c) for c in counts], measured)
        row = {"label": case.label, "step_s": min(times["step"]), "step_median_s": statistics.median(times["step"]),
               "replay_s": min(times["replay"]), "replay_median_s": statistics.median(times["replay"]),
               "ilp_reshard_s": ilp_reshard_s(spec, case), "measured_points_s": table, "collectives": counts,
               **{f"{key}_cpu_s": cpu_median(per_rank, case.label, key)
                  for key in ("step_thread", "step_process", "replay_thread", "replay_process")}}
        rows.append(row)
        shown = "; ".join(f"{k} {n} {b} x{c}" for k, n, b, c in counts)
        print(f"{case.label:<14} {row['step_s'] * 1e3:>8.1f} {row['step_median_s'] * 1e3:>9.1f} "
              f"{row['replay_s'] * 1e3:>10.1f} {row['replay_median_s'] * 1e3:>9.1f} "
              f"{row['ilp_reshard_s'] * 1e3:>10.1f} {'-' if table is None else f'{table * 1e3:.1f}':>19} "
              f"{row['step_thread_cpu_s'] * 1e3:>6.1f} / {row['step_process_cpu_s'] * 1e3:>5.1f} "
              f"{row['replay_thread_cpu_s'] * 1e3:>6.1f} / {row['replay_process_cpu_s'] * 1e3:>5.1f}  {shown}")
    if args.json:
        Path(args.json).write_text(json.dumps({"size": args.size, "world": args.world, "load_factor": load,
                                               "reference_s": result["reference_s"], "rows": rows},
                                              indent=1, default=str) + "\n")
    return rows


if __name__ == "__main__":
    main()
