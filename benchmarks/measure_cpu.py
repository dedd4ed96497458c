"""autopar vs the hand-tuned 3D baseline, measured on this machine (gloo, CPU), and how
well the calibrated cost model ranks the same configurations.

    .venv/bin/python benchmarks/measure_cpu.py [--profile4 p4.json] [--profile8 p8.json]
        [--quick] [--json out.json]

For each configuration (4 processes: dp4, zero3 dp4, dp2xtp2, dp2xpp2, tp2xpp2, plus the
plan `autopar search` finds for cpu:4 with the calibrated profile; 8 processes:
dp2xtp2xpp2) the same spawned ranks run, on the same model, seed and global batch:
  A  autopar's program (autopar.build.build_program with the ParallelConfig's placements, as
     `autopar train` / `autopar.compile` build it), and
  H  the hand-tuned torchtitan-style baseline (benchmarks/baselines/handtuned.py),
with every program of one world size built side by side and timed in rounds (one step of
each program per round, the order reversed every other round; a configuration's A and H
are adjacent in every round), so slow phases of the shared machine hit all figures alike.

Figures (the machine has 2 cores shared with other users: noisy):
- step time: barrier; step; barrier, timed on rank 0; median over TIMED_STEPS rounds after
  WARMUP_STEPS untimed rounds. tokens/s = global batch x seq / that. The ratio
  autopar / hand-tuned is the median over the rounds of t_H / t_A (adjacent steps); the
  searched plan vs the fastest hand-tuned program, the median over rounds of their ratio.
- peak memory per rank: the growth of the resident set while building and stepping,
  VmHWM after the steps minus VmRSS before the build (VmHWM reset through
  /proc/self/clear_refs, glibc's mmap threshold fixed at 64 KiB so freed tensors go back
  to the OS between builds); max over ranks; each program built alone for this, in a
  separate set of ranks: the timed ranks keep glibc's default allocator settings. The
  build's own peak (VmHWM before the first step) is reported beside it; the figure
  compared is the whole (build + steps) peak.
- losses: the first step's global loss of A and H (same init and data: they must agree).
- predicted: `analytic.price` (the baseline, benchmarks/baselines/analytic/) of each configuration (float32 trace) on `cpu:N` with the
  calibrated profile (`autopar calibrate --devices N --out ...`); Spearman rank
  correlation of predicted vs measured step time over the measured configurations.

Diagnostic (not part of run_all): `--diagnose-pp tp2xpp2` runs autopar's program as is and
with its pipeline schedule object built once (patched in the benchmark's ranks only), to
show what rebuilding the schedule every step costs.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.lib.bench_stats import spearman  # noqa: E402

MODEL = "llama:layers=4,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=1024,seq=64"
"""A slightly larger llama-small (4 layers, hidden 256, GQA 4/2 heads): big enough that
GEMMs, not Python overhead, are a visible share of a step; small enough for world 8."""
GLOBAL_BATCH = 16
WARMUP_STEPS = 2
TIMED_STEPS = 12
"""Timed rounds (one step of every program each) after WARMUP_STEPS untimed rounds."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    label: str
    world: int
    config: Any  # ParallelConfig
    hand: Any | None  # HandConfig, None for autopar's searched plan
    stage_layers: tuple[int, ...] | None = None


def cases(world: int, searched: Any | None = None) -> list[Case]:
    from autopar.config import ParallelConfig
    from benchmarks.baselines.handtuned import HandConfig

    def both(label: str, **kw: Any) -> Case:
        hand = {k: v for k, v in kw.items() if k in ("dp", "tp", "pp", "zero", "micro_batch", "schedule")}
        return Case(label=label, world=world, config=ParallelConfig(sequence_parallel=True, **kw),
                    hand=HandConfig(sequence_parallel=True, **hand))

    if world == 8:
        return [both("dp2xtp2xpp2", dp=2, tp=2, pp=2, micro_batch=2)]
    out = [
        both("dp4", dp=4, micro_batch=4),
        both("zero3 dp4", dp=4, zero=3, micro_batch=4),
        both("dp2xtp2", dp=2, tp=2, micro_batch=8),
        both("dp2xpp2", dp=2, pp=2, micro_batch=2),
        both("tp2xpp2", tp=2, pp=2, micro_batch=4),
    ]
    if searched is not None:
        config, stage_layers = searched
        out.append(Case(label="autopar search", world=world, config=config, hand=None, stage_layers=stage_layers))
    return out


