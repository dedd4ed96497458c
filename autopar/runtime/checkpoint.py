"""Sharded, plan-independent, crash-safe checkpoints with torch.distributed.checkpoint (DCP).

Where it sits: runtime, beside autopar/runtime/program.py. `save(program, directory, step=...)`
runs on every rank of a job (collective) and writes one checkpoint; `load(program, path)`
fills a program built under *any* plan (other dp/tp/pp/ZeRO, other device count) from it;
`latest(directory)` finds the newest complete checkpoint without a process group.

Plan independence. Every tensor is stored under a key that names it in the unsplit
model, never a rank, stage or chunk:
  model/<fqn>              parameters (`layers.3.attn.qkv.weight`, ...)
  optim/<fqn>/<state>      optimizer state per parameter (AdamW: exp_avg, exp_avg_sq, step)
  buffer/<fqn>             buffers the forward updates (BatchNorm's running statistics), one-stage programs
  rng/rank<r>              torch's CPU RNG state of rank r (restored where the rank exists)
DCP records each tensor's global shape and every rank's shard offsets, and on load reads
the overlap of whatever shards the new layout asks for: that is the resharding (FSDP2's
dp shards, TP's DTensor shards and plain replicated tensors all mix). Tied weights (GPT/
Llama embedding = head) are stored once, under the embedding's name, wherever pipeline
stages keep their copies. The per-op programs keep every parameter in the model's own
layout (GPT's fused qkv rows included: the ILP shards the op, no row regrouping), so each
tensor is written shard by shard by the rank that holds it and one file serves any tp.
(The module-level template, benchmarks/baselines/template_program.py, regroups qkv rows for TP; it
is a baseline and is not checkpointed.)

Crash safety. A checkpoint is written to `step_000006.tmp/`; after every rank's DCP write
returned (DCP writes its `.metadata` last, on the coordinator), rank 0 writes
`autopar.json`, renames the directory to `step_000006/` and then replaces the `latest`
pointer (write + fsync + os.replace). A reader accepts only a directory with both
`.metadata` and `autopar.json` and never a `.tmp` one (the highest complete step wins), so
a run killed mid-save loses at most the steps since the last complete checkpoint. The directory must be visible to every
rank (one machine, or a shared file system).

Not stored: the optimizer's hyperparameters (lr, betas, ...), which come from the
optimizer factory of the resumed job, and the data itself: `autopar train` data is a
function of the step index, so `step` is the data position (`samples_seen` recorded).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 1
META_FILE = "autopar.json"
LATEST_FILE = "latest"
QKV_ORDER = "canonical"
"""Recorded in each checkpoint: parameters are stored in the unsplit model's row order."""
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


class RankProgram(Protocol):
    """What save/load read of a program (autopar/runtime/spmd.py SpmdProgram,
    autopar/runtime/pipe_spmd.py PipeSpmdProgram)."""

    config: Any
    optimizer: Any
    tied_fqns: tuple[str, ...]
    steps_done: int

    def named_parameters(self) -> Any: ...

    def gather_weights(self) -> None:
        """Refresh the weights computed in another placement than their update (collective)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, incomplete, another model or version."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointInfo:
    """A complete checkpoint on disk (read from its `autopar.json`)."""

    path: str
    step: int
    """Optimizer steps done when it was written; training resumes with step `step + 1`."""
    samples_seen: int
    world_size: int
    config: dict[str, Any]
    model: str
    model_fingerprint: str
    version: int


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


# ---- canonical (plan-independent) view of a program's state ---------------------------------

def _inner_optimizer(program: RankProgram) -> torch.optim.Optimizer:
    """The optimizer holding state: ZeroRedundancyOptimizer keeps its partition's in `.optim`."""
    return program.optimizer.optim if hasattr(program.optimizer, "consolidate_state_dict") else program.optimizer


def _canonical_name(program: RankProgram, fqn: str) -> str:
    if fqn in program.tied_fqns:  # the model really ties them (GPT; Llama only when asked)
        return program.tied_fqns[0]  # the embedding's name, whichever copy this is
    return fqn


def _entries(program: RankProgram) -> list[tuple[str, str, torch.nn.Parameter]]:
    """(canonical key, local name, parameter) for this rank's parameters."""
    out, seen = [], set()
    for fqn, p in program.named_parameters():
        key = _canonical_name(program, fqn)
        if key in seen:
            continue
        seen.add(key)
        out.append((key, fqn, p))
    return out


def _owned(program: RankProgram) -> set[int]:
    return {id(p) for group in _inner_optimizer(program).param_groups for p in group["params"]}


