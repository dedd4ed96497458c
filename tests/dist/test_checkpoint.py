"""Sharded checkpoints: resume equals an uninterrupted run, resharding across plans, crash safety.

Two spawned jobs of 4 gloo ranks:
- run A (DP4, ZeRO-1: weights whole, their update sharded): trains 6 steps uninterrupted, saving at step 3; its losses and
  gathered state at step 3 are the oracle. At step 6 rank 1 is killed inside DCP's write,
  so `step_000006.tmp/` is left half written.
- run B: resumes from the directory under the same plan (steps 4-6 must equal run A's,
  rtol 1e-5), and under TP2 x DP2 x ZeRO-3 and PP2 x DP2 x ZeRO-1: the gathered model and optimizer
  state after loading must equal run A's step-3 state exactly (resharding is data movement)
  and steps 4-6 must match run A within the usual cross-plan tolerance.
- A Llama (untied head, GQA) is saved in run A under interleaved PP2 x DP2 x ZeRO-3 and
  loaded in run B under TP2 x DP2 x ZeRO-2: same tensors, same next loss.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

import autopar
from autopar.runtime import checkpoint
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.build import build_program
from autopar.plan import ProgramPlacements
from autopar.placing import program_placements
from autopar.runtime.launch import RankFailure, spawn
from tests.parallel import pmap

pytestmark = pytest.mark.dist

MODEL = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16"  # tied embedding, qkv permuted under TP
GLOBAL_BATCH = 8
STEPS = 6
SAVE_AT = 3
SAVED = ParallelConfig(dp=4, zero=1)
OTHER_PLANS = (ParallelConfig(tp=2, dp=2, zero=3), ParallelConfig(pp=2, dp=2, zero=1, schedule="gpipe"))


def _batches() -> list[tuple[torch.Tensor, ...]]:
    source = resolve(MODEL)
    return [source.example_inputs(GLOBAL_BATCH, generator=torch.Generator().manual_seed(1 + k))
            for k in range(STEPS)]


def _place(task: tuple[str, tuple[torch.Tensor, ...], ParallelConfig]) -> str:
    model, batch, config = task
    return program_placements(resolve(model).build(), config, batch).dumps()


def _placed(*tasks: tuple[str, tuple[torch.Tensor, ...], ParallelConfig]) -> dict[ParallelConfig, str]:
    """Each (model, batch, configuration)'s placements, solved before the ranks start (as
    `autopar train` does; on both cores, tests/parallel.py), as the JSON text the ranks
    build from."""
    return {config: text for (_, _, config), text in zip(tasks, pmap(_place, tasks))}


def _program(config: ParallelConfig, placed: dict, seed: int = 0):
    torch.manual_seed(seed)
    return build_program(resolve(MODEL).build(), ProgramPlacements.loads(placed[config]),
                         example_inputs=_batches()[0],
                         optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))


LLAMA = "llama:layers=4,hidden=32,heads=4,kv_heads=2,ffn=64,vocab=64,seq=16"  # untied, GQA
LLAMA_SAVED = ParallelConfig(pp=2, dp=2, zero=3, schedule="interleaved", interleave=2)
LLAMA_LOADED = ParallelConfig(tp=2, dp=2, zero=2)


def _llama(config: ParallelConfig, placed: dict, seed: int):
    torch.manual_seed(seed)
    return build_program(resolve(LLAMA).build(), ProgramPlacements.loads(placed[config]),
                         example_inputs=_llama_batches()[0],
                         optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))


def _llama_batches() -> list[tuple[torch.Tensor, ...]]:
    return [resolve(LLAMA).example_inputs(GLOBAL_BATCH, generator=torch.Generator().manual_seed(k)) for k in range(3)]


def _run_a(rank: int, ckpt: str, out: str, placed: dict) -> None:
    llama = _llama(LLAMA_SAVED, placed, 0)  # interleaved pipeline chunks, FSDP2 over dp
    losses = [llama.step(b) for b in _llama_batches()[:2]]
    checkpoint.save(llama, ckpt + "-llama", step=2)
    state = checkpoint.full_state(llama)  # this rank's stage only: every rank keeps its own
    losses.append(llama.step(_llama_batches()[2]))
    torch.save({"losses": losses, "state": state}, f"{out}-llama-{rank}")
    program = _program(SAVED, placed)
    batches = _batches()
    losses = [program.step(b) for b in batches[:SAVE_AT]]
    checkpoint.save(program, ckpt, step=SAVE_AT, samples_seen=SAVE_AT * GLOBAL_BATCH, model=MODEL)
    state = checkpoint.full_state(program)
    losses += [program.step(b) for b in batches[SAVE_AT:]]
    if rank == 0:
        torch.save({"losses": losses, "state": state}, out)
    torch.distributed.barrier()
    if rank == 1:  # die in the middle of DCP's write of the step-6 checkpoint
        from torch.distributed.checkpoint import filesystem

        def die(*args, **kwargs):
            os._exit(9)

        filesystem.FileSystemWriter.write_data = die
    checkpoint.save(program, ckpt, step=STEPS, samples_seen=STEPS * GLOBAL_BATCH, model=MODEL)


def _run_b(rank: int, ckpt: str, placed: dict) -> list[dict]:
    batches = _batches()
    results = []
    for config in (SAVED, *OTHER_PLANS):
        if config is OTHER_PLANS[0]:  # through the public API
            torch.manual_seed(123)
            compiled = autopar.compile(resolve(MODEL).build(), 4, config=config, example_inputs=batches[0],
                                       optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
            program, info = compiled.program, compiled.load_checkpoint(ckpt)
        else:
            program = _program(config, placed, seed=123)  # another init: the checkpoint must overwrite all of it
            info = checkpoint.load(program, ckpt)
        state = checkpoint.full_state(program)
        losses = [program.step(b) for b in batches[info.step:]]
        results.append({"config": config, "step": info.step, "steps_done": program.steps_done,
                        "state": state, "losses": losses})
    llama = _llama(LLAMA_LOADED, placed, 5)
    checkpoint.load(llama, ckpt + "-llama")
    results.append({"config": LLAMA_LOADED, "state": checkpoint.full_state(llama),
                    "losses": [llama.step(_llama_batches()[2])]})
    return results


def test_resume_reshard_and_crash_safety(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "run_a.pt"
    placed = _placed(*((MODEL, _batches()[0], c) for c in (SAVED, *OTHER_PLANS[1:])),
                     *((LLAMA, _llama_batches()[0], c) for c in (LLAMA_SAVED, LLAMA_LOADED)))
    with pytest.raises(RankFailure) as failure:
        spawn(_run_a, 4, (str(ckpt), str(out), placed), collective_timeout_s=60.0)
    assert failure.value.rank == 1 and "exit code 9" in str(failure.value)
    # the killed save left a half-written .tmp, never taken for a checkpoint
    assert (ckpt / "step_000006.tmp").is_dir() and not (ckpt / "step_000006.tmp" / "autopar.json").exists()
    assert not (ckpt / "step_000006").exists()
    info = checkpoint.latest(ckpt)
    assert info is not None and info.step == SAVE_AT and info.world_size == 4
    assert info.samples_seen == SAVE_AT * GLOBAL_BATCH and info.config == SAVED.to_json()

    run_a = torch.load(out)
    results = spawn(_run_b, 4, (str(ckpt), placed))
    llama_saved = [torch.load(f"{out}-llama-{r}") for r in range(4)]
    _check_llama(llama_saved, [per_rank.pop() for per_rank in results])
    saved_state = run_a["state"]
    for rank, per_rank in enumerate(results):
        for r in per_rank:
            assert r["step"] == SAVE_AT and r["steps_done"] == SAVE_AT + len(r["losses"])
            # every key this rank holds equals the saved value exactly (pp ranks hold a subset;
            # ZeRO-1 ranks only their optimizer partition)
            assert r["state"], (rank, r["config"])
            for key, value in r["state"].items():
                torch.testing.assert_close(value, saved_state[key], rtol=0, atol=0, msg=f"{key} {r['config']}")
    same_plan, *others = results[0]
    torch.testing.assert_close(torch.tensor(same_plan["losses"]), torch.tensor(run_a["losses"][SAVE_AT:]),
                               rtol=1e-5, atol=0)
    for r in others:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(run_a["losses"][SAVE_AT:]),
                                   rtol=1e-4, atol=0)
    # each plan's ranks together hold every saved key (pp stages and ZeRO-1 partitions split them)
    for i in range(len(results[0])):
        covered = set().union(*(set(per_rank[i]["state"]) for per_rank in results))
        assert covered == set(saved_state), (results[0][i]["config"], set(saved_state) ^ covered)


def _check_llama(saved: list[dict], loaded: list[dict]) -> None:
    """Saved under interleaved PP2 x DP2 x ZeRO-3 (each rank saw its stage), loaded under TP2 x
    DP2 x ZeRO-2: the same tensors, and the next step's loss as if never interrupted."""
    union = {}
    for r in saved:
        union.update(r["state"])
    assert any(k.startswith("model/output.") for k in union)  # untied: the head is its own key
    covered = set()
    for r in loaded:
        for key, value in r["state"].items():
            torch.testing.assert_close(value, union[key], rtol=0, atol=0, msg=key)
        covered |= set(r["state"])
    assert covered == set(union)
    torch.testing.assert_close(torch.tensor(loaded[0]["losses"]), torch.tensor(saved[0]["losses"][2:]),
                               rtol=1e-5, atol=0)


