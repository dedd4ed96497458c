"""autopar vs torchtitan itself, measured on this machine (gloo, CPU): every configuration
both support on 4 and 8 processes, and autopar's searched plan vs torchtitan's fastest.

    python benchmarks/measure_torchtitan.py [--json out.json] [--md out.md] [--plot out.png]
        [--only LABEL,...] [--no-world8] [--rounds N] [--fused-qkv] [--compiled] [--profile-below RATIO]
        [--profile LABEL [--profile-md out.md]]

Needs the `bench` install (`make bench-install`); without torchtitan it prints one line and
exits 0 (that is how `make bench` skips it). Re-run it whenever autopar's runtime changes:
`make bench-torchtitan` rewrites results/torchtitan.{md,json,png}.

The model (both sides): torchtitan's own Llama3 (benchmarks/baselines/torchtitan_baseline.py) at
SHAPE, with torchtitan's initialisation under one seed. torchtitan runs it through its own
`parallelize_llama` / `pipeline_llm`. autopar compiles, through its public entry points only
(`autopar.compile(model, "cpu:N", example_inputs=..., config=ParallelConfig(...))`, then
`compiled.step(batch)`):
  A      autopar's zoo Llama holding the same weights (`torchtitan_baseline.zoo_model`:
         same function, loss for loss), for every configuration;
  A[tt]  torchtitan's Llama3 module itself, on every one-stage configuration (the per-op
         compiler shards any model; pipelines still need a rule table, so pp = 1 only);
  S, S[tt]  `autopar.compile` without config=: the plan autopar searches for cpu:N.
Oracle: on each configuration, the first three losses of A, A[tt] and T must equal the
single-process losses of the unsharded torchtitan model (first step rtol 1e-5, later 2e-4:
AdamW reduction order); any miss ends the run with exit 1 before a figure is written.

Configuration mapping (torchtitan's knobs -> autopar's ParallelConfig): dp_shard -> dp with
ZeRO 3 (FSDP2, resharded after forward), or ZeRO 1 under pp: there torchtitan keeps the
parameters gathered between forward and backward, and torch.distributed.pipelining turns
FSDP's gradient sync off for every microbatch's backward (`backward_maybe_with_nosync`),
reducing the accumulated gradients once per step; dp_replicate -> dp with ZeRO 0
(gradients all-reduced); tp (+ sequence parallel) -> tp; pp, schedule, microbatch size ->
pp, schedule, micro_batch; full activation checkpointing -> recompute full; torchtitan's
local batch = autopar's micro_batch without pp (no gradient accumulation on either side).

Figures (the machine has 2 cores shared with other users: noisy; read ratios, not times):
- step time: barrier; step; barrier, timed on rank 0; every program of one world size built
  side by side on the same ranks, WARMUP_STEPS untimed rounds, then TIMED_STEPS rounds of one
  step of each program (order reversed every other round; a configuration's A, T, A[tt] are
  adjacent). autopar/torchtitan = median over rounds of t_T / t_A (>1: autopar faster);
  searched/best = median over rounds of t_Tbest / t_S, Tbest the torchtitan program with the
  lowest median of that world size.
- memory: peak resident-set growth per rank (VmHWM after 3 steps minus VmRSS before the
  build; glibc mmap threshold 64 KiB so freed tensors go back to the OS), each program built
  alone in a separate set of ranks, after a throwaway build and step of each program of its
  configuration, max over ranks (as benchmarks/measure_cpu.py does).
- `--profile LABEL`: torch.profiler over PROFILE_ROUNDS single steps of A and of T of one
  configuration, built side by side and profiled in alternation, every rank: collective
  calls and time per kind, the ops with the largest self CPU time, and the ATen ops whose
  call counts differ. `--profile-below 0.95` does this after the measurement for every
  shared configuration below 0.95 and adds it to the markdown.
- `--compiled`: autopar's zoo program also with `compiled=True` (Inductor on every per-rank
  graph, codegen/inductor.py), timed in the same rounds as eager (compiled/eager = median
  over rounds of t_eager / t_compiled), its losses through the same oracle, its memory
  alone, and its compile time on an empty Inductor cache (the memory phase compiles cold;
  the timing phase's ranks find the cache warm).
- `--fused-qkv`: torchtitan's fused wqkv (its flavors' layout) instead of its stock
  QKVLinear; the zoo Llama then runs more, smaller GEMMs than torchtitan (a model
  difference, shown by the profiler: 87 vs 63 matmuls per step).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.measure_cpu import _mem_kib, _reset_peak, _timed, return_freed_memory_to_os  # noqa: E402
from benchmarks.baselines.torchtitan_baseline import TitanConfig, TitanShape  # noqa: E402
from benchmarks.lib.tensor_memory import live_tensor_bytes, step_peak_bytes  # noqa: E402

SHAPE = TitanShape(layers=4, dim=256, heads=4, kv_heads=2, ffn=512, vocab=1024, seq=64, fuse_qkv=False)
"""The model of measure_cpu.py (4 layers, hidden 256, GQA 4/2 heads, SwiGLU 512, vocab 1024),
with torchtitan's stock QKVLinear: q, k, v in three GEMMs, as autopar's zoo Llama computes
them (`--fused-qkv`: torchtitan's fused wqkv, one GEMM, which the zoo Llama does not have)."""
GLOBAL_BATCH = 16
WARMUP_STEPS = 2
TIMED_STEPS = 16
ORACLE_STEPS = 3
PROFILE_ROUNDS = 6
"""Profiled steps of each program in `--profile` (alternating)."""
LR = 1e-3
FIRST_RTOL = 1e-5
LATER_RTOL = 2e-4
"""FSDP / TP reductions sum in another order than one process; AdamW turns that into ~1e-5
relative loss drift by step 3 (measured here); 2e-4 leaves room without hiding a real bug
(a wrong gradient scale or a missing all-reduce moves step 2's loss by > 1e-3)."""
SKIP_LINE = ("torchtitan comparison skipped: {why}. Install it with `make bench-install` "
             "(the `bench` extra + torchtitan==0.3.0 --no-deps)")


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    label: str
    world: int
    titan: TitanConfig | None
    """None: autopar's searched plan (no torchtitan program of its own)."""
    zoo: bool = True
    """autopar compiles its zoo Llama (same weights); else torchtitan's module itself."""
    shape: TitanShape = SHAPE
    compiled: bool = False
    """Also run autopar's program with `compiled=True` (Inductor on the per-rank graphs): the
    `--compiled` column (zoo rows with a torchtitan configuration)."""


def autopar_config(t: TitanConfig) -> Any:
    """The ParallelConfig that runs the same configuration as torchtitan's knobs."""
    from autopar.config import ParallelConfig

    if t.dp_replicate > 1 and t.dp_shard > 1:
        raise ValueError("HSDP (dp_replicate and dp_shard both > 1) has no autopar configuration")
    dp = t.dp_replicate * t.dp_shard
    zero = 0 if t.dp_shard == 1 else (1 if t.pp > 1 else 3)
    schedule = {"1F1B": "1f1b", "GPipe": "gpipe", "Interleaved1F1B": "interleaved"}[t.pp_schedule]
    return ParallelConfig(dp=dp, tp=t.tp, pp=t.pp, zero=zero if dp > 1 else 0,
                          micro_batch=t.pp_microbatch_size if t.pp > 1 else t.local_batch_size,
                          schedule=schedule, interleave=t.stages_per_rank,
                          recompute="full" if t.ac == "full" else "none", sequence_parallel=t.sequence_parallel)


def cases(world: int, shape: TitanShape = SHAPE) -> list[Case]:
    """Every configuration both support at this world size (torchtitan's knobs), then the
    rows where autopar compiles torchtitan's module itself, then the searched plans."""
    g = GLOBAL_BATCH
    if world == 4:
        titan = {
            "ddp4": TitanConfig(dp_replicate=4, local_batch_size=g // 4),
            "fsdp4": TitanConfig(dp_shard=4, local_batch_size=g // 4),
            "fsdp4 +AC": TitanConfig(dp_shard=4, local_batch_size=g // 4, ac="full"),
            "ddp2 x tp2": TitanConfig(dp_replicate=2, tp=2, local_batch_size=g // 2),
            "fsdp2 x tp2": TitanConfig(dp_shard=2, tp=2, local_batch_size=g // 2),
            "pp2 x fsdp2": TitanConfig(pp=2, dp_shard=2, local_batch_size=g // 2, pp_microbatch_size=2),
            "pp2 x tp2": TitanConfig(pp=2, tp=2, local_batch_size=g, pp_microbatch_size=4),
            "pp4": TitanConfig(pp=4, local_batch_size=g, pp_microbatch_size=2),
            "pp2 interleaved x2": TitanConfig(pp=2, dp_replicate=2, local_batch_size=g // 2, pp_microbatch_size=2,
                                              pp_schedule="Interleaved1F1B", stages_per_rank=2),
        }
    elif world == 8:
        titan = {
            "ddp8": TitanConfig(dp_replicate=8, local_batch_size=g // 8),
            "fsdp8": TitanConfig(dp_shard=8, local_batch_size=g // 8),
            "fsdp4 x tp2": TitanConfig(dp_shard=4, tp=2, local_batch_size=g // 4),
            "pp2 x fsdp2 x tp2": TitanConfig(pp=2, dp_shard=2, tp=2, local_batch_size=g // 2, pp_microbatch_size=2),
        }
    else:
        raise ValueError(f"configurations are listed for 4 and 8 processes, not {world}")
    out = [Case(label=k, world=world, titan=v, shape=shape) for k, v in titan.items()]
    out += [Case(label=f"{k} [tt]", world=world, titan=v, zoo=False, shape=shape) for k, v in titan.items()
            if v.pp == 1 and v.ac == "none"]
    out += [Case(label=f"search cpu:{world}", world=world, titan=None, shape=shape),
            Case(label=f"search cpu:{world} [tt]", world=world, titan=None, zoo=False, shape=shape)]
    return out


# ---- on the ranks ----------------------------------------------------------------------------

def _batches(n: int) -> list[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, SHAPE.vocab, (GLOBAL_BATCH, SHAPE.seq), generator=g),
             torch.randint(0, SHAPE.vocab, (GLOBAL_BATCH, SHAPE.seq), generator=g)) for _ in range(n)]


def _build(case: Case, kind: str, world: int) -> tuple[Callable[[Any], float], Any, Any]:
    """This rank's step (global batch -> global loss), its configuration and its program
    (autopar's; None for torchtitan): kind "autopar" (A / A[tt] / S / S[tt]), "compiled"
    (A with `compiled=True`: Inductor on the per-rank graphs) or "titan" (T)."""
    import torch

    import autopar
    import benchmarks.baselines.torchtitan_baseline as tb

    if kind == "titan":
        program = tb.build(case.shape, case.titan, global_batch=GLOBAL_BATCH, lr=LR)
        return program.step, None, None
    model = tb.zoo_model(case.shape) if case.zoo else tb.reference_model(case.shape)
    example = _batches(1)[0]
    options: dict[str, Any] = dict(example_inputs=example, optimizer=functools.partial(torch.optim.AdamW, lr=LR))
    if not case.zoo:
        options["loss_fn"] = tb.titan_loss
    if case.titan is not None:
        options["config"] = replace(autopar_config(case.titan), compiled=kind == "compiled")
    compiled = autopar.compile(model, f"cpu:{world}", **options)
    return compiled.step, compiled.config, compiled.program


def _kinds(case: Case) -> list[str]:
    return ["autopar"] + (["compiled"] if case.compiled else []) + (
        ["titan"] if case.titan is not None and case.zoo else [])


def memory_worker(rank: int, world_cases: list[Case]) -> dict[str, Any]:
    """Each program alone: ORACLE_STEPS steps, their losses, peak RSS growth."""
    import torch.distributed as dist

    return_freed_memory_to_os()
    batches = _batches(ORACLE_STEPS)
    out: dict[str, Any] = {}
    for case in world_cases:
        # one throwaway build + step of each of this configuration's programs first (not the
        # compiled one: its compile is measured cold, with it): one-time set-up (imports, gloo
        # state, the first use of the configuration's collectives and placements, DTensor's
        # caches, allocator arenas) must not be charged to whichever program is measured
        # first. Warmed once per run only, fsdp4's zoo row paid 43 MiB against 27 for the same
        # configuration on torchtitan's module, measured after it (as benchmarks/measure_cpu.py
        # found for its programs).
        for kind in _kinds(case):
            if kind != "compiled":
                step, _, program = _build(case, kind, dist.get_world_size())
                step(batches[0])
                del step, program  # not held while the measured program builds
                gc.collect()
        out[case.label] = {}
        for kind in _kinds(case):
            gc.collect()
            rss0 = _mem_kib("VmRSS")
            _reset_peak()
            step, config, program = _build(case, kind, dist.get_world_size())
            build_kib = _mem_kib("VmHWM") - rss0
            _reset_peak()  # the steps' own peak from here (VmHWM restarts at the current size)
            losses = [step(b) for b in batches]
            steps_kib = _mem_kib("VmHWM") - rss0
            gc.collect()
            held = live_tensor_bytes()  # then one more step, profiled: the tensors' own peak
            tensor_peak = held + step_peak_bytes(functools.partial(step, batches[0]))
            out[case.label][kind] = {"losses": losses, "peak_rss_delta_bytes": max(build_kib, steps_kib) * 1024,
                                     "tensor_peak_bytes": tensor_peak,
                                     "build_peak_rss_delta_bytes": build_kib * 1024,
                                     "steps_peak_rss_delta_bytes": steps_kib * 1024,
                                     "config": config.to_json() if config is not None else None,
                                     "compile_s": sum(program.compile_times().values()) if program else 0.0}
            del step, program
            gc.collect()
    return out


def timing_worker(rank: int, world_cases: list[Case], rounds: int) -> dict[str, list[float]]:
    """Every program of this world size side by side; per-program step times over the rounds."""
    import torch.distributed as dist

    world = dist.get_world_size()
    programs: list[tuple[str, Callable[[Any], float]]] = []
    for case in world_cases:
        for kind in _kinds(case):
            programs.append((f"{case.label}|{kind}", _build(case, kind, world)[0]))
    batches = _batches(WARMUP_STEPS + rounds)
    for batch in batches[:WARMUP_STEPS]:
        for _, step in programs:
            _timed(step, batch)
    times: dict[str, list[float]] = {key: [] for key, _ in programs}
    for k, batch in enumerate(batches[WARMUP_STEPS:]):
        for key, step in programs if k % 2 == 0 else programs[::-1]:
            times[key].append(_timed(step, batch)[0])
        if rank == 0:
            print(f"  [world {world}] round {k + 1}/{rounds} done", flush=True)
    return times


def _ordered(world_cases: list[Case]) -> list[Case]:
    """A configuration's A, T and A[tt] next to each other in every round."""
    out: list[Case] = []
    for case in world_cases:
        if case in out:
            continue
        out.append(case)
        out += [c for c in world_cases if c not in out and c.titan == case.titan and c.titan is not None]
    return out


def profile_worker(rank: int, case: Case, rounds: int = PROFILE_ROUNDS) -> dict[str, Any]:
    """torch.profiler over single steps of autopar's and torchtitan's program of one case,
    built side by side and profiled in alternation (A T, T A, ...), so the machine's load
    drifts hit both alike; per-op calls and times are averaged per step."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    world = dist.get_world_size()
    kinds = ("autopar", "titan")
    steps = {kind: _build(case, kind, world)[0] for kind in kinds}
    batches = _batches(WARMUP_STEPS + rounds)
    for b in batches[:WARMUP_STEPS]:
        for kind in kinds:
            steps[kind](b)
    totals: dict[str, dict[str, list[float]]] = {kind: {} for kind in kinds}
    walls: dict[str, list[float]] = {kind: [] for kind in kinds}
    for r, b in enumerate(batches[WARMUP_STEPS:]):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            dist.barrier()
            start = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                steps[kind](b)
                dist.barrier()
            walls[kind].append(time.perf_counter() - start)
            for e in prof.key_averages():
                acc = totals[kind].setdefault(e.key, [0.0, 0.0, 0.0])
                acc[0] += e.count
                acc[1] += e.self_cpu_time_total / 1e6
                acc[2] += e.cpu_time_total / 1e6
    return {kind: {"step_s": statistics.median(walls[kind]),
                   "rows": [{"name": name, "count": c / rounds, "self_cpu_s": self_s / rounds, "cpu_s": cpu_s / rounds}
                            for name, (c, self_s, cpu_s) in totals[kind].items()]} for kind in kinds}


COLLECTIVE_KEYS = ("c10d", "gloo", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                   "broadcast", "send", "recv", "barrier", "wait_tensor")


def _is_collective(name: str) -> bool:
    low = name.lower()
    return any(k in low for k in COLLECTIVE_KEYS) and not low.startswith("aten::")


def profile_report(label: str, per_rank: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: per program, collective calls per step (rank 0 and summed over ranks)
    and the top self-CPU ops on rank 0, side by side."""
    lines = [f"## `{label}`: where the time goes (torch.profiler, {PROFILE_ROUNDS} alternating steps of each, "
             "per step)", ""]
    for kind in ("autopar", "titan"):
        steps = [r[kind]["step_s"] for r in per_rank]
        lines.append(f"- {'torchtitan' if kind == 'titan' else kind}: {statistics.median(steps) * 1e3:.0f} ms/step (median over steps and ranks of the "
                     "profiled wall time; the profiler adds overhead)")
    lines += ["", "Collectives and communication ops (calls per step on rank 0 / CPU ms per step including the ops they call, rank 0; "
              "calls summed over all ranks):", "",
              "| op | autopar calls r0 | autopar ms r0 | autopar calls all | torchtitan calls r0 | torchtitan ms r0 | "
              "torchtitan calls all |", "|---|---|---|---|---|---|---|"]
    names = sorted({row["name"] for r in per_rank for k in ("autopar", "titan") for row in r[k]["rows"]
                    if _is_collective(row["name"])})

    def get(rank_rec: dict[str, Any], kind: str, name: str, field: str) -> float:
        return next((row[field] for row in rank_rec[kind]["rows"] if row["name"] == name), 0.0)

    for name in names:
        cells = []
        for kind in ("autopar", "titan"):
            cells += [f"{get(per_rank[0], kind, name, 'count'):.1f}",
                      f"{get(per_rank[0], kind, name, 'cpu_s') * 1e3:.1f}",
                      f"{sum(get(r, kind, name, 'count') for r in per_rank):.0f}"]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    lines += ["", "Top ops by self CPU time on rank 0 (ms per step):", "",
              "| autopar op | ms | calls | torchtitan op | ms | calls |", "|---|---|---|---|---|---|"]
    tops = {k: sorted(per_rank[0][k]["rows"], key=lambda row: -row["self_cpu_s"])[:15] for k in ("autopar", "titan")}
    for a, t in zip(tops["autopar"], tops["titan"]):
        lines.append(f"| `{a['name']}` | {a['self_cpu_s'] * 1e3:.1f} | {a['count']:.0f} | `{t['name']}` | "
                     f"{t['self_cpu_s'] * 1e3:.1f} | {t['count']:.0f} |")
    # aten ops (compute and memory) whose per-step counts differ: deterministic, unlike the times
    by_kind = {k: {row["name"]: row for row in per_rank[0][k]["rows"] if row["name"].startswith("aten::")}
               for k in ("autopar", "titan")}
    differ = sorted((name for name in set(by_kind["autopar"]) | set(by_kind["titan"])
                     if round(by_kind["autopar"].get(name, {}).get("count", 0.0), 1)
                     != round(by_kind["titan"].get(name, {}).get("count", 0.0), 1)),
                    key=lambda name: -abs(by_kind["autopar"].get(name, {}).get("self_cpu_s", 0.0)
                                          - by_kind["titan"].get(name, {}).get("self_cpu_s", 0.0)))
    lines += ["", "ATen ops whose calls per step differ on rank 0 (largest self-CPU difference first):", "",
              "| op | autopar calls | autopar ms | torchtitan calls | torchtitan ms |", "|---|---|---|---|---|"]
    for name in differ[:20]:
        a, t = by_kind["autopar"].get(name, {}), by_kind["titan"].get(name, {})
        lines.append(f"| `{name}` | {a.get('count', 0.0):.1f} | {a.get('self_cpu_s', 0.0) * 1e3:.1f} | "
                     f"{t.get('count', 0.0):.1f} | {t.get('self_cpu_s', 0.0) * 1e3:.1f} |")
    return lines + [""]


# ---- in the parent -------------------------------------------------------------------------

def oracle(world_cases: list[Case], memory: list[dict[str, Any]], reference: list[float]) -> list[str]:
    """Every program's first ORACLE_STEPS losses vs the single-process reference; returns
    the misses (empty when all agree), one line each."""
    bad = []
    for case in world_cases:
        for kind, rec in memory[0][case.label].items():
            for k, (got, ref) in enumerate(zip(rec["losses"], reference)):
                rtol = FIRST_RTOL if k == 0 else LATER_RTOL
                if not abs(got - ref) <= rtol * abs(ref):
                    bad.append(f"{case.label} ({kind}) step {k + 1}: loss {got:.6f} vs single-process {ref:.6f} "
                               f"(rtol {rtol:g})")
            for r, other in enumerate(memory):
                if other[case.label][kind]["losses"] != rec["losses"]:
                    bad.append(f"{case.label} ({kind}): rank {r} reports other losses than rank 0")
    return bad


def run_world(world: int, world_cases: list[Case], reference: list[float], rounds: int) -> dict[str, Any]:
    from autopar.runtime.launch import spawn

    t = time.perf_counter()  # the memory ranks return freed memory to the OS (memory_worker), the timed ones not
    memory = spawn(memory_worker, world, (world_cases,), collective_timeout_s=300.0, timeout_s=1800.0)
    print(f"[world {world}: memory and oracle phase {time.perf_counter() - t:.0f} s]", flush=True)
    bad = oracle(world_cases, memory, reference)
    if bad:
        print("ORACLE FAILED: these programs do not train like one process:\n  " + "\n  ".join(bad), flush=True)
        raise SystemExit(1)
    t = time.perf_counter()
    times = spawn(timing_worker, world, (world_cases, rounds), collective_timeout_s=300.0, timeout_s=1800.0)[0]
    print(f"[world {world}: timing phase {time.perf_counter() - t:.0f} s]", flush=True)
    out: dict[str, Any] = {}
    for case in world_cases:
        out[case.label] = {}
        for kind in _kinds(case):
            rec = memory[0][case.label][kind]
            out[case.label][kind] = {
                "step_times_s": times[f"{case.label}|{kind}"],
                "step_time_s": statistics.median(times[f"{case.label}|{kind}"]),
                "losses": rec["losses"], "config": rec["config"],
                **{f"{phase}peak_rss_delta_bytes": max(m[case.label][kind][f"{phase}peak_rss_delta_bytes"] for m in memory)
                   for phase in ("", "build_", "steps_")},
                "tensor_peak_bytes": max(m[case.label][kind]["tensor_peak_bytes"] for m in memory),
                "compile_s": max(m[case.label][kind]["compile_s"] for m in memory),
            }
    return out


def _ratio_stats(titan_s: list[float], autopar_s: list[float]) -> dict[str, float]:
    """Median and quartiles over rounds of t_torchtitan / t_autopar (same round, adjacent)."""
    per_round = [x / y for x, y in zip(titan_s, autopar_s)]
    q1, _, q3 = statistics.quantiles(per_round, n=4)
    return {"ratio": statistics.median(per_round), "ratio_q1": q1, "ratio_q3": q3}


def rows_of(world_cases: list[Case], measured: dict[str, Any]) -> list[dict[str, Any]]:
    tokens = GLOBAL_BATCH * SHAPE.seq
    rows = []
    titan_of = {c.titan: c.label for c in world_cases if c.titan is not None and c.zoo}
    for case in world_cases:
        a = measured[case.label]["autopar"]
        t = measured[titan_of[case.titan]]["titan"] if case.titan is not None else None
        rows.append({
            "label": case.label, "world": case.world, "autopar_model": "zoo Llama" if case.zoo else "torchtitan Llama3",
            "titan": None if case.titan is None else asdict(case.titan),
            "autopar_config": a["config"],
            "autopar_step_time_s": a["step_time_s"], "autopar_step_times_s": a["step_times_s"],
            "autopar_tokens_per_s": tokens / a["step_time_s"], "autopar_losses": a["losses"],
            "autopar_peak_rss_delta_bytes": a["peak_rss_delta_bytes"],
            "autopar_build_peak_rss_delta_bytes": a["build_peak_rss_delta_bytes"],
            "autopar_steps_peak_rss_delta_bytes": a["steps_peak_rss_delta_bytes"],
            "autopar_tensor_peak_bytes": a["tensor_peak_bytes"],
            "titan_step_time_s": t["step_time_s"] if t else None, "titan_step_times_s": t["step_times_s"] if t else None,
            "titan_tokens_per_s": tokens / t["step_time_s"] if t else None, "titan_losses": t["losses"] if t else None,
            "titan_peak_rss_delta_bytes": t["peak_rss_delta_bytes"] if t else None,
            "titan_build_peak_rss_delta_bytes": t["build_peak_rss_delta_bytes"] if t else None,
            "titan_steps_peak_rss_delta_bytes": t["steps_peak_rss_delta_bytes"] if t else None,
            "titan_tensor_peak_bytes": t["tensor_peak_bytes"] if t else None,
            **(_ratio_stats(t["step_times_s"], a["step_times_s"]) if t else {"ratio": None}),
        })
        c = measured[case.label].get("compiled")
        if c is not None:  # compiled over eager, per round (> 1: compiled faster)
            stats = _ratio_stats(a["step_times_s"], c["step_times_s"])
            rows[-1].update(compiled_step_time_s=c["step_time_s"], compiled_step_times_s=c["step_times_s"],
                            compiled_tokens_per_s=tokens / c["step_time_s"], compiled_losses=c["losses"],
                            compiled_peak_rss_delta_bytes=c["peak_rss_delta_bytes"],
                            compile_s=c["compile_s"], compiled_speedup=stats["ratio"],
                            compiled_speedup_q1=stats["ratio_q1"], compiled_speedup_q3=stats["ratio_q3"])
    for world in sorted({c.world for c in world_cases}):
        titans = [r for r in rows if r["world"] == world and r["titan_step_time_s"] is not None
                  and r["autopar_model"] == "zoo Llama"]
        if not titans:
            continue
        best = min(titans, key=lambda r: r["titan_step_time_s"])
        for r in rows:
            if r["world"] == world and r["titan"] is None:
                r["vs_best_titan"] = best["label"]
                r.update(_ratio_stats(best["titan_step_times_s"], r["autopar_step_times_s"]))
                r["titan_step_time_s"] = best["titan_step_time_s"]
                r["titan_tokens_per_s"] = best["titan_tokens_per_s"]
                for phase in ("", "build_", "steps_"):
                    r[f"titan_{phase}peak_rss_delta_bytes"] = best[f"titan_{phase}peak_rss_delta_bytes"]
                r["titan_tensor_peak_bytes"] = best["titan_tensor_peak_bytes"]
    return rows


def _describe(config: dict[str, Any] | None) -> str:
    if not config:
        return "-"
    parts = [f"dp{config['dp']}" if config["dp"] > 1 else "", f"tp{config['tp']}" if config["tp"] > 1 else "",
             f"pp{config['pp']}" if config["pp"] > 1 else ""]
    text = " x ".join(p for p in parts if p) or "1 device"
    text += f", zero {config['zero']}, micro-batch {config['micro_batch']}"
    if config["pp"] > 1:
        text += f", {config['schedule']}" + (f" v{config['interleave']}" if config["interleave"] > 1 else "")
    if config["recompute"] != "none":
        text += f", recompute {config['recompute']}"
    return text


def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    shared = [r for r in rows if r["titan"] is not None and r["autopar_model"] == "zoo Llama"]
    out = []
    if shared:
        ratios = [r["ratio"] for r in shared]
        slow = [f"{r['label']} ({r['world']}p) {r['ratio']:.3f} (quartiles {r['ratio_q1']:.2f}-{r['ratio_q3']:.2f})"
                for r in shared if r["ratio"] < 0.95]
        out.append(f"autopar / torchtitan over {len(shared)} shared configurations (zoo Llama, same weights): "
                   f"min {min(ratios):.3f}, median {statistics.median(ratios):.3f}, max {max(ratios):.3f}; "
                   f"below 0.95: {', '.join(slow) if slow else 'none'}")
        memory = [r["autopar_peak_rss_delta_bytes"] / r["titan_peak_rss_delta_bytes"] for r in shared
                  if r["titan_peak_rss_delta_bytes"]]
        if memory:
            within = sum(m <= 1.1 for m in memory)
            out.append(f"peak memory per rank, autopar / torchtitan, over {len(memory)} shared configurations: "
                       f"min {min(memory):.2f}, median {statistics.median(memory):.2f}, max {max(memory):.2f}; "
                       f"within 1.1x on {within} of {len(memory)}")
        tensors = [r["autopar_tensor_peak_bytes"] / r["titan_tensor_peak_bytes"] for r in shared
                   if r.get("titan_tensor_peak_bytes")]
        if tensors:
            within = sum(m <= 1.1 for m in tensors)
            out.append(f"peak live tensor bytes per rank, autopar / torchtitan, over {len(tensors)} shared "
                       f"configurations: min {min(tensors):.2f}, median {statistics.median(tensors):.2f}, "
                       f"max {max(tensors):.2f}; within 1.1x on {within} of {len(tensors)}")
    tt = [r for r in rows if r["titan"] is not None and r["autopar_model"] != "zoo Llama"]
    if tt:
        out.append("autopar compiling torchtitan's module itself / torchtitan: "
                   + ", ".join(f"{r['label']} {r['ratio']:.3f}" for r in tt))
    fused = [r for r in rows if r.get("compiled_speedup") is not None]
    if fused:
        out.append("compiled (--compile) / eager autopar, per round: " + ", ".join(
            f"{r['label']} {r['compiled_speedup']:.3f} (quartiles {r['compiled_speedup_q1']:.2f}-"
            f"{r['compiled_speedup_q3']:.2f}; cold compile {r['compile_s']:.0f} s)" for r in fused))
    for r in rows:
        if r["titan"] is None:
            out.append(f"{r['label']} ({r['world']} processes): {_describe(r['autopar_config'])}; vs torchtitan's "
                       f"fastest configuration ({r['vs_best_titan']}): {r['ratio']:.3f}x per round (quartiles "
                       f"{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f})")
    return out


def write_markdown(out: dict[str, Any], path: Path, extra: list[str]) -> None:
    def f(v: Any, spec: str, scale: float = 1.0) -> str:
        return "-" if v is None else format(v * scale, spec)

    lines = [
        "# autopar vs torchtitan 0.3.0, measured on this machine (CPU, gloo)",
        "",
        f"Generated by `benchmarks/measure_torchtitan.py` (`make bench-torchtitan`), torch {out['torch']}, "
        f"torchtitan {out['torchtitan']}, autopar at commit {out['commit']}.",
        "",
        f"Model: torchtitan's Llama3 (`{out['shape']}`; q, k, v "
        f"{'fused in one GEMM (wqkv, its flavors default)' if out['fuse_qkv'] else 'in three GEMMs, its stock QKVLinear, as the zoo Llama'}), "
        "torchtitan's init (seed 0), global batch "
        f"{out['global_batch']} x seq {out['seq']}, fp32, AdamW lr {LR}, no gradient clipping on either side. "
        "torchtitan: its own `parallelize_llama` / `pipeline_llm` (benchmarks/baselines/torchtitan_baseline.py, CPU "
        "workarounds W1-W6 named there). autopar: `autopar.compile(..., config=ParallelConfig(...))` on its zoo "
        "Llama holding the same weights (rows without [tt]) or on torchtitan's module itself ([tt]: the per-op "
        "compiler shards any model on one stage; pipelines still need the zoo's rule tables); `autopar search`: "
        "`autopar.compile` without config=. Every row passed the oracle: the first "
        f"{out['oracle_steps']} losses of each program equal the single-process losses of the unsharded model "
        f"(rtol {FIRST_RTOL:g} first step, {LATER_RTOL:g} later).",
        "",
        f"Timing: all programs of one world size built side by side, {out['warmup_steps']} warm-up rounds, "
        f"{out['timed_steps']} timed rounds of one step of each (order reversed every other round); "
        "autopar/torchtitan = median over rounds of t_torchtitan / t_autopar (> 1: autopar faster). Memory: peak "
        "RSS growth per rank over its size before the build, each program alone, max over ranks: the whole run's "
        "(MiB/rank), and apart the build's and the steps' (build / steps, autopar then torchtitan; the steps' "
        "peak counts what the build left resident); tensors: the peak of the bytes live tensors hold in one "
        "more step, per rank, max over ranks (benchmarks/lib/tensor_memory.py: the figure that device memory "
        "holds on a GPU, without the Python heap and the allocator's arenas). The machine has 2 cores shared with other "
        "users: ratios are the figure to read; absolute times move with the load.",
        "",
        "| configuration (torchtitan) | procs | autopar runs | autopar config | autopar tok/s | torchtitan tok/s | "
        "autopar/torchtitan (quartiles) | autopar MiB/rank | torchtitan MiB/rank | build A / T | steps A / T | "
        "tensors A / T | first loss A | first loss T |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        label = r["label"] if r["titan"] is not None else f"{r['label']} vs fastest ({r['vs_best_titan']})"
        lines.append(
            f"| {label} | {r['world']} | {r['autopar_model']} | {_describe(r['autopar_config'])} | "
            f"{f(r['autopar_tokens_per_s'], ',.0f')} | {f(r['titan_tokens_per_s'], ',.0f')} | "
            f"{f(r['ratio'], '.3f')} ({f(r.get('ratio_q1'), '.2f')}-{f(r.get('ratio_q3'), '.2f')}) | "
            f"{f(r['autopar_peak_rss_delta_bytes'], '.0f', 2**-20)} | "
            f"{f(r['titan_peak_rss_delta_bytes'], '.0f', 2**-20)} | "
            f"{f(r.get('autopar_build_peak_rss_delta_bytes'), '.0f', 2**-20)} / "
            f"{f(r.get('titan_build_peak_rss_delta_bytes'), '.0f', 2**-20)} | "
            f"{f(r.get('autopar_steps_peak_rss_delta_bytes'), '.0f', 2**-20)} / "
            f"{f(r.get('titan_steps_peak_rss_delta_bytes'), '.0f', 2**-20)} | "
            f"{f(r.get('autopar_tensor_peak_bytes'), '.1f', 2**-20)} / "
            f"{f(r.get('titan_tensor_peak_bytes'), '.1f', 2**-20)} | {f(r['autopar_losses'][0], '.5f')} | "
            f"{f(r['titan_losses'][0] if r['titan_losses'] else None, '.5f')} |")
    fused = [r for r in out["rows"] if r.get("compiled_speedup") is not None]
    if fused:
        lines += ["", "Compiled (`compiled=True`: Inductor on every per-rank graph) beside eager, autopar's zoo Llama, "
                  "timed in the same rounds; compile: seconds Inductor spent on one rank's graphs with an empty "
                  "cache (a rerun with the persistent cache takes a fraction).", "",
                  "| configuration | procs | eager tok/s | compiled tok/s | compiled/eager (quartiles) | "
                  "compile s | eager MiB/rank | compiled MiB/rank | first loss eager | first loss compiled |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in fused:
            lines.append(
                f"| {r['label']} | {r['world']} | {f(r['autopar_tokens_per_s'], ',.0f')} | "
                f"{f(r['compiled_tokens_per_s'], ',.0f')} | {f(r['compiled_speedup'], '.3f')} "
                f"({f(r['compiled_speedup_q1'], '.2f')}-{f(r['compiled_speedup_q3'], '.2f')}) | "
                f"{f(r['compile_s'], '.1f')} | {f(r['autopar_peak_rss_delta_bytes'], '.0f', 2**-20)} | "
                f"{f(r['compiled_peak_rss_delta_bytes'], '.0f', 2**-20)} | {f(r['autopar_losses'][0], '.5f')} | "
                f"{f(r['compiled_losses'][0], '.5f')} |")
    path.write_text("\n".join(lines + [""] + [f"- {line}" for line in out["summary"]] + [""] + extra) + "\n")


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in out["rows"] if r["titan_tokens_per_s"] is not None]
    def short(label: str) -> str:
        return label.replace(" x ", "x").replace(" [tt]", "\n[tt]").replace(" +AC", "\n+AC").replace(
            " interleaved x2", "\ninterleaved")

    labels = [(short(r["label"]) if r["titan"] is not None else f"{short(r['label'])}\nvs {short(r['vs_best_titan'])}")
              + f"\n({r['world']}p)" for r in rows]
    fig, (ax, ax_mem) = plt.subplots(2, 1, figsize=(max(10, 0.85 * len(rows)), 8.5), sharex=True)
    x = range(len(rows))
    w = 0.38
    ax.bar([i - w / 2 for i in x], [r["autopar_tokens_per_s"] for r in rows], w, label="autopar", color="tab:blue")
    ax.bar([i + w / 2 for i in x], [r["titan_tokens_per_s"] for r in rows], w, label="torchtitan", color="tab:orange")
    for i, r in zip(x, rows):
        top = max(r["autopar_tokens_per_s"], r["titan_tokens_per_s"])
        ax.text(i, top * 1.02, f"{r['ratio']:.2f}", ha="center", fontsize=8,
                color="black" if r["ratio"] >= 0.95 else "tab:red")
    ax.set_ylabel("tokens/s (whole job)")
    ax.set_title("autopar vs torchtitan 0.3.0 on this 2-core machine (gloo); number: autopar/torchtitan per round "
                 "(red: < 0.95)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax_mem.bar([i - w / 2 for i in x], [r["autopar_peak_rss_delta_bytes"] / 2**20 for r in rows], w, color="tab:blue")
    ax_mem.bar([i + w / 2 for i in x], [r["titan_peak_rss_delta_bytes"] / 2**20 for r in rows], w, color="tab:orange")
    ax_mem.set_ylabel("peak RSS growth per rank (MiB)")
    ax_mem.set_xticks(list(x))
    ax_mem.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
    ax_mem.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--md", default=None, help="write a markdown table here")
    parser.add_argument("--plot", default=None, help="write a PNG here (needs matplotlib)")
    parser.add_argument("--only", default="", help="comma-separated configuration labels")
    parser.add_argument("--rounds", type=int, default=TIMED_STEPS, help="timed rounds")
    parser.add_argument("--fused-qkv", action="store_true",
                        help="torchtitan's fused wqkv (one GEMM) where the zoo Llama has three")
    parser.add_argument("--no-world8", action="store_true", help="skip the 8-process configurations")
    parser.add_argument("--compiled", action="store_true",
                        help="also run autopar's program compiled by Inductor on each zoo configuration, "
                             "beside eager (an empty Inductor cache: compile times are cold)")
    parser.add_argument("--profile", default=None, metavar="LABEL",
                        help="only profile one configuration's autopar and torchtitan programs")
    parser.add_argument("--profile-md", default=None, help="append the profile report to this markdown file")
    parser.add_argument("--profile-below", type=float, default=None, metavar="RATIO",
                        help="after measuring, profile every shared configuration whose autopar/torchtitan "
                             "ratio is below RATIO and add the report to --md")
    args = parser.parse_args(argv)

    import benchmarks.baselines.torchtitan_baseline as tb

    why = tb.available()
    if why is not None:
        print(SKIP_LINE.format(why=why))
        return 0
    import subprocess

    import torch

    from autopar.runtime.launch import spawn

    shape = replace(SHAPE, fuse_qkv=True) if args.fused_qkv else SHAPE
    all_cases = cases(4, shape) + ([] if args.no_world8 else cases(8, shape))
    if args.profile:
        case = next((c for c in all_cases if c.label == args.profile and c.titan is not None and c.zoo), None)
        if case is None:
            raise SystemExit(f"--profile: no configuration {args.profile!r}; pick one of "
                             f"{[c.label for c in all_cases if c.titan is not None and c.zoo]}")
        per_rank = spawn(profile_worker, case.world, (case,), collective_timeout_s=300.0)
        lines = profile_report(case.label, per_rank)
        print("\n".join(lines))
        if args.profile_md:
            with open(args.profile_md, "a") as fh:
                fh.write("\n".join(lines) + "\n")
        return 0
    if args.compiled:
        import os
        import tempfile

        all_cases = [replace(c, compiled=c.titan is not None and c.zoo) for c in all_cases]
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-inductor-")  # the ranks inherit it
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {c.label for c in all_cases}
        if unknown:
            raise SystemExit(f"--only: unknown labels {sorted(unknown)}; known: {[c.label for c in all_cases]}")
        all_cases = [c for c in all_cases if c.label in wanted]
    t0 = time.perf_counter()
    reference = tb.reference_losses(shape, _batches(ORACLE_STEPS), lr=LR)
    print(f"model {shape.zoo_spec} (torchtitan Llama3, {'fused wqkv' if shape.fuse_qkv else 'wq, wk, wv'}), "
          f"global batch {GLOBAL_BATCH}; single-process losses "
          f"{[round(x, 6) for x in reference]}", flush=True)
    measured: dict[str, Any] = {}
    for world in (4, 8):
        world_cases = _ordered([c for c in all_cases if c.world == world])
        if world_cases:
            measured.update(run_world(world, world_cases, reference, args.rounds))
    rows = rows_of(all_cases, measured)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    out = {"shape": shape.zoo_spec, "fuse_qkv": shape.fuse_qkv, "global_batch": GLOBAL_BATCH, "seq": SHAPE.seq, "rows": rows,
           "warmup_steps": WARMUP_STEPS, "timed_steps": args.rounds, "oracle_steps": ORACLE_STEPS,
           "reference_losses": reference, "torch": torch.__version__, "torchtitan": tb.TORCHTITAN_VERSION,
           "commit": commit}
    out["summary"] = summary_lines(rows)
    print(f"\n{'configuration':<26}{'N':>3}{'autopar tok/s':>15}{'titan tok/s':>13}{'ratio':>8}{'A MiB':>8}{'T MiB':>8}")
    for r in rows:
        def f(v: Any, spec: str, scale: float = 1.0) -> str:
            return "-" if v is None else format(v * scale, spec)

        print(f"{r['label']:<26}{r['world']:>3}{f(r['autopar_tokens_per_s'], ',.0f'):>15}"
              f"{f(r['titan_tokens_per_s'], ',.0f'):>13}{f(r['ratio'], '.3f'):>8}"
              f"{f(r['autopar_peak_rss_delta_bytes'], '.0f', 2**-20):>8}{f(r['titan_peak_rss_delta_bytes'], '.0f', 2**-20):>8}"
              f"  build {f(r['autopar_build_peak_rss_delta_bytes'], '.0f', 2**-20)}/"
              f"{f(r['titan_build_peak_rss_delta_bytes'], '.0f', 2**-20)}"
              f"  steps {f(r['autopar_steps_peak_rss_delta_bytes'], '.0f', 2**-20)}/"
              f"{f(r['titan_steps_peak_rss_delta_bytes'], '.0f', 2**-20)}")
    print("\n" + "\n".join(out["summary"]))
    print(f"[measure_torchtitan total {time.perf_counter() - t0:.0f} s]")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    extra: list[str] = []
    if args.profile_below is not None:
        slow = [c for c in all_cases if c.titan is not None and c.zoo
                and next(r for r in rows if r["label"] == c.label)["ratio"] < args.profile_below]
        extra = ["# Where autopar is slower", "",
                 f"Every shared configuration below {args.profile_below:g} in this run, profiled again (autopar's "
                 "and torchtitan's program side by side, alternating steps)." if slow else
                 f"No shared configuration measured below {args.profile_below:g} in this run.", ""]
        for case in slow:
            per_rank = spawn(profile_worker, case.world, (case,), collective_timeout_s=300.0)
            extra += profile_report(case.label, per_rank)
            print("\n".join(profile_report(case.label, per_rank)), flush=True)
        out["profiled"] = [c.label for c in slow]
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    if args.md:
        write_markdown(out, Path(args.md), extra=extra)
    if args.plot:
        plot(out, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
