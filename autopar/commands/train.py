"""`autopar train MODEL --devices N`: run a configuration (or a saved plan) on real ranks.

Spawns N local gloo processes (autopar/runtime/launch.py) unless started by torchrun,
trains `--steps` AdamW steps on synthetic data (autopar/runtime/jobs.py) and prints the
loss per step and its throughput (tokens/s for token-id inputs, else samples/s: the
definition `autopar search` predicts with, autopar/batch.py seq_len). Every check that needs no process group (config vs model,
plan vs model, devices; autopar/preflight.py) runs once here, before any rank starts.

`--check` also trains the single-process reference (same init, data and optimizer) and
compares the loss curves (rtol 1e-4). Random ops (dropout, ...) would make the two runs
draw different masks, so the launcher traces the step and, when the traced graph has
random ops, both runs draw them from the same fixed field instead
(autopar/determinism.py); the output names the ops found and says so. `--json` prints
`losses`, `reference_losses`, `match`, `random_ops` and `deterministic_random` (with
--check), `config`, `tokens_per_s` (in `throughput_unit`), `peak_memory_bytes` and per-rank state bytes.

Exit codes: 0 trained (with --check: every step matched the reference); 1 a rank
crashed, was killed or hung (named in the message); 2 bad input, refused before any rank
started (or a rank raised a user error, such as a NaN loss); 3 `--check` found a
MISMATCH between the parallel run and the reference. Under torchrun these are rank 0's
exit codes (the other ranks exit 0 after training); torchrun itself exits 1 when any
rank exits non-zero.

Checkpoints: `--checkpoint-dir D --save-every K` writes a sharded checkpoint after every
K-th step (autopar/runtime/checkpoint.py: plan-independent, atomic); `--resume` continues from the
newest complete one in D, under this run's plan and device count (resharded on load),
up to `--steps` in total; `losses` then start at step `first_step`. `--resume` with no
complete checkpoint in D, or with a damaged one (a truncated `.metadata` or `.distcp`
shard: checkpoint.verify), exits 2 before any rank starts; `--resume-if-exists` starts
from step 1 when D holds none (a job that may be restarted). A rank that fails,
crashes or hangs stops the job with exit 1 (exit 2 when a rank raised a user error, such
as a NaN loss), naming the rank.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopar.batch import batch_size, seq_len, throughput_unit
from autopar.build.chunks import check_stage_placements
from autopar.build.one_stage import check_plan_placements
from autopar.config import ParallelConfig
from autopar.determinism import UnsupportedRandomOpError, random_ops, unsupported
from autopar.models import resolve
from autopar.placing import program_placements
from autopar.plan import Plan, ProgramPlacements, module_fingerprint
from autopar.preflight import check_job
from autopar.build import train_worker
from autopar.runtime import checkpoint
from autopar.runtime.jobs import MEMORY_PHASES, RunResult, TrainJob, reference_run, step_line
from autopar.runtime.launch import RankFailure, gather_build_results, init_from_env, launched_by_torchrun, spawn
from autopar.sharding import InfeasiblePlanError
from autopar.trace import TraceError, trace, updated_buffers

LOSS_RTOL = 1e-4
"""`--check`'s tolerance where the step computes in float32 (reduction order differs)."""
LOSS_RTOL_BF16 = 2e-3
"""... and where it computes in bfloat16 (8 mantissa bits: the same sums in another order
differ by more)."""


def loss_rtol(config: ParallelConfig) -> float:
    """The `--check` tolerance of a run of `config` on this machine's CPU ranks."""
    return LOSS_RTOL_BF16 if config.policy().compute == "bfloat16" else LOSS_RTOL
EXIT_CRASH = 1
"""A rank crashed, was killed or hung."""
EXIT_BAD_INPUT = 2
"""Bad input (also what cli.main returns for a ValueError) or a rank's user error."""
EXIT_CHECK_MISMATCH = 3
"""`--check`: the parallel losses differ from the single-process reference beyond LOSS_RTOL."""
_CONFIG_FLAGS = ("tp", "pp", "dp", "zero", "micro_batch", "schedule", "interleave", "recompute", "attention",
                 "precision", "reduce_dtype")