def kinds(case: Case) -> list[str]:
    """The programs measured for `case`: autopar's, the template (pp = 1 configurations with a
    hand-tuned twin: the module-level rule-table program the per-op compiler replaced) and the
    hand-tuned one."""
    if case.hand is None:
        return ["autopar"]
    return ["autopar"] + (["template"] if case.config.pp == 1 else []) + ["hand"]


def same_program(a: Case, b: Case) -> bool:
    """Whether two cases run the same autopar program (then it is measured once)."""
    from autopar.config import default_stage_layers

    even = lambda c: c.stage_layers in (None, tuple(default_stage_layers(4, c.config.pp)))  # noqa: E731
    return a.world == b.world and a.config == b.config and even(a) and even(b)


# ---- on the ranks ----------------------------------------------------------------------

def _mem_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


RETURN_TO_OS_BYTES = 64 * 1024
"""The memory phase's glibc mmap and trim thresholds: allocations of this size or more are
mmapped and freed memory above it goes back to the OS, so VmHWM follows the live tensors."""


def return_freed_memory_to_os(threshold: int = RETURN_TO_OS_BYTES) -> None:
    """In this process only: glibc's mmap threshold and trim threshold fixed at `threshold`
    (mallopt), so freed tensors leave the resident set and VmHWM tracks live memory. Called
    at the start of a memory-phase rank.

    Not through the environment (MALLOC_MMAP_THRESHOLD_): glibc reads it once, when a
    process starts, and ranks are forks of one forkserver reused by every later spawn
    (autopar/runtime/launch.py). Set in the environment around the memory phase's spawn,
    the first spawn of the run, it reached the forkserver and from there every timed rank
    after it: every allocation an mmap and page faults, steps 1.6-1.9x slower. Raises where the C
    library has no mallopt (not glibc): the memory figures would be meaningless."""
    import ctypes

    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallopt"):
        raise RuntimeError("the memory phase needs glibc's mallopt to return freed memory to the OS; "
                           "this C library has none (run the benchmark on glibc Linux)")
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    for param in (m_mmap_threshold, m_trim_threshold):
        if libc.mallopt(param, threshold) != 1:
            raise RuntimeError(f"mallopt({param}, {threshold}) failed")


def _global_loss(value: float | None) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value if value is not None else 0.0, 1.0 if value is not None else 0.0], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0] / t[1])


