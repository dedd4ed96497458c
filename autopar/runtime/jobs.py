"""Training jobs on synthetic data, and the single-process reference they are checked against.

Where it sits: runtime, used by `autopar train` and the dist tests. A `TrainJob` is plain
data (picklable, sent to spawned ranks) that carries, per configuration, the per-op
placements its ranks build from (decided before they start: autopar/placing.py
`place_job`); `run_job(rank, job, build=...)` runs every config of the job in turn inside
one process group (ranks start once, several configs run; autopar.build.train_worker is
the spawn target, which passes the per-rank build), and
`reference_run(job)` trains the same model on one process with the same seed, data and
optimizer: the oracle of every numerics check.

Same init everywhere: the model is built under `torch.manual_seed(job.seed)` on every rank
and in the reference before any sharding. Same data: batch k is
`source.example_inputs(global_batch, generator=seed + 1 + k)` for presets and specs, and
the factory's example inputs (every step) for factories. Batch k depends on k alone, so
a run resumed from a checkpoint after step s (`resume`) sees exactly the batches s+1, ...
that an uninterrupted run would. Same random draws (`deterministic_random`, for checks):
dropout masks and other random ops are fixed fields (autopar/determinism.py), identical
on every rank and in the reference.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from autopar.batch import batch_size, call, map_tensors, rows as batch_rows
from autopar.precision import cast_parameters
from autopar.runtime import checkpoint
from autopar.config import ParallelConfig
from autopar.determinism import deterministic_random
from autopar.models import resolve
from autopar.plan import module_fingerprint
from autopar.plan import ProgramPlacements
from autopar.runtime.program import default_optimizer, gradient_for
from autopar.runtime.spmd import make_optimizer


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainJob:
    model: str
    """Preset, spec or factory path (resolved on each rank)."""
    configs: tuple[ParallelConfig, ...]
    steps: int = 3
    global_batch: int = 8
    """Rows per step of a preset or spec; a factory model (`module:function`) trains its own
    example batch every step, whatever this says (`build_model_and_batches`)."""
    lr: float = 1e-3
    seed: int = 0
    seq: int | None = None
    stage_layers: tuple[tuple[int, ...] | None, ...] = ()
    """Per config: the plan's layers per pipeline chunk, or None for an even split."""
    plans: tuple[str | None, ...] = ()
    """Per config: a saved plan's JSON text (its per-op placements run), or None: the
    configuration's placements are solved (before spawn, `placements`)."""
    placements: tuple[str, ...] = ()
    """Per config: the ProgramPlacements every rank builds from (autopar/plan.py, as JSON
    text), decided before the ranks start (autopar/placing.py `place_job`, from `plans` or
    solved for the configuration); ranks refuse a job without them."""
    return_parameters: bool = False
    """Return unsharded parameters (from the ranks with dp = tp = 0) for comparisons."""
    checkpoint_dir: str | None = None
    """Where `save_every` writes sharded checkpoints (autopar/runtime/checkpoint.py) and `resume` reads."""
    save_every: int = 0
    """Save after every K-th step (0: never)."""
    resume: bool = False
    """Continue from the newest complete checkpoint in `checkpoint_dir` (start fresh if none)."""
    live_steps: bool = False
    """Rank 0 prints each step's line as the step finishes (`autopar train` without --json)."""
    tokens_per_step: int = 0
    """What the live lines divide by the step time (autopar/commands/train.py)."""
    throughput_unit: str = "tokens/s"
    reference_losses: tuple[float, ...] = ()
    """The single-process reference's losses, shown beside the live lines (`--check`)."""
    reference_microbatches: int = 1
    """How many microbatches `reference_run` splits each batch into (gradients accumulated,
    the loss their mean): the plan's count where the model's forward updates buffers
    (BatchNorm's running statistics: once per forward; its batch statistics: over the rows
    of one forward), so the single process computes what the plan's microbatches compute."""
    deterministic_random: bool = False
    """Run every training step inside `autopar.determinism.deterministic_random` (here and in
    `reference_run`): random ops such as dropout draw the same fixed masks on every rank and
    in the reference, so `--check` can compare them (set when the traced step has random ops)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    config: ParallelConfig
    losses: tuple[float, ...]
    step_times_s: tuple[float, ...]
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    peak_rss_bytes: int
    parameters: dict[str, torch.Tensor] = field(default_factory=dict)
    first_step: int = 1
    """The global (1-based) step of `losses[0]`: > 1 when the run resumed from a checkpoint."""
    collectives: dict = field(default_factory=dict)
    """One-stage programs: the collectives per step the program runs, {(kind, axis): (calls, bytes)}."""
    priced: dict | None = None
    """... and those its plan (or the ILP for its configuration) priced, for price = run checks."""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    """Whole buffers after the run (with `return_parameters`, one-stage programs)."""
    memory_phases_bytes: dict[str, int] = field(default_factory=dict)
    """This rank's peak memory growth per phase of the run (`PeakMemory`, MEMORY_PHASES)."""
    compile_s: dict[str, float] = field(default_factory=dict)
    """{graph: seconds} Inductor spent compiling this rank's graphs (`--compile`)."""
    priced_state: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """This rank's (weights, gradients, optimizer state) bytes as priced
    (`priced_state_bytes`), beside what it measured (`parameter_bytes`, ...)."""


