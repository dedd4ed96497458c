"""Two programs of one configuration, measured side by side (a probe, not a test).

A hardware profile decides more than a price: the runtime's intra-op ILP solves each
configuration's program (one stage, or every pipeline chunk) on the built-in `cpu` profile,
so a refit of that profile can change which program runs. This probe takes configurations of
a sweep group (benchmarks/sweep_cpu.py) and compiles each twice on the same spawned gloo
ranks: once as the runtime does now (solved on the built-in profile) and once solved on
`--other` (a profile JSON, e.g. the built-in of an earlier commit:
`git show REV:autopar/cpu_profile.json > old.json`). Both are timed in interleaved rounds
(the sweep's protocol, with the first configuration's built-in program timed twice as a noise
estimate). Per configuration it prints how many nodes the two solves place differently
(per chunk for pipelines), the built-in profile's ILP price of both programs (the solve's
own cost and `solver.forced.price_solution` of the other's placements: which one the ILP
prefers, and by how much) and what each measured (fastest round, median).

    .venv/bin/python benchmarks/probes/probe_program_choice.py --other old.json [--size M]
        [--world 4] [--only "tp2 pp2,tp4"] [--rounds 11] [--warmup 2]

What its runs found is in docs/cost-model.md (the `cpu` profile).
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

from benchmarks.sweep_cpu import GLOBAL_BATCH, SIZES, _step_graph, add_probe_arguments, probe_cases  # noqa: E402

OTHER = " (other)"
REPEAT = " (repeat)"


def _cluster(world: int, hardware: Any) -> Any:
    from autopar.cluster import Cluster

    return Cluster.parse(f"cpu:{world}", hardware=hardware)


def ilp_prices(spec: str, case: Any, other: Any) -> list[dict[str, Any]]:
    """Per program unit (the one-stage step, or each pipeline chunk): nodes placed
    differently and the built-in profile's ILP price of its own solve and of `other`'s."""
    import torch

    from autopar.cluster import HARDWARE
    from autopar.models import resolve
    from autopar.build.chunks import trace_chunks
    from autopar.placing import solve_stage
    from autopar.placing import solution_choices, solve_config
    from solver.forced import price_solution

    cfg, world = case.config, case.world
    rows = cfg.dp * cfg.micro_batch
    m = GLOBAL_BATCH // rows
    built_in, alt = _cluster(world, HARDWARE["cpu"]), _cluster(world, other)
    units = []
    if cfg.pp == 1:
        graph = _step_graph(spec, cfg)
        units.append(("step", graph, lambda cl: solve_config(graph, cfg, cl, num_microbatches=m), built_in))
    else:
        source = resolve(spec)
        batch = source.example_inputs(GLOBAL_BATCH, generator=torch.Generator().manual_seed(1))
        torch.manual_seed(0)
        for st in trace_chunks(source.build(), cfg, batch):
            units.append((f"chunk {st.index}", st.graph,
                          functools.partial(lambda g, cl: solve_stage(g, cfg, cl, num_microbatches=m, rows=rows),
                                            st.graph),
                          built_in.stage(cfg.dp * cfg.tp)))
    out = []
    for name, graph, solve, priced_on in units:
        mine, theirs = solve(built_in), solve(alt)
        moved = sum(a != b for a, b in zip(solution_choices(graph, mine), solution_choices(graph, theirs)))
        row: dict[str, Any] = {"unit": name, "nodes": len(graph), "moved": moved, "built_in_s": mine.cost.total_s}
        if moved:
            row["other_s"] = price_solution(graph, cfg, theirs, priced_on, num_microbatches=m).cost.total_s
        out.append(row)
    return out


def _worker(rank: int, spec: str, cases: list[Any], other: Any, warmup: int, timed: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import autopar
    from autopar.cluster import HARDWARE
    from autopar.models import resolve

    source = resolve(spec)
    batches = [source.example_inputs(GLOBAL_BATCH, generator=torch.Generator().manual_seed(1 + k))
               for k in range(warmup + timed)]
    programs = []
    for i, case in enumerate(cases):
        variants = [("", HARDWARE["cpu"]), (OTHER, other)] + ([(REPEAT, HARDWARE["cpu"])] if i == 0 else [])
        for suffix, hw in variants:
            torch.manual_seed(0)
            compiled = autopar.compile(source.build(), _cluster(case.world, hw), example_inputs=batches[0],
                                       config=case.config, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
            programs.append((case.label + suffix, compiled))
    times: dict[str, list[float]] = {label: [] for label, _ in programs}
    for k, batch in enumerate(batches):
        rotated = programs[k % len(programs):] + programs[:k % len(programs)]
        for label, compiled in (rotated if k % 2 == 0 else rotated[::-1]):
            dist.barrier()
            start = time.perf_counter()
            compiled.step(batch)
            dist.barrier()
            if k >= warmup:
                times[label].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_arguments(ap, rounds=11)
    ap.add_argument("--other", required=True, help="the other profile's JSON (autopar calibrate output or an "
                    "earlier autopar/cpu_profile.json)")
    args = ap.parse_args(argv)
    cases = probe_cases(ap, args)
    from autopar.cluster import load_hardware
    from autopar.runtime.launch import spawn

    try:
        other = load_hardware(args.other)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # unreadable, or not a profile
        ap.error(f"--other {args.other}: not a hardware profile: {exc}; give `autopar calibrate --out`'s "
                 "file or an autopar/cpu_profile.json")
    spec = SIZES[args.size]
    print(f"{args.size} x {args.world}: built-in profile against {args.other}; {args.rounds} rounds after "
          f"{args.warmup} warm-up")
    for case in cases:
        for row in ilp_prices(spec, case, other):
            extra = (f"; built-in ILP prices its own {row['built_in_s'] * 1e3:.2f} ms, the other's "
                     f"{row['other_s'] * 1e3:.2f} ms" if row["moved"] else "")
            print(f"  {case.label:18s} {row['unit']}: {row['moved']} of {row['nodes']} nodes placed "
                  f"differently{extra}", flush=True)
    times = spawn(_worker, args.world, (spec, cases, other, args.warmup, args.rounds),
                  collective_timeout_s=300.0)[0]
    for label, ts in times.items():
        print(f"  {label:30s} fastest {min(ts) * 1e3:7.1f} ms  median {statistics.median(ts) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