def config_from_flags(args: argparse.Namespace, devices: int) -> ParallelConfig:
    """DESIGN defaults: tp = pp = 1, dp = devices / (tp * pp), zero 0, micro-batch 1, 1f1b."""
    tp, pp = args.tp or 1, args.pp or 1
    if args.dp is None and devices % (tp * pp):
        raise ValueError(f"--devices {devices} is not divisible by tp * pp = {tp * pp}; pick degrees that divide it")
    dp = args.dp or devices // (tp * pp)
    if args.attention not in (None, "flash"):
        raise ValueError(f"--attention {args.attention}: autopar traces and runs the model's fused attention "
                         "(scaled_dot_product_attention); drop --attention")
    return ParallelConfig(
        tp=tp, pp=pp, dp=dp, zero=args.zero or 0, ep=args.ep or 1, micro_batch=args.micro_batch or 1,
        schedule=args.schedule or "1f1b", interleave=args.interleave or 1,
        recompute=args.recompute or "none", attention=args.attention or "flash",
        precision=args.precision or "", reduce_dtype=args.reduce_dtype or "", compiled=args.compile,
    ).resolved("cuda" if torch.cuda.is_available() else "cpu")  # the ranks' hardware default, said in the header


def _plan_config(args: argparse.Namespace) -> tuple[ParallelConfig, tuple[int, ...], Plan]:
    given = [f"--{f.replace('_', '-')}" for f in _CONFIG_FLAGS if getattr(args, f, None) is not None]
    if given:
        raise ValueError(f"--plan replays a saved plan; drop the configuration flags {', '.join(given)}")
    plan = Plan.load(args.plan)
    if args.compile and not plan.config.compiled:
        raise ValueError(f"--compile with --plan {args.plan}: the plan was searched and priced for the eager program "
                         "(its config has compiled false); search it with --compile, or drop --compile")
    return plan.config, tuple(plan.stage_layers), plan


def _check_plan_fingerprint(plan: Plan, model_name: str, seq: int | None) -> None:
    """The plan's own check (`Plan.check_model`) against the model built on the meta device."""
    source = resolve(model_name).with_overrides(seq=seq)
    with torch.device("meta"):
        model = source.build() if source.factory is None else source.factory()[0]
    plan.check_model(module_fingerprint(model))


def _check_resume(args: argparse.Namespace, model: Any) -> None:
    """Refuse a resume that cannot work before any rank starts (files only, no process group)."""
    info = checkpoint.latest(args.checkpoint_dir)
    if info is None:
        if not args.resume:  # --resume-if-exists
            print(f"autopar train: no complete checkpoint in {args.checkpoint_dir}; starting from step 1",
                  file=sys.stderr)
            return
        where = Path(args.checkpoint_dir)
        state = ("does not exist" if not where.exists() else "is not a directory" if not where.is_dir()
                 else "holds no complete checkpoint (step_<N> with .metadata and autopar.json)")
        raise ValueError(f"--resume: {args.checkpoint_dir} {state}, so there is nothing to resume from; check the "
                         "path, or pass --resume-if-exists to start from step 1 when no checkpoint exists yet")
    if info.step >= args.steps:
        raise ValueError(f"the checkpoint in {args.checkpoint_dir} is at step {info.step}, so --steps {args.steps} "
                         f"leaves nothing to train; pass --steps greater than {info.step} (--steps counts all steps, "
                         "including those before the checkpoint)")
    actual = module_fingerprint(model)
    if info.model_fingerprint and info.model_fingerprint != actual:
        raise ValueError(f"the checkpoint in {info.path} was written for model {info.model!r}, not {args.model!r} "
                         "(parameter names or shapes differ); resume with that model or use another --checkpoint-dir")
    checkpoint.verify(info)


def _tokens_per_step(job: TrainJob) -> tuple[int, str]:
    """(what one step processes, its rate's unit): tokens for token-id inputs (a zoo model,
    or a factory whose first integer input is batch x sequence), else samples
    (autopar/batch.py seq_len): the definition `autopar search` predicts with."""
    source = resolve(job.model).with_overrides(seq=job.seq)
    if source.config is not None:
        return job.global_batch * source.config.seq, "tokens/s"
    example = source.factory()[1]
    seq = seq_len(example)
    return batch_size(example) * seq, throughput_unit(seq)


def _resume_requested(args: argparse.Namespace) -> bool:
    """Whether this run resumes from a checkpoint; the checkpoint flags checked together."""
    resume = args.resume or args.resume_if_exists
    if (args.save_every or resume) and not args.checkpoint_dir:
        flag = "--save-every" if args.save_every else "--resume" if args.resume else "--resume-if-exists"
        raise ValueError(f"{flag} needs --checkpoint-dir D (where checkpoints are written and read); add it")
    if args.checkpoint_dir and not (args.save_every or resume):
        raise ValueError(f"--checkpoint-dir {args.checkpoint_dir} given without --save-every K or --resume; add "
                         "--save-every K to write checkpoints, --resume to continue from one")
    return resume