def _fake_checkpoint(root, name: str, *, metadata: bool = True, meta: bool = True) -> None:
    """The files `latest` looks at (DCP's .metadata, autopar.json), as a save leaves them."""
    d = root / name
    d.mkdir(parents=True)
    step = int(name.split("_")[1].split(".")[0])
    if metadata:
        (d / ".metadata").write_bytes(b"")
    if meta:
        (d / "autopar.json").write_text(
            '{"version": 1, "step": %d, "samples_seen": 0, "world_size": 1, "config": {}, "model": "", '
            '"model_fingerprint": "", "qkv_order": "canonical"}' % step)


def test_latest_takes_only_complete_checkpoints(tmp_path):
    assert checkpoint.latest(tmp_path) is None
    _fake_checkpoint(tmp_path, "step_000003")
    _fake_checkpoint(tmp_path, "step_000009.tmp")  # killed after its metadata, before the rename
    _fake_checkpoint(tmp_path, "step_000012", meta=False)  # not possible from save(), still refused
    _fake_checkpoint(tmp_path, "step_000015", metadata=False)
    (tmp_path / "latest").write_text("step_000003\n")
    assert checkpoint.latest(tmp_path).step == 3
    _fake_checkpoint(tmp_path, "step_000006")  # killed after the rename, before the pointer update
    assert checkpoint.latest(tmp_path).step == 6
    assert checkpoint.latest(tmp_path / "step_000003").step == 3
    with pytest.raises(checkpoint.CheckpointError, match="is not a complete checkpoint"):
        checkpoint.read_info(tmp_path / "step_000009.tmp")