MEMORY_PHASES = ("build", "first_step", "later_steps")
"""The phases `train_worker` reports each rank's peak memory growth for
(RunResult.memory_phases_bytes)."""


class PeakMemory:
    """A rank's peak resident memory per phase of a run, as growth over its resident size
    when the run started (before the build): Linux's VmHWM, reset between phases through
    /proc/self/clear_refs (`echo 5`), so each phase's peak is its own. The build's peak
    holds the trace, the solve and the whole model before sharding; the first step's holds
    lazy initialisation (and Inductor's compile with `--compile`); the later steps' is the
    steady state a long run holds. Empty where /proc is not Linux's."""

    def __init__(self) -> None:
        self.start = self._kib("VmRSS")
        self.phases: dict[str, int] = {}
        self._reset()

    @staticmethod
    def _kib(field: str) -> int | None:
        try:
            found = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
        except OSError:
            return None
        return int(found.group(1)) if found else None

    @staticmethod
    def _reset() -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass

    def end(self, phase: str) -> None:
        """Record the peak since the last phase ended as `phase`'s, and start the next."""
        peak = self._kib("VmHWM")
        if peak is not None and self.start is not None:
            self.phases[phase] = max(0, peak - self.start) * 1024
        self._reset()


def step_epilogue(params: list[torch.nn.Parameter]) -> Any:
    """The end of every per-op program's step on its (DTensor) parameters, as a callable
    of the local gradient shards: each set as its parameter's `.grad`
    (autopar.runtime.program.gradient_for), the default optimizer (built as the programs
    build it: autopar.runtime.spmd.make_optimizer) stepped, the gradients cleared. What
    `autopar calibrate` times per parameter tensor (`optimizer_tensor_overhead_s`)."""
    opt = make_optimizer(default_optimizer(), params)

    def run(grads: list[torch.Tensor]) -> None:
        for p, g in zip(params, grads):
            p.grad = gradient_for(p, g)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def build_model_and_batches(job: TrainJob) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, ...]], Any]:
    source = resolve(job.model).with_overrides(seq=job.seq)
    torch.manual_seed(job.seed)
    if source.factory is not None:
        model, example = source.factory()
        batches = [tuple(example) for _ in range(job.steps)]
        return model, batches, source
    model = source.build()
    batches = [source.example_inputs(job.global_batch, generator=torch.Generator().manual_seed(job.seed + 1 + k))
               for k in range(job.steps)]
    return model, batches, source


def _step_context(job: TrainJob) -> contextlib.AbstractContextManager[Any]:
    return deterministic_random() if job.deterministic_random else contextlib.nullcontext()


def reference_run(job: TrainJob, precision: str = "") -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training: losses per step and the final state dict (tied weights
    appear under both names, as `state_dict()` gives them).

    Under the precision policy `precision` (autopar/precision.py; default: the job's first
    configuration's, else the cpu profile's, fp32): a mixed policy keeps the master weights
    (and AdamW's state) in the master dtype and computes each step on a copy of the model
    cast to the compute dtype (its parameters: `autopar.precision.cast_parameters`), its weights
    refreshed from the masters before every step, floating-point inputs cast (buffers live
    in the copy, in the dtype the model made them); the gradients are accumulated
    over the microbatches in the reduction dtype and cast to the master dtype for the
    optimizer. What the per-op program computes, in one process. The state dict holds the
    master weights and the copy's buffers."""
    model, batches, _ = build_model_and_batches(job)
    name = precision or (job.configs[0].precision if job.configs else "") or "fp32"
    policy = ParallelConfig(precision=name, reduce_dtype=job.configs[0].reduce_dtype if job.configs and not precision
                            else "").policy()
    m = job.reference_microbatches
    losses = []
    if policy.compute == policy.master == policy.reduce == "float32":
        opt = torch.optim.AdamW(model.parameters(), lr=job.lr)
        for batch in batches:
            size = batch_size(batch)
            rows = size // m
            total = 0.0
            with _step_context(job):
                for i in range(m):
                    micro = batch_rows(batch, i * rows, (i + 1) * rows, size) if m > 1 else batch
                    loss = call(model, micro)
                    (loss / m if m > 1 else loss).backward()
                    total += float(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total / m)
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}

    compute_dtype, reduce_dtype = getattr(torch, policy.compute), getattr(torch, policy.reduce)
    cast_parameters(model, policy.master)
    master, computed = model, model
    if policy.mixed:
        computed = copy.deepcopy(master)
        cast_parameters(computed, policy.compute)
    pairs = list(zip(master.parameters(), computed.parameters()))
    opt = torch.optim.AdamW(master.parameters(), lr=job.lr)
    for batch in batches:
        size = batch_size(batch)
        rows = size // m
        total = 0.0
        if policy.mixed:
            with torch.no_grad():
                for p, c in pairs:
                    c.copy_(p)
        sums: list[torch.Tensor | None] = [None] * len(pairs)
        with _step_context(job):
            for i in range(m):
                micro = batch_rows(batch, i * rows, (i + 1) * rows, size) if m > 1 else batch
                micro = map_tensors(lambda t: t.to(compute_dtype) if t.is_floating_point() else t, micro)
                loss = call(computed, micro)
                (loss / m if m > 1 else loss).backward()
                total += float(loss.detach())
                for k, (_, c) in enumerate(pairs):
                    if c.grad is not None:
                        g = c.grad.to(reduce_dtype)
                        sums[k] = g if sums[k] is None else sums[k] + g
                        c.grad = None
        for (p, _), g in zip(pairs, sums):
            p.grad = None if g is None else g.to(p.dtype)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / m)
    state = {k: v.detach().clone() for k, v in master.state_dict().items()}
    state.update((k, v.detach().clone()) for k, v in computed.named_buffers())
    return losses, state