def _num_devices(args: argparse.Namespace, torchrun: bool) -> int:
    """The job's ranks: torchrun's world (joined here, and checked against --devices), else --devices."""
    if not torchrun:
        return args.devices

    init_from_env()
    devices = dist.get_world_size()
    if args.devices != devices:
        raise ValueError(f"--devices {args.devices} but torchrun started {devices} ranks; make them equal")
    return devices


def _model_and_batch(args: argparse.Namespace, source: Any, config: ParallelConfig, plan: Plan | None) -> tuple[Any, Any, int]:
    """(model, a factory's example inputs or None, global batch): a factory's inputs fix the
    batch, which must agree with --global-batch and the plan; a preset's is the flag's, else
    one sequence per data-parallel rank and pipeline stage per micro-batch."""
    if source.factory is None:
        return source.build(), None, args.global_batch or config.dp * config.micro_batch * config.pp
    model, example = source.factory()
    global_batch = batch_size(example)
    if args.global_batch not in (None, global_batch):
        raise ValueError(f"--global-batch {args.global_batch} but factory {args.model!r} gives batches of "
                         f"{global_batch}; drop --global-batch")
    if plan is not None and plan.global_batch != global_batch:
        raise ValueError(f"plan {args.plan} was searched for a global batch of {plan.global_batch} but factory "
                         f"{args.model!r} gives batches of {global_batch}; search again with --global-batch "
                         f"{global_batch}")
    return model, example, global_batch


def run(args: argparse.Namespace) -> int:
    resume = _resume_requested(args)
    torchrun = launched_by_torchrun()
    devices = _num_devices(args, torchrun)
    plan = None
    if args.plan:
        config, stage_layers, plan = _plan_config(args)
        if config.num_devices != devices:
            raise ValueError(
                f"plan {args.plan} was searched for {config.num_devices} devices ({plan.cluster}, "
                f"mesh (pp, dp, tp) = ({config.pp}, {config.dp}, {config.tp})) but this run has {devices}; run "
                f"with --devices {config.num_devices}, or search a plan for these devices (--cluster cpu:{devices})")
        if resolve(args.model).factory is None:  # a factory's inputs fix its own batch and sequence
            args.seq = args.seq or plan.seq
            args.global_batch = args.global_batch or plan.global_batch
        _check_plan_fingerprint(plan, args.model, args.seq)
    else:
        config, stage_layers = config_from_flags(args, devices), None
    source = resolve(args.model).with_overrides(seq=args.seq)
    model, example, global_batch = _model_and_batch(args, source, config, plan)
    num_microbatches = check_job(model, config, num_devices=devices, global_batch=global_batch,
                                 stage_layers=stage_layers)
    if resume:
        _check_resume(args, model)
    example_inputs = example if source.factory is not None else source.example_inputs(global_batch)
    placed = _placements(args, model, config, example_inputs, plan, stage_layers, devices, global_batch, torchrun)
    found, updates = _random_ops(model, example_inputs) if args.check else ({}, ())
    job = TrainJob(model=args.model, configs=(config,), steps=args.steps, global_batch=global_batch, lr=args.lr,
                   seq=args.seq, stage_layers=(stage_layers,),
                   plans=(plan.dumps() if plan is not None else None,), placements=(placed.dumps(),),
                   checkpoint_dir=args.checkpoint_dir, save_every=args.save_every or 0, resume=resume,
                   deterministic_random=bool(found),
                   # buffers updated per forward: the reference runs the plan's microbatches
                   reference_microbatches=num_microbatches if updates else 1)
    ref_losses = None
    lead = not torchrun or _torchrun_rank() == 0
    if not args.json:
        # step lines as the steps finish (rank 0), the reference beside them: run it first
        ref_losses = reference_run(job)[0] if args.check and lead else None
        per_step, unit = _tokens_per_step(job)
        job = replace(job, live_steps=True, tokens_per_step=per_step, throughput_unit=unit,
                      reference_losses=tuple(ref_losses or ()))
        if lead:
            _print_header(job, config, num_microbatches)
    if torchrun:
        results = [train_worker(dist.get_rank(), job)]  # the placements were decided above, by rank 0
        rank = dist.get_rank()
        dist.destroy_process_group()  # as spawned ranks do: no live group left for interpreter exit
        if rank != 0:
            return 0
    else:
        try:
            results = spawn(train_worker, devices, (job,))
        except RankFailure as exc:
            print(f"autopar train: error: {exc} (all ranks stopped)", file=sys.stderr)
            return EXIT_BAD_INPUT if exc.user_error else EXIT_CRASH
    per_rank: list[RunResult] = [r[0] for r in results]
    if args.check and ref_losses is None:
        ref_losses = reference_run(job)[0]
    return _report(args, job, config, num_microbatches, per_rank, ref_losses, found)