def _build(case: Case, which: str) -> tuple[Callable[[Any], float], list[Any]]:
    """This rank's step function (global batch -> global loss) and its pipeline chunks."""
    import functools

    import torch

    from autopar.api import rank0_placements
    from autopar.build import build_program
    from autopar.models import resolve
    from benchmarks.baselines.handtuned import build
    from benchmarks.baselines.template_program import build_module_program

    source = resolve(MODEL)
    if which == "autopar":
        torch.manual_seed(0)
        example = source.example_inputs(GLOBAL_BATCH, generator=torch.Generator().manual_seed(1))
        model = source.build()
        placed = rank0_placements(model, case.config, example, stage_layers=case.stage_layers)
        program = build_program(model, placed, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                example_inputs=example)
        return program.step, list(getattr(program, "chunks", ()))
    if which == "template":  # the module-level rule-table program autopar ran before the per-op compiler
        torch.manual_seed(0)
        program = build_module_program(source.build(), case.config,
                                       optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
        return program.step, list(program.chunks)
    hand = build(source.build, case.hand, num_microbatches=case.config.num_microbatches(GLOBAL_BATCH))
    dp_rank = hand.mesh.get_local_rank("dp")

    def step(b: Any) -> float:
        tokens, labels = (t.chunk(case.hand.dp)[dp_rank] for t in b)
        return _global_loss(hand.step(tokens, labels))

    return step, list(hand.stages)


def _timed(step: Callable[[Any], float], batch: Any) -> tuple[float, float]:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    loss = step(batch)
    dist.barrier()
    return time.perf_counter() - start, loss


def _run_one(case: Case, which: str, batches: list[Any], measure_memory: bool) -> dict[str, Any]:
    """Build one program alone and run `batches`: times after the warm-up, first loss, peak
    RSS growth, and pipeline-chunk forward calls in the last step."""
    gc.collect()
    rss0 = _mem_kib("VmRSS")
    _reset_peak()
    step, modules = _build(case, which)
    build_kib = _mem_kib("VmHWM") - rss0
    forwards = [0]  # oracle: one call per microbatch and chunk
    for module in modules:
        module.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    times, losses = [], []
    for k, batch in enumerate(batches):
        forwards[0] = 0
        seconds, loss = _timed(step, batch)
        losses.append(loss)
        if k >= WARMUP_STEPS:
            times.append(seconds)
    peak_kib = _mem_kib("VmHWM") - rss0
    out = {"times": times, "first_loss": losses[0], "peak_rss_delta_bytes": peak_kib * 1024 if measure_memory else None,
           "build_peak_rss_delta_bytes": build_kib * 1024 if measure_memory else None,
           "chunk_forwards_last_step": forwards[0]}
    del step, modules
    gc.collect()
    return out


def _time_round_robin(rank: int, world_cases: list[Case], searched_label: str | None,
                      batches: list[Any]) -> dict[str, Any]:
    """Every program of this world size (autopar's and the hand-tuned one per configuration,
    and autopar's searched plan) built side by side on the same ranks; WARMUP_STEPS rounds,
    then TIMED_STEPS timed rounds, each one step of every program, in order on even rounds
    and reversed on odd ones. A configuration's two programs are adjacent in every round
    (A,H then H,A), and all configurations share each round, so slow drifts of the shared
    machine's load hit every figure alike: per-configuration ratios, the ranking the cost
    model is compared with, and the searched plan vs the fastest hand-tuned program."""
    programs: list[tuple[str, str, Callable[[Any], float]]] = []
    for case in world_cases:
        for kind in kinds(case):
            programs.append((case.label, kind, _build(case, kind)[0]))
    for batch in batches[:WARMUP_STEPS]:
        for _, _, step in programs:
            _timed(step, batch)
    times: dict[tuple[str, str], list[float]] = {(label, kind): [] for label, kind, _ in programs}
    for k, batch in enumerate(batches[WARMUP_STEPS:]):
        for label, kind, step in programs if k % 2 == 0 else programs[::-1]:
            times[(label, kind)].append(_timed(step, batch)[0])
    del programs
    gc.collect()
    results: dict[str, Any] = {case.label: {} for case in world_cases}
    for (label, kind), values in times.items():
        results[label][kind] = {"times": values}
    for case in world_cases:
        rec = results[case.label]
        if rank == 0:
            a = statistics.median(rec["autopar"]["times"])
            line = f"  measured {case.label} (world {case.world}): autopar {a * 1e3:.0f} ms/step"
            if "hand" in rec:
                pairs = [h / x for h, x in zip(rec["hand"]["times"], rec["autopar"]["times"])]
                line += (f", hand-tuned {statistics.median(rec['hand']['times']) * 1e3:.0f} ms/step, "
                         f"ratio (median over step pairs) {statistics.median(pairs):.3f}")
            if "template" in rec:
                pairs = [h / x for h, x in zip(rec["hand"]["times"], rec["template"]["times"])]
                line += (f"; template {statistics.median(rec['template']['times']) * 1e3:.0f} ms/step, "
                         f"template/hand-tuned {statistics.median(pairs):.3f}")
            print(line, flush=True)
    hands = [c.label for c in world_cases if c.hand is not None]
    if searched_label in results and hands:
        best = min(hands, key=lambda label: statistics.median(results[label]["hand"]["times"]))
        mine, theirs = results[searched_label]["autopar"]["times"], results[best]["hand"]["times"]
        results["__searched_vs_best__"] = {"best": best, "searched": searched_label, "autopar": mine, "hand": theirs}
        if rank == 0:
            print(f"  autopar's searched plan {statistics.median(mine) * 1e3:.0f} ms/step vs the fastest hand-tuned "
                  f"program ({best}) {statistics.median(theirs) * 1e3:.0f} ms/step in the same rounds, ratio "
                  f"{statistics.median(h / x for h, x in zip(theirs, mine)):.3f}", flush=True)
    return results


def measure_worker(rank: int, world_cases: list[Case], searched_label: str | None = None,
                   phase: str = "timing") -> dict[str, Any]:
    """phase "memory": each program alone, a few steps: peak RSS growth, first loss, chunk
    forward calls. phase "timing": `_time_round_robin` over every case of this world size
    (`searched_label`: the case whose autopar program is autopar's searched plan)."""
    import torch

    from autopar.models import resolve

    source = resolve(MODEL)
    batches = [source.example_inputs(GLOBAL_BATCH, generator=torch.Generator().manual_seed(1 + k))
               for k in range(WARMUP_STEPS + TIMED_STEPS)]
    results: dict[str, Any] = {}
    if phase == "memory":
        return_freed_memory_to_os()
    if phase == "memory" and world_cases:
        # one throwaway build + step of every program first: the process's one-time set-up
        # (lazy imports, gloo and mesh state, the collectives' and DTensor's first-use
        # state for this configuration's placements, allocator arenas) must not be charged
        # to whichever program happens to be measured first. Per configuration, not only
        # for the first one: a configuration's first program (autopar's) otherwise paid
        # for its collectives' and placements' first use and the template measured after
        # it did not.
        for case in world_cases:
            for kind in kinds(case):
                _run_one(case, kind, batches[:1], measure_memory=False)
    if phase == "timing":
        return _time_round_robin(rank, world_cases, searched_label, batches)
    for case in world_cases:  # alone: memory, first loss, forward calls (one steady-state step)
        results[case.label] = {}
        for kind in kinds(case):
            got = _run_one(case, kind, batches[:WARMUP_STEPS + 1], measure_memory=True)
            results[case.label][kind] = {"first_loss": got["first_loss"],
                                         "peak_rss_delta_bytes": got["peak_rss_delta_bytes"],
                                         "build_peak_rss_delta_bytes": got["build_peak_rss_delta_bytes"],
                                         "chunk_forwards": got["chunk_forwards_last_step"]}
    return results


# ---- diagnostic: autopar's pipeline schedule rebuilt every step ----------------------------

def _cached_pipeline_step(self: Any, local: tuple[Any, ...], num_mb: int) -> Any:
    """autopar.runtime.program.RankProgram._pipeline_step, but the schedule object is built once and
    reused, so torch.distributed.pipelining's per-schedule stage initialisation (p2p warm-up,
    forward/backward metadata inference) runs on the first step only, as in baselines/handtuned.py."""
    import torch

    if getattr(self, "_diag_schedule", None) is None or self._diag_num_mb != num_mb:
        stages = self._stages if self.config.schedule == "interleaved" else self._stages[0]
        self._diag_schedule = self.schedule(stages, n_microbatches=num_mb, loss_fn=self.rules.loss_fn)
        self._diag_num_mb = num_mb
    losses: list[Any] = []
    args = (local[0],) if self.has_first else ()
    self._diag_schedule.step(*args, target=local[1] if self.has_last else None, losses=losses)
    if self.has_last:
        return torch.stack([x.detach().float() for x in losses]).mean()
    return torch.zeros(())


def diagnose_worker(rank: int, case: Case) -> dict[str, Any]:
    """autopar as is vs with the schedule cached (patched in this process only), alternating."""
    import torch

    from autopar import runtime
    from autopar.models import resolve

    original = runtime.RankProgram._pipeline_step
    source = resolve(MODEL)
    batches = [source.example_inputs(GLOBAL_BATCH, generator=torch.Generator().manual_seed(1 + k))
               for k in range(WARMUP_STEPS + TIMED_STEPS // 2)]
    out: dict[str, Any] = {"as is": {"times": []}, "schedule cached": {"times": []}}
    for r in range(2):
        for variant in (("as is", "schedule cached") if r % 2 == 0 else ("schedule cached", "as is")):
            runtime.RankProgram._pipeline_step = original if variant == "as is" else _cached_pipeline_step
            got = _run_one(case, "autopar", batches, measure_memory=False)
            out[variant]["times"] += got["times"]
            out[variant]["first_loss"] = got["first_loss"]
            out[variant]["chunk_forwards"] = got["chunk_forwards_last_step"]
    runtime.RankProgram._pipeline_step = original
    return out


def diagnose(label: str) -> None:
    from autopar.runtime.launch import spawn

    case = next(c for c in cases(4) + cases(8) if c.label == label)
    if case.config.pp == 1:
        raise SystemExit(f"--diagnose-pp needs a pipelined configuration, {label!r} has pp 1")
    res = spawn(diagnose_worker, case.world, (case,), collective_timeout_s=180.0)[0]
    for variant, rec in res.items():
        print(f"{label}: autopar {variant}: median {statistics.median(rec['times']) * 1e3:.0f} ms/step over "
              f"{len(rec['times'])} steps {[round(t * 1e3) for t in rec['times']]}, first loss {rec['first_loss']:.5f}, "
              f"chunk forward calls on rank 0 in the last step: {rec['chunk_forwards']} "
              f"(microbatches: {case.config.num_microbatches(GLOBAL_BATCH)})")


# ---- in the parent ---------------------------------------------------------------------

def run_world(world: int, world_cases: list[Case], searched_label: str | None = None) -> dict[str, Any]:
    from autopar.runtime.launch import spawn

    # Memory and timing in separate process sets: the memory ranks make glibc return freed
    # tensors to the OS (return_freed_memory_to_os, in those ranks only) so VmHWM tracks
    # live tensors; timed that way, every allocation would be an mmap + page faults (steps
    # ~1.6x slower, more so for allocation-heavy programs).
    memory = spawn(measure_worker, world, (world_cases, None, "memory"), collective_timeout_s=180.0)
    per_rank = spawn(measure_worker, world, (world_cases, searched_label, "timing"), collective_timeout_s=180.0)
    for mem_rank, time_rank in zip(memory, per_rank):
        for case in world_cases:
            for kind, rec in mem_rank[case.label].items():
                time_rank[case.label][kind].update(rec)
    out: dict[str, Any] = {}
    if "__searched_vs_best__" in per_rank[0]:
        out["__searched_vs_best__"] = per_rank[0]["__searched_vs_best__"]
    for case in world_cases:
        rank0 = per_rank[0][case.label]
        out[case.label] = {}
        for kind, rec in rank0.items():
            mem = [r[case.label][kind]["peak_rss_delta_bytes"] for r in per_rank]
            build_mem = [r[case.label][kind]["build_peak_rss_delta_bytes"] for r in per_rank]
            out[case.label][kind] = {
                "step_time_s": statistics.median(rec["times"]),
                "step_times_s": rec["times"],
                "first_loss": rec["first_loss"],
                "peak_rss_delta_bytes": max(mem),
                "build_peak_rss_delta_bytes": max(build_mem),
                "chunk_forwards_last_step": rec.get("chunk_forwards"),
            }
    return out


def _profile(dtype: str = "float32") -> Any:
    from benchmarks.baselines import analytic
    from autopar.models import resolve
    from autopar.trace import trace_model

    graph = trace_model(resolve(MODEL), batch=1, dtype=dtype, layers_traced=2)
    return graph, analytic.profile_graph(graph)


def searched_plan(hardware: Any, world: int) -> tuple[Any, tuple[int, ...], Any]:
    """autopar's own plan for cpu:world with the calibrated profile: what `autopar search`
    returns (autopar.api.search_plans: one-stage plans priced by the intra-op ILP, pipelines
    by the inter-op DP over ILP stage costs, float32 on the cpu profile). It used the
    template search priced by the whole-model formula (`price_profile`), which ranks this
    machine's configurations worse (sweep_cpu.md: pooled Spearman 0.79-0.84 vs 0.93-0.95)
    and, with the re-measured profile, picked a ZeRO-1 pipeline 0.84x as fast as dp4."""
    from autopar.api import search_plans
    from autopar.cluster import Cluster

    result = search_plans(MODEL, Cluster.parse(f"cpu:{world}", hardware=hardware), global_batch=GLOBAL_BATCH)
    return result.plan.config, tuple(result.plan.stage_layers), result.plan


def _row_text(r: dict[str, Any]) -> str:
    def fmt(value: Any, spec: str, scale: float = 1.0) -> str:
        return "-" if value is None else format(value * scale, spec)

    return (f"{r['label']:<16}{r['world']:>3}{fmt(r['autopar_tokens_per_s'], ',.0f'):>15}"
            f"{fmt(r['hand_tokens_per_s'], ',.0f'):>12}{fmt(r['ratio'], '.3f'):>7}"
            f"{fmt(r['autopar_peak_rss_delta_bytes'], '.0f', 2**-20):>13}"
            f"{fmt(r['hand_peak_rss_delta_bytes'], '.0f', 2**-20):>10}"
            f"{fmt(r['autopar_first_loss'], '.5f'):>10}{fmt(r['hand_first_loss'], '.5f'):>10}"
            f"{fmt(r['predicted_step_time_s'], '.1f', 1e3):>9}{fmt(r['autopar_step_time_s'], '.1f', 1e3):>9}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile4", default=None, help="calibrated profile for 4 ranks (autopar calibrate --out)")
    parser.add_argument("--profile8", default=None, help="calibrated profile for 8 ranks")
    parser.add_argument("--no-world8", action="store_true", help="skip the 8-process configuration")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--md", default=None, help="also write a markdown table here")
    parser.add_argument("--only", default="", help="comma-separated configuration labels (e.g. 'tp2xpp2')")
    parser.add_argument("--diagnose-pp", default=None, metavar="LABEL",
                        help="only the diagnostic: autopar as is vs with its pipeline schedule built once")
    args = parser.parse_args(argv)
    if args.diagnose_pp:
        diagnose(args.diagnose_pp)
        return {}

    from autopar.cluster import HARDWARE, Cluster, load_hardware  # autopar before cost_model (import cycle)
    from autopar.explain import describe_config
    from benchmarks.baselines import analytic

    t0 = time.perf_counter()
    graph, profile = _profile()
    hw = {4: load_hardware(args.profile4) if args.profile4 else HARDWARE["cpu"],
          8: load_hardware(args.profile8) if args.profile8 else None}
    config, stage_layers, plan = searched_plan(hw[4], 4)
    print(f"model {MODEL}, global batch {GLOBAL_BATCH} x seq 64; profile cpu:4 "
          f"{'calibrated ' + args.profile4 if args.profile4 else 'built-in (uncalibrated)'}")
    print(f"autopar search (cpu:4): {describe_config(config, stage_layers, GLOBAL_BATCH)}, predicted "
          f"{plan.predicted.step_time_s * 1e3:.1f} ms/step")
    all_cases = cases(4, (config, stage_layers)) + ([] if args.no_world8 else cases(8))
    if args.only:
        all_cases = [c for c in all_cases if c.label in args.only.split(",")]
    searched_case = next((c for c in all_cases if c.hand is None), None)
    twin = next((c for c in all_cases if c.hand is not None and searched_case and same_program(c, searched_case)), None)
    if twin is not None:
        print(f"the searched plan is the {twin.label!r} configuration: its autopar run is reused")
    measured: dict[str, Any] = {}
    for world in (4, 8):
        world_cases = [c for c in all_cases if c.world == world and not (twin is not None and c is searched_case)]
        if not world_cases:
            continue
        t = time.perf_counter()
        searched_label = None
        if searched_case is not None and searched_case.world == world:
            searched_label = twin.label if twin is not None else searched_case.label
        measured.update(run_world(world, world_cases, searched_label))
        print(f"[world {world}: {len(world_cases)} configurations measured in {time.perf_counter() - t:.0f} s]")

    if twin is not None:
        measured[searched_case.label] = {"autopar": measured[twin.label]["autopar"]}
    tokens = GLOBAL_BATCH * 64
    rows = []
    for case in all_cases:
        m = measured[case.label]
        a = m["autopar"]
        h = m.get("hand")
        tpl = m.get("template")
        pred = None
        if hw[case.world] is not None:
            cluster = Cluster.parse(f"cpu:{case.world}", hardware=hw[case.world])
            pred = analytic.price_profile(profile, case.config, cluster, global_batch=GLOBAL_BATCH,
                                            stage_layers=case.stage_layers).step_time_s
        rows.append({
            "label": case.label, "world": case.world, "config": case.config.to_json(),
            "stage_layers": list(case.stage_layers) if case.stage_layers else None,
            "autopar_tokens_per_s": tokens / a["step_time_s"], "autopar_step_time_s": a["step_time_s"],
            "autopar_step_times_s": a["step_times_s"], "autopar_peak_rss_delta_bytes": a["peak_rss_delta_bytes"],
            "autopar_first_loss": a["first_loss"],
            "autopar_chunk_forwards_last_step": a["chunk_forwards_last_step"],
            "hand_chunk_forwards_last_step": h["chunk_forwards_last_step"] if h else None,
            "hand_tokens_per_s": tokens / h["step_time_s"] if h else None,
            "hand_step_time_s": h["step_time_s"] if h else None,
            "hand_step_times_s": h["step_times_s"] if h else None,
            "hand_peak_rss_delta_bytes": h["peak_rss_delta_bytes"] if h else None,
            "hand_first_loss": h["first_loss"] if h else None,
            "ratio": statistics.median(th / ta for th, ta in zip(h["step_times_s"], a["step_times_s"])) if h else None,
            "predicted_step_time_s": pred,
            "template_tokens_per_s": tokens / tpl["step_time_s"] if tpl else None,
            "template_step_times_s": tpl["step_times_s"] if tpl else None,
            "template_peak_rss_delta_bytes": tpl["peak_rss_delta_bytes"] if tpl else None,
            "autopar_build_peak_rss_delta_bytes": a["build_peak_rss_delta_bytes"],
            "template_build_peak_rss_delta_bytes": tpl["build_peak_rss_delta_bytes"] if tpl else None,
            "template_first_loss": tpl["first_loss"] if tpl else None,
            "template_ratio": statistics.median(th / tt for th, tt in zip(h["step_times_s"], tpl["step_times_s"]))
            if tpl and h else None,
        })

    print(f"\n{'config':<16}{'N':>3}{'autopar tok/s':>15}{'hand tok/s':>12}{'ratio':>7}"
          f"{'autopar MiB':>13}{'hand MiB':>10}{'loss A':>10}{'loss H':>10}{'pred ms':>9}{'meas ms':>9}")
    for r in rows:
        print(_row_text(r))
    ratios = [r["ratio"] for r in rows if r["ratio"]]
    hands4 = [r for r in rows if r["hand_tokens_per_s"] and r["world"] == 4]
    best_hand = max(hands4, key=lambda r: r["hand_tokens_per_s"]) if hands4 else None
    searched = next((r for r in rows if r["label"] == "autopar search"), None)
    # a searched plan identical to a measured configuration is one point, not two
    priced = [r for r in rows if r["predicted_step_time_s"] is not None
              and not (twin is not None and r["label"] == "autopar search")]
    rho = spearman([r["predicted_step_time_s"] for r in priced], [r["autopar_step_time_s"] for r in priced])
    priced4 = [r for r in priced if r["world"] == 4]
    rho4 = spearman([r["predicted_step_time_s"] for r in priced4], [r["autopar_step_time_s"] for r in priced4])
    ratios = ratios or [float("nan")]
    templated = [r for r in rows if r["template_ratio"] is not None]
    summary = [f"ratio autopar/hand-tuned (tokens/s): min {min(ratios):.3f}, median {statistics.median(ratios):.3f} "
               f"over {len(ratios)} configurations (median over {TIMED_STEPS} rounds of adjacent A/H steps after "
               f"{WARMUP_STEPS} warm-up rounds)"]
    for r in templated:
        summary.append(f"{r['label']}: per-op autopar / hand-tuned {r['ratio']:.3f}, template / hand-tuned "
                       f"{r['template_ratio']:.3f}; peak MiB/rank per-op {r['autopar_peak_rss_delta_bytes'] / 2**20:.0f} "
                       f"vs template {r['template_peak_rss_delta_bytes'] / 2**20:.0f} "
                       f"({r['autopar_peak_rss_delta_bytes'] / r['template_peak_rss_delta_bytes']:.2f}x; "
                       f"the build alone: {r['autopar_build_peak_rss_delta_bytes'] / 2**20:.0f} vs "
                       f"{r['template_build_peak_rss_delta_bytes'] / 2**20:.0f})")
    summary.append(f"autopar search (cpu:4, calibrated): {describe_config(config, stage_layers, GLOBAL_BATCH)}"
                   + (f", the same program as {twin.label!r}" if twin is not None else ""))
    if searched and best_hand:
        summary.append(f"autopar searched plan {searched['autopar_tokens_per_s']:,.0f} tokens/s vs best hand-tuned on "
                       f"4 processes ({best_hand['label']}) {best_hand['hand_tokens_per_s']:,.0f}: "
                       f"{searched['autopar_tokens_per_s'] / best_hand['hand_tokens_per_s']:.3f}x (ratio of medians)")
    vs_best = measured.get("__searched_vs_best__")
    if vs_best:
        round_ratio = statistics.median(h / x for h, x in zip(vs_best["hand"], vs_best["autopar"]))
        summary.append(f"autopar searched plan / fastest hand-tuned program ({vs_best['best']}), median over "
                       f"{len(vs_best['autopar'])} rounds of the per-round ratio: {round_ratio:.3f}")
    summary.append(f"Spearman(predicted, measured step time): {rho:.3f} over {len(priced)} configurations "
                   f"({rho4:.3f} over the {len(priced4)} on 4 processes)")
    print()
    print("\n".join(summary))
    print(f"[measure_cpu total {time.perf_counter() - t0:.0f} s]")
    out = {"model": MODEL, "global_batch": GLOBAL_BATCH, "seq": 64, "rows": rows, "spearman": rho,
           "searched_vs_best_hand_paired": vs_best,
           "spearman_world4": rho4, "warmup_steps": WARMUP_STEPS, "timed_steps": TIMED_STEPS,
           "searched_plan": plan.to_json(), "memory_kind": "peak RSS growth per rank (VmHWM - VmRSS before build)"}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, sort_keys=True))
    if args.md:
        write_markdown(out, Path(args.md), summary=summary)
    return out


def write_markdown(out: dict[str, Any], path: Path, *, summary: list[str]) -> None:
    lines = [
        "# autopar vs hand-tuned 3D parallelism, measured on this machine (CPU, gloo)",
        "",
        f"Generated by `.venv/bin/python benchmarks/measure_cpu.py` (via `benchmarks/run_all.py`). Model "
        f"`{out['model']}`, global batch {out['global_batch']} x seq {out['seq']}, AdamW, fp32. Every configuration "
        "runs autopar's compiled program and the torchtitan-style hand-tuned baseline (benchmarks/baselines/handtuned.py) "
        "on the same spawned ranks, same init and data (first-step losses must agree). Timing: all programs of "
        f"one world size built side by side, {out['warmup_steps']} warm-up rounds, then {out['timed_steps']} timed "
        "rounds of one step of every program (order reversed every other round; a configuration's A and H "
        "adjacent; barrier before and after each step); step time = median over rounds, autopar/hand = median "
        "of the per-round ratios t_H / t_A (adjacent steps share the machine's load). Memory (separate ranks, "
        "each program alone): peak resident-set growth per rank over build + "
        "steps (VmHWM reset via /proc/self/clear_refs), max over ranks. Predicted: `analytic.price` with the "
        "calibrated cpu profile (`autopar calibrate`). The machine has 2 cores shared with other users: "
        "figures are noisy (see the per-step times in measured_cpu.json).",
        "",
        "| config | procs | autopar tok/s | hand-tuned tok/s | autopar/hand | autopar MiB/rank | hand MiB/rank | "
        "loss A | loss H | predicted ms | measured ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        def f(v: Any, spec: str, scale: float = 1.0) -> str:
            return "-" if v is None else format(v * scale, spec)

        lines.append(
            f"| {r['label']} | {r['world']} | {f(r['autopar_tokens_per_s'], ',.0f')} | "
            f"{f(r['hand_tokens_per_s'], ',.0f')} | {f(r['ratio'], '.3f')} | "
            f"{f(r['autopar_peak_rss_delta_bytes'], '.0f', 2**-20)} | {f(r['hand_peak_rss_delta_bytes'], '.0f', 2**-20)} | "
            f"{f(r['autopar_first_loss'], '.5f')} | {f(r['hand_first_loss'], '.5f')} | "
            f"{f(r['predicted_step_time_s'], '.0f', 1e3)} | {f(r['autopar_step_time_s'], '.0f', 1e3)} |")
    templated = [r for r in out["rows"] if r.get("template_ratio") is not None]
    if templated:
        lines += ["", "Per-op program (what `autopar train`/`autopar.compile` run: the ILP's placements applied to "
                  "the traced step) vs the template program (the module-level rule-table program autopar ran "
                  "before, `benchmarks/baselines/template_program.py` build_module_program) vs hand-tuned, same rounds:", "",
                  "| config | per-op tok/s | template tok/s | hand-tuned tok/s | per-op/hand | template/hand | "
                  "per-op MiB/rank | template MiB/rank | loss per-op | loss template |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in templated:
            lines.append(
                f"| {r['label']} | {r['autopar_tokens_per_s']:,.0f} | {r['template_tokens_per_s']:,.0f} | "
                f"{r['hand_tokens_per_s']:,.0f} | {r['ratio']:.3f} | {r['template_ratio']:.3f} | "
                f"{r['autopar_peak_rss_delta_bytes'] / 2**20:.0f} | {r['template_peak_rss_delta_bytes'] / 2**20:.0f} | "
                f"{r['autopar_first_loss']:.5f} | {r['template_first_loss']:.5f} |")
    path.write_text("\n".join(lines + [""] + [f"- {line}" for line in summary]) + "\n")


if __name__ == "__main__":
    main()