def step_line(step: int, loss: float, reference: float | None, rate: float, unit: str) -> str:
    """One step's line, as `autopar train` prints it (live, from rank 0)."""
    ref = f"   reference {reference:.6f}" if reference is not None else ""
    return f"step {step}: loss {loss:.6f}{ref}   {rate:,.0f} {unit}"


def run_job(rank: int, job: TrainJob, *, build: Callable[..., Any]) -> list[RunResult]:
    """Run on every rank of an initialised process group; one RunResult per config.
    `build(model, placements, example_inputs=..., optimizer=...)` makes the rank's program
    (autopar/build `build_program`; autopar.build.train_worker is the spawn target that
    passes it): the runtime trains, checkpoints and measures what it is handed."""
    if len(job.placements) != len(job.configs):
        raise ValueError(f"the job has {len(job.configs)} configurations but placements for {len(job.placements)}; "
                         "decide them before spawning its ranks (autopar.placing.place_job(job))")
    results = []
    for i, config in enumerate(job.configs):
        memory = PeakMemory()
        model, batches, _ = build_model_and_batches(job)
        rows = batch_size(batches[0])  # what a step trains: a factory's example batch, whatever job.global_batch says
        fingerprint = module_fingerprint(model)
        placed = ProgramPlacements.loads(job.placements[i])
        if placed.config != config:
            raise ValueError(f"the job's placements {i} are for {placed.config}, not its configuration {config}; "
                             "decide them again (autopar.placing.place_job(job))")
        program = build(model, placed, optimizer=functools.partial(torch.optim.AdamW, lr=job.lr),
                        example_inputs=batches[0])
        done = 0
        if job.resume and job.checkpoint_dir and checkpoint.latest(job.checkpoint_dir) is not None:
            done = checkpoint.load(program, job.checkpoint_dir, model_fingerprint=fingerprint).step
        memory.end("build")
        losses, times = [], []
        for k in range(done, len(batches)):
            start = time.perf_counter()
            with _step_context(job):
                losses.append(program.step(batches[k]))
            times.append(time.perf_counter() - start)
            if k == done:
                memory.end("first_step")
            if job.live_steps and dist.get_rank() == 0:
                print(step_line(k + 1, losses[-1], job.reference_losses[k] if k < len(job.reference_losses) else None,
                                job.tokens_per_step / times[-1], job.throughput_unit), flush=True)
            if job.save_every and job.checkpoint_dir and (k + 1) % job.save_every == 0:
                checkpoint.save(program, job.checkpoint_dir, step=k + 1, samples_seen=(k + 1) * rows,
                                model=job.model, model_fingerprint=fingerprint)
        if len(losses) > 1:
            memory.end("later_steps")
        params = program.full_parameters() if job.return_parameters else {}
        buffers = program.full_buffers() if job.return_parameters and hasattr(program, "full_buffers") else {}
        keep = job.return_parameters and program.dp_rank == 0 and program.tp_rank == 0
        stats = program.last_stats
        results.append(RunResult(
            config=config, losses=tuple(losses), step_times_s=tuple(times),
            parameter_bytes=stats.parameter_bytes, gradient_bytes=stats.gradient_bytes,
            optimizer_state_bytes=stats.optimizer_state_bytes, peak_rss_bytes=stats.peak_rss_bytes,
            parameters=params if keep else {}, buffers=buffers if keep else {}, first_step=done + 1,
            collectives=program.collectives_per_step(rows // (config.dp * config.micro_batch))
            if hasattr(program, "collectives_per_step") else {},
            priced=getattr(program, "priced", None), priced_state=program.priced_state_bytes(),
            compile_s=program.compile_times(), memory_phases_bytes=dict(memory.phases),
        ))
        dist.barrier()
    return results