def _placements(args: argparse.Namespace, model: Any, config: ParallelConfig, example: Any, plan: Plan | None,
                stage_layers: tuple[int, ...] | None, devices: int, global_batch: int, torchrun: bool) -> Any:
    """The per-op placements every rank builds from, decided here, once, before any rank
    builds (autopar/placing.py): a plan's own, checked against the model's trace (node keys
    and ops, every pipeline chunk), else solved for the configuration (flags, or a plan that
    records none) on the model traced as the ranks trace it. Under torchrun every rank runs
    this command: rank 0 decides and sends the placements (or its error) to the others."""
    def decide() -> ProgramPlacements:
        device_type = "cuda" if torchrun and torch.cuda.is_available() else "cpu"  # the ranks' mesh device
        try:
            # under torchrun rank 0 traces and solves in a forked child, so it builds and
            # trains without the trace's and the solver's allocations, as the other ranks do
            placed = program_placements(model, config, example, model_name=args.model, plan=plan,
                                        stage_layers=stage_layers, device_type=device_type,
                                        in_child=torchrun)
        except InfeasiblePlanError as exc:
            given = [f"--{f.replace('_', '-')}" for f in _CONFIG_FLAGS if getattr(args, f, None) is not None]
            origin = (f"plan {args.plan}" if plan is not None else f"given by {' '.join(given)}" if given
                      else f"the default for --devices {devices}: data parallel over every device")
            reason = str(exc).split(". Drop the configuration flags")[0]
            raise ValueError(
                f"the configuration dp={config.dp} tp={config.tp}{f' pp={config.pp}' if config.pp > 1 else ''} "
                f"({origin}) cannot run {args.model}: "
                f"{reason}. Let the search place it: autopar search {args.model} --cluster cpu:{devices} "
                f"--global-batch {global_batch} --out plan.json, then autopar train {args.model} --devices {devices} "
                "--plan plan.json") from None
        if placed.origin == "plan":  # what every rank would find when it builds, found once here
            if config.pp == 1:
                check_plan_placements(model, placed, example)
            else:
                check_stage_placements(model, placed, example)
        return placed

    if not torchrun:
        return decide()

    mine: Any = None
    if dist.get_rank() == 0:
        try:
            mine = decide().dumps()
        except ValueError as exc:
            mine = exc
    got = gather_build_results(mine)[0]  # the other ranks wait out the solve, however long
    if isinstance(got, Exception):
        raise got
    return ProgramPlacements.loads(got)


def _random_ops(model: Any, example_inputs: Any) -> tuple[dict[str, int], tuple[str, ...]]:
    """Random ops of the traced training step, for --check, and the buffers its forward
    updates; refuses ops the check cannot make deterministic. A model that cannot be
    traced is checked with the mode on anyway (it replaces whatever random ops run; none
    is harmless)."""
    try:
        gm = trace(copy.deepcopy(model), tuple(example_inputs)).gm
        found, updates = random_ops(gm), updated_buffers(gm)
    except TraceError as exc:
        print(f"autopar train: --check could not trace the step to look for random ops ({exc}); "
              "random ops that run are made deterministic anyway", file=sys.stderr)
        return {"unknown (not traced)": 0}, ()
    bad = unsupported(found)
    if bad:
        raise UnsupportedRandomOpError(
            f"--check compares the parallel run with a single-process reference, and the model draws random "
            f"numbers with {', '.join(bad)}, which the check cannot make deterministic (it can: dropout, bernoulli, "
            "rand, randn, uniform, normal_); run without --check, or check a variant of the model without these ops")
    return found, updates


def _torchrun_rank() -> int:
    return dist.get_rank()


def _phase_peaks(per_rank: list[RunResult]) -> dict[str, int]:
    """Each phase's peak memory growth, max over ranks (RunResult.memory_phases_bytes)."""
    return {phase: max(r.memory_phases_bytes[phase] for r in per_rank) for phase in MEMORY_PHASES
            if all(phase in r.memory_phases_bytes for r in per_rank)}