def _state_to_save(program: RankProgram) -> dict[str, torch.Tensor]:
    owned, opt = _owned(program), _inner_optimizer(program)
    state: dict[str, torch.Tensor] = {}
    for key, _, p in _entries(program):
        state[f"model/{key}"] = p.detach()
        if id(p) not in owned:
            continue  # ZeRO-1: another dp rank owns (and writes) this parameter's state
        for name, value in sorted(opt.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                state[f"optim/{key}/{name}"] = value.detach()
    for name, value in _buffers(program):
        state[f"buffer/{name}"] = value
    state[f"rng/rank{dist.get_rank()}"] = torch.get_rng_state()
    return state


def _buffers(program: RankProgram) -> list[tuple[str, torch.Tensor]]:
    """The buffers a program updates in training (BatchNorm's running statistics) as
    DTensors over its local shards (DCP writes and reads them in place); programs without
    `named_buffers` (pipelines: their chunks update none) have none to store."""
    named = getattr(program, "named_buffers", None)
    return list(named()) if named is not None else []


def full_state(program: RankProgram) -> dict[str, torch.Tensor]:
    """Unsharded canonical copies of everything `save` stores for this rank's stage (model/...,
    optim/...), for comparisons across plans. Collective over the stage's ranks; under ZeRO-1
    only this rank's optimizer partition appears."""
    out = {}
    for key, value in _state_to_save(program).items():
        if key.startswith("rng/"):
            continue
        full = value.full_tensor() if isinstance(value, DTensor) else value
        out[key] = full.detach().clone()
    return out


def _materialize_optimizer_state(program: RankProgram) -> None:
    """Create the optimizer state (AdamW's moments are lazy) so `load` can fill it in place:
    one step with zero gradients and lr 0, which leaves every parameter unchanged."""
    opt = _inner_optimizer(program)
    params = [p for group in opt.param_groups for p in group["params"]]
    if all(opt.state.get(p) for p in params):
        return
    lrs = [group["lr"] for group in opt.param_groups]
    for group in opt.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for group, lr in zip(opt.param_groups, lrs):
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)


# ---- save -------------------------------------------------------------------------------------

def save(program: RankProgram, directory: str | Path, *, step: int, samples_seen: int = 0, model: str = "",
         model_fingerprint: str = "") -> Path:
    """Write a checkpoint of `program` after `step` optimizer steps; collective (every rank).

    Returns the final directory `directory/step_<step>` (complete when this returns)."""
    import torch.distributed.checkpoint as dcp  # lazy: torch.distributed.checkpoint, only to save or load

    root = Path(directory)
    final = root / step_dir_name(step)
    tmp = root / (step_dir_name(step) + ".tmp")
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a run killed mid-save: never complete, safe to drop
            shutil.rmtree(tmp)
    dist.barrier()
    state = _state_to_save(program)
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()  # every rank's shards are on disk and DCP's .metadata is written
    if dist.get_rank() == 0:
        meta = {
            "version": CHECKPOINT_VERSION, "step": step, "samples_seen": samples_seen,
            "world_size": dist.get_world_size(), "config": program.config.to_json(), "model": model,
            "model_fingerprint": model_fingerprint, "qkv_order": QKV_ORDER,
        }
        _write_durably(tmp / META_FILE, json.dumps(meta, indent=2, sort_keys=True) + "\n")
        if final.exists():  # the same step saved again (a resumed run): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_durably(root / (LATEST_FILE + ".tmp"), final.name + "\n")
        os.replace(root / (LATEST_FILE + ".tmp"), root / LATEST_FILE)
        log.info("checkpoint step %d written to %s", step, final)
    dist.barrier()
    return final


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


# ---- find and load ----------------------------------------------------------------------------

def _complete(path: Path) -> bool:
    return (path.is_dir() and not path.name.endswith(".tmp") and (path / ".metadata").is_file()
            and (path / META_FILE).is_file())