def _print_header(job: TrainJob, config: ParallelConfig, num_microbatches: int) -> None:
    c = config
    print(f"{job.model}: dp {c.dp} x tp {c.tp} x pp {c.pp}, zero {c.zero}, micro-batch {c.micro_batch} "
          f"({num_microbatches} microbatches), schedule {c.schedule}, recompute {c.recompute}, precision "
          f"{c.policy().name}{', compiled by Inductor' if c.compiled else ''}", flush=True)


def _report(args: argparse.Namespace, job: TrainJob, config: ParallelConfig, num_microbatches: int,
            per_rank: list[RunResult], ref_losses: list[float] | None, found: dict[str, int]) -> int:
    first = per_rank[0]
    tokens, unit = _tokens_per_step(job)
    timed = first.step_times_s[1:] or first.step_times_s  # the first step pays lazy init
    tokens_per_s = tokens * len(timed) / sum(timed)
    if ref_losses is not None:  # a resumed run reports (and is checked on) its own steps only
        ref_losses = ref_losses[first.first_step - 1:]
    rtol = loss_rtol(config)
    ok = ref_losses is None or all(math.isclose(a, b, rel_tol=rtol) for a, b in zip(first.losses, ref_losses))
    out = {
        "losses": list(first.losses),
        "first_step": first.first_step,
        "config": {**config.to_json(), "num_microbatches": num_microbatches},
        "tokens_per_s": tokens_per_s,
        "throughput_unit": unit,
        "step_times_s": list(first.step_times_s),
        "peak_memory_bytes": max(r.peak_rss_bytes for r in per_rank),
        "peak_memory_kind": "max resident set size over ranks (CPU)",
        "state_bytes_per_rank": [
            {"parameters": r.parameter_bytes, "gradients": r.gradient_bytes, "optimizer": r.optimizer_state_bytes}
            for r in per_rank
        ],
        "devices": len(per_rank),
        "memory_phases_bytes": _phase_peaks(per_rank),
        "memory_phases_kind": "peak resident-set growth per rank over its size before the build, per phase "
                              "(build; first step; later steps), max over ranks (CPU)",
        "compile_s": first.compile_s,
        "global_batch": job.global_batch,
    }
    ran, priced = getattr(first, "collectives", None), getattr(first, "priced", None)
    if priced is not None:
        # one-stage (per-op) programs: the collectives of one step, counted in the per-rank
        # graphs, and those the plan priced: {kind, mesh axis, calls, bytes}
        def rows(c: Any) -> list[list[Any]]:
            return [[kind, axis, calls, nbytes] for (kind, axis), (calls, nbytes) in sorted(c.items())]

        out["collectives_per_step"] = rows(ran)
        out["priced_collectives_per_step"] = rows(priced)
        out["price_equals_run"] = ran == priced
    if ref_losses is not None:
        out["reference_losses"] = ref_losses
        out["max_rel_loss_diff"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(first.losses, ref_losses))
        out["match"] = ok
        out["random_ops"] = found
        out["deterministic_random"] = job.deterministic_random
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        if first.first_step > 1:
            print(f"resumed from the checkpoint after step {first.first_step - 1} in {job.checkpoint_dir}")
        if not job.live_steps:
            for k, loss in enumerate(first.losses):
                print(step_line(first.first_step + k, loss, ref_losses[k] if ref_losses is not None else None,
                                tokens / first.step_times_s[k], unit))
        print(f"throughput {tokens_per_s:,.0f} {unit} (steps after the first), peak RSS "
              f"{out['peak_memory_bytes'] / 2**20:.0f} MiB/rank")
        phases = out["memory_phases_bytes"]
        if phases:
            print("memory per rank, peak growth by phase: " + ", ".join(
                f"{name.replace('_', ' ')} {value / 2**20:.0f} MiB" for name, value in phases.items()))
        if first.compile_s:
            print(f"compile: {sum(first.compile_s.values()):.1f} s in Inductor on rank 0 (at each graph's first call), "
                  + ", ".join(f"{label} {sec:.1f} s" for label, sec in first.compile_s.items()))
        if ref_losses is not None:
            if job.deterministic_random:
                ops = ", ".join(f"{name} x{count}" if count else name for name, count in found.items())
                print(f"check: random ops in the traced step: {ops}; both runs drew them deterministically (the same "
                      "fixed masks on every rank and in the reference, autopar/determinism.py), so the losses are "
                      "those of that deterministic variant")
            verdict = "match" if ok else "MISMATCH"
            print(f"check: {verdict} (max relative loss difference {out['max_rel_loss_diff']:.2e}, rtol {rtol})")
    return 0 if ok else EXIT_CHECK_MISMATCH