def read_info(path: str | Path) -> CheckpointInfo:
    """The metadata of the complete checkpoint at `path` (a `step_<N>` directory)."""
    p = Path(path)
    if not _complete(p):
        raise CheckpointError(
            f"{p} is not a complete checkpoint (it needs .metadata and {META_FILE}; a '.tmp' directory is "
            "one whose save did not finish); pass a step_<N> directory or the checkpoint directory itself")
    try:
        meta = json.loads((p / META_FILE).read_text(encoding="ascii"))
        info = CheckpointInfo(path=str(p), step=int(meta["step"]), samples_seen=int(meta["samples_seen"]),
                              world_size=int(meta["world_size"]), config=dict(meta["config"]),
                              model=str(meta["model"]), model_fingerprint=str(meta["model_fingerprint"]),
                              version=int(meta["version"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{p / META_FILE} is malformed ({exc}); use an earlier step_<N> checkpoint") from None
    if info.version != CHECKPOINT_VERSION:
        raise CheckpointError(f"{p} has checkpoint version {info.version}; this autopar reads version "
                              f"{CHECKPOINT_VERSION}. Resume it with the autopar that wrote it")
    return info


def latest(directory: str | Path) -> CheckpointInfo | None:
    """The newest complete checkpoint under `directory` (or `directory` itself when it is one),
    or None when there is none. Reads files only: no process group.

    The highest complete `step_<N>` wins, not the `latest` pointer: a run killed between the
    rename and the pointer update has a complete newer checkpoint the pointer does not name
    yet (the pointer is for people and tools; `.tmp` directories are never complete)."""
    root = Path(directory)
    if _complete(root):
        return read_info(root)
    steps = sorted((int(m.group(1)), d) for d in root.glob("step_*") if (m := _STEP_DIR.match(d.name))
                   and _complete(d))
    return read_info(steps[-1][1]) if steps else None


def verify(info: CheckpointInfo) -> None:
    """Refuse a damaged checkpoint before anything reads its tensors (files only, no process
    group): DCP's `.metadata` must load, and every `.distcp` shard file it names must hold
    the bytes it indexes (each entry's offset + length). A truncated or missing file raises
    CheckpointError naming the file and the step, and the previous complete step to use."""
    from torch.distributed.checkpoint import FileSystemReader  # lazy: torch.distributed.checkpoint, only to save or load

    root = Path(info.path)

    def damaged(what: str) -> CheckpointError:
        parent = root.parent
        older = sorted(int(m.group(1)) for d in parent.glob("step_*")
                       if (m := _STEP_DIR.match(d.name)) and _complete(d) and int(m.group(1)) < info.step)
        fix = (f"the previous complete checkpoint is step {older[-1]}: move {root} aside (or delete it) and "
               "resume again" if older else "no earlier complete checkpoint exists here: train from step 1 "
               "(drop --resume) or use another --checkpoint-dir")
        return CheckpointError(f"checkpoint step {info.step} is damaged: {what}; {fix}")

    try:
        metadata = FileSystemReader(str(root)).read_metadata()
    except Exception as exc:  # a truncated pickle: EOFError, UnpicklingError, ...
        raise damaged(f"{root / '.metadata'} cannot be read ({type(exc).__name__}: {str(exc)[:200] or 'empty'}), "
                      "so the file is truncated or corrupt") from None
    need: dict[str, int] = {}
    for item in (getattr(metadata, "storage_data", None) or {}).values():
        path = getattr(item, "relative_path", None)
        if path is not None:
            need[path] = max(need.get(path, 0), int(item.offset) + int(item.length))
    for name, size in sorted(need.items()):
        f = root / name
        have = f.stat().st_size if f.is_file() else None
        if have is None:
            raise damaged(f"shard file {f} is missing")
        if have < size:
            raise damaged(f"shard file {f} is truncated ({have} bytes; its index needs {size})")


def load(program: RankProgram, path: str | Path, *, model_fingerprint: str = "") -> CheckpointInfo:
    """Fill `program` (built under any plan) from a checkpoint; collective (every rank).

    `path` is a checkpoint directory (the newest complete checkpoint is taken) or one
    `step_<N>` directory. Sets `program.steps_done`; returns the checkpoint's metadata."""
    import torch.distributed.checkpoint as dcp  # lazy: torch.distributed.checkpoint, only to save or load

    info = latest(path)
    if info is None:
        raise CheckpointError(f"no complete checkpoint under {path}; train with --checkpoint-dir {path} "
                              "--save-every K first, or drop --resume")
    if model_fingerprint and info.model_fingerprint and model_fingerprint != info.model_fingerprint:
        raise CheckpointError(
            f"checkpoint {info.path} was written for another model ({info.model!r}, fingerprint "
            f"{info.model_fingerprint[:12]}; this model {model_fingerprint[:12]}): parameter names or shapes "
            "differ. Resume with the same model, or use another --checkpoint-dir")
    verify(info)
    _materialize_optimizer_state(program)
    owned, opt = _owned(program), _inner_optimizer(program)
    targets: dict[str, torch.Tensor] = {}  # DCP copies its shard(s) into each in place
    for key, _, p in _entries(program):
        targets[f"model/{key}"] = p.detach()
        if id(p) in owned:
            for name, value in sorted(opt.state[p].items()):
                if isinstance(value, torch.Tensor):
                    targets[f"optim/{key}/{name}"] = value.detach()
    from torch.distributed.checkpoint import FileSystemReader  # lazy: torch.distributed.checkpoint, only to save or load

    stored = FileSystemReader(info.path).read_metadata().state_dict_metadata
    for name, value in _buffers(program):
        if f"buffer/{name}" in stored:  # (a checkpoint of a program that updates no buffer has none)
            targets[f"buffer/{name}"] = value
    rng_key = f"rng/rank{dist.get_rank()}"
    if dist.get_rank() < info.world_size:
        targets[rng_key] = torch.get_rng_state()
    try:
        dcp.load(targets, checkpoint_id=info.path)
    except Exception as exc:  # DCP reports missing keys / shape clashes as CheckpointException
        raise CheckpointError(
            f"checkpoint {info.path} does not fit this model: {str(exc).strip().splitlines()[-1][:400]}. "
            "Resume with the model it was written for (its autopar.json names it)") from None
    if rng_key in targets:
        torch.set_rng_state(targets[rng_key])
    program.gather_weights()  # the parameters hold the update shards: their compute copies follow them
    program.steps_done = info.step
    dist.barrier()
    log.info("resumed from %s (step %d)", info.path, info.step)
    return info


__all__ = ["CHECKPOINT_VERSION", "CheckpointError", "CheckpointInfo", "full_state", "latest", "load", "verify",
           "read_info", "save", "step_dir_name"]
