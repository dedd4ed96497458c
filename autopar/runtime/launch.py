"""Start ranks: local gloo processes (spawn) or the world torchrun already made.

Where it sits: runtime, under autopar/commands/train.py, autopar/api.py and the dist
tests. `spawn(fn, world_size, args)` starts `world_size` processes (forkserver context, a
file:// store in a temp dir, `torch.set_num_threads(1)`), runs `fn(rank, *args)` in each
inside an initialised gloo process group, and returns every rank's result.

Start-up: the forkserver (started once per parent process, then reused) has imported torch
and this module (`PRELOAD`), and every rank is a fork of it, so a rank starts in a fraction
of a second where a fresh interpreter importing torch took 3.7 s for 4 ranks and 7.4 s for
8 on this 2-core machine. A fork of the server would carry the server's environment, not
the caller's: the caller's `os.environ` at the call is sent along and set in the rank
before anything runs (variables that torch reads while it is imported keep the server's
values, and so do those the C library reads at process start: a later spawn that changes one
of those, PROCESS_START_VARIABLES, is refused, `check_process_start_environment`).

Teardown: each rank imports `torch.distributed.nn.functional` before creating its group
(`import_before_process_group`), so the group `destroy_process_group` destroys is really
freed and no gloo thread outlives it into interpreter shutdown.

Failure policy (no hangs): each process group gets a collective timeout
(`collective_timeout_s`), and the parent polls its children; as soon as one exits with
an error, the others get `grace_s` to finish and are then terminated (SIGTERM, then
SIGKILL). The parent raises `RankFailure` naming the rank and its traceback's tail.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import logging
import os
import pickle
import signal
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

log = logging.getLogger(__name__)

DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
"""Long enough for a first step with lazy DTensor init on 8 ranks sharing 2 cores."""

BUILD_EXCHANGE_TIMEOUT_S = 1800.0
"""How long ranks wait for work one rank does alone before the program is built (the plan
search or the ILP solve on rank 0 of ranks `autopar.compile` runs in): minutes for a large
model on a loaded machine, so not the collective timeout, which is sized for steps."""


class RankFailure(RuntimeError):
    """A spawned rank raised, died or hung; carries the rank and its error text.

    `user_error` is True when the rank raised a ValueError (a bad input or setting, such as
    a NaN loss from too high a learning rate), False for crashes, hangs and timeouts."""

    def __init__(self, rank: int, detail: str, *, user_error: bool = False, what: str = "failed") -> None:
        super().__init__(f"rank {rank} {what}: {detail}")
        self.rank = rank
        self.detail = detail
        self.user_error = user_error


_PEER_ERRORS = ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer",
                "Socket Timeout", "Broken pipe")
"""Errors a healthy rank raises because a peer died or hung: not the cause of a failure."""


def import_before_process_group() -> None:
    """Import the torch module that captures the default process group at import time,
    before a group exists.

    `torch.distributed.nn.functional` binds `group=group.WORLD` as default arguments of ten
    functions when it is imported. torch imports it lazily (through torch._dynamo, which
    the first call of any `torch.library` custom op imports, e.g. codegen/kernels' fused
    ops); imported after `init_process_group`, it holds the live group forever, so
    `destroy_process_group` cannot free it and its gloo threads (gloo_tcp_loop,
    pt_gloo_runloop) run on into interpreter shutdown, where tearing them down now and then
    aborts the rank with "terminate called without an active exception" (SIGABRT).
    Imported first, its defaults are None."""
    import torch.distributed.nn.functional  # noqa: F401  # lazy: the point: imported before init_process_group


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_from_env(backend: str | None = None, collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> None:
    """Join the torchrun world (env:// rendezvous) unless a process group already exists."""
    if dist.is_initialized():
        return
    if int(os.environ.get("RANK", "0")) != 0:
        quiet_library_warnings()
    import_before_process_group()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=collective_timeout_s))
    destroy_at_exit()


def destroy_at_exit() -> None:
    """Destroy the process group (and every subgroup: the mesh's, a pipeline's) when the
    interpreter exits, if the program has not: a group autopar started for a user's script
    (`autopar.compile` under torchrun) would otherwise leave its gloo threads running into
    interpreter shutdown, where tearing them down now and then aborts the rank with
    "terminate called without an active exception" (SIGABRT, exit -6) after the script's
    work is done (seen on rank 0 of the README's quick start under `torchrun
    --nproc_per_node 2`, once, on a loaded 2-core machine). `atexit` runs before that
    teardown."""
    def destroy() -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(destroy)


def gather_build_results(value: Any, *, timeout_s: float = BUILD_EXCHANGE_TIMEOUT_S) -> list[Any]:
    """Every rank's `value`, by rank, on every rank, over a gloo group whose timeout is
    `timeout_s`, not the world's collective timeout: ranks wait here while one rank (or
    one per submesh) computes something alone (the ILP solve, the plan search), which can
    outlast a step's collective timeout; a plain collective would make the others give up
    and fail the job."""
    # every rank makes the group at this call (new_group is collective) and frees it after,
    # so no group outlives the world into interpreter shutdown
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        box: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(box, value, group=group)
    finally:
        dist.destroy_process_group(group)
    return box


PRELOAD = ["torch", "torch.distributed", "torch.distributed.nn.functional", "autopar.runtime.launch",
           "autopar.runtime.jobs", "autopar.runtime.program", "autopar.runtime.spmd", "autopar.runtime.pipe_spmd",
           "autopar.build", "autopar.build.one_stage", "autopar.build.pipeline", "codegen.apply",
           "torch._functorch.aot_autograd", "autopar.runtime.fork_ready"]
"""What the forkserver imports once, before it forks ranks (module docstring): torch (2.4 s
per process here), the runtime and the per-rank build every training rank imports (0.8 s
more), and what tracing
the step imports on first use (`aot_export_joint_with_descriptors`: torch._functorch.aot_autograd,
which brings dynamo, inductor's config and caches, networkx, triton's Python package; 1.0-1.4
s per process on a shared 2-core machine), which every rank paid again after
its fork: 762 modules, counted in a rank of a dp2 x tp2 run. The server has started no
thread of its own after these imports (checked: the same 2 tasks as after `import torch`,
aot_autograd included), so forking it is safe. Last, autopar/runtime/fork_ready.py freezes the
garbage collector over all of it, so the ranks' collections neither walk nor copy it."""


def quiet_library_warnings() -> None:
    """Warnings (Python's and logged ones below ERROR) are printed by rank 0 alone: every
    rank runs the same code, and N copies of one DTensor or Hugging Face warning say
    nothing more. Errors still print on every rank."""
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)


def _worker(rank: int, world_size: int, store_path: str, result_dir: str, fn: Callable[..., Any],
            args: tuple[Any, ...], collective_timeout_s: float, environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the caller's environment, not the forkserver's

    torch.set_num_threads(1)
    if rank != 0:
        quiet_library_warnings()
    import_before_process_group()
    # a rank found hung is sent STACK_SIGNAL before it is stopped: every thread's Python
    # stack goes to <rank>.stack (faulthandler writes it from the signal handler, so a rank
    # blocked inside a C++ collective or a solver answers too)
    stack_file = open(Path(result_dir) / f"{rank}.stack", "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True)
    # a rank that crashes in native code (SIGSEGV, SIGABRT from glibc's heap checks, ...)
    # writes its threads' stacks there too, and the parent names the line (`_failure`):
    # without it, a native crash (e.g. malloc(): unaligned tcache chunk detected) leaves
    # only its exit code
    faulthandler.enable(file=stack_file, all_threads=True)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        result = fn(rank, *args)
        with open(Path(result_dir) / f"{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # report any failure to the parent, then die without cleanup
        if isinstance(exc, ValueError):
            Path(result_dir, f"{rank}.user").write_text("")
        Path(result_dir, f"{rank}.err").write_text(traceback.format_exc())
        os._exit(1)


STACK_SIGNAL = signal.SIGUSR1
"""Sent to a rank still running when its peers have failed: it writes its threads' stacks
(`_worker`) before it is stopped, so a hang names the line it was at."""
STACK_WAIT_S = 1.0


def _stop(procs: list[Any], grace_s: float, stacks: bool = False) -> list[int]:
    """Let every process end within `grace_s`, then terminate; returns the ranks still running.
    `stacks`: first ask each one still running for its stacks (STACK_SIGNAL)."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    if stacks and alive:
        for r in alive:
            try:
                os.kill(procs[r].pid, STACK_SIGNAL)
            except (OSError, TypeError):  # ended meanwhile
                pass
        time.sleep(STACK_WAIT_S)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join()
    return alive


def _where(tmp: str, rank: int, *, crashed: bool = False) -> str:
    """Where a rank was, from the stack faulthandler wrote (`stack_where`), or nothing."""
    stack = Path(tmp, f"{rank}.stack")
    return stack_where(stack.read_text() if stack.exists() else "", crashed=crashed)


def stack_where(text: str, *, crashed: bool = False) -> str:
    """The innermost frames of the thread a faulthandler dump is about.

    faulthandler writes one block per Python thread, newest thread first (the main thread
    last), and heads the block of the thread it runs on "Current thread". A rank found hung
    is sent STACK_SIGNAL, whose handler runs on the main thread: that block says where the
    main thread was. A crash (`crashed`) dumps from the crashing thread: its block is the
    line that crashed; when the crash is in a thread with no Python state (gloo's threads,
    a BLAS or OpenMP pool), no block is "Current thread", and the main thread's (the last)
    is quoted as such rather than whichever thread happens to be listed first."""
    if "Fatal Python error" in text:  # a crash after an earlier STACK_SIGNAL dump: the crash's
        text = text[text.rindex("Fatal Python error"):]
    blocks: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(("Current thread", "Thread 0x")):
            blocks.append((line, []))
        elif blocks and line.startswith("File "):
            blocks[-1][1].append(line)
    signal = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                   if line.startswith("Fatal Python error:")), "")
    current = next((frames for head, frames in blocks if head.startswith("Current thread")), None)
    if current:
        return (f"; it crashed{f' ({signal})' if signal else ''} at: " if crashed else "; its main thread was at: ") \
            + " <- ".join(current[:4])
    main = blocks[-1][1] if blocks else []
    if crashed and blocks:
        return (f"; it crashed{f' ({signal})' if signal else ''} in a thread with no Python frames (native: "
                "gloo's, a BLAS or OpenMP pool's)") + ("; its main thread was at: " + " <- ".join(main[:4]) if main else "")
    return ("; its main thread was at: " + " <- ".join(main[:4])) if main else ""


def _failure(tmp: str, codes: list[int | None], failed: list[int], alive: list[int],
             collective_timeout_s: float) -> RankFailure:
    """Name the rank that caused a failure: one with its own error or crash, else a hung one."""

    def detail(rank: int) -> str:
        err = Path(tmp, f"{rank}.err")
        if err.exists():
            return err.read_text().strip().splitlines()[-1]
        return f"exit code {codes[rank]} (killed or crashed without a Python error){_where(tmp, rank, crashed=True)}"

    def peer_error(rank: int) -> bool:
        # the whole text: a peer's timeout may be the cause of the error the rank raised last
        # (torch's pipeline stages wrap an error of a stage's forward, collectives included)
        err = Path(tmp, f"{rank}.err")
        text = err.read_text() if err.exists() else detail(rank)
        return any(e in text for e in _PEER_ERRORS)

    causes = [r for r in failed if not peer_error(r)]
    if causes:
        rank = causes[0]
        return RankFailure(rank, detail(rank), user_error=Path(tmp, f"{rank}.user").exists())
    if alive:  # every failed rank gave up waiting for a peer; the peer still running is hung
        others = ", ".join(str(r) for r in failed)
        return RankFailure(alive[0], f"stopped responding (still running, not in the collective) while rank(s) "
                           f"{others} waited for it {collective_timeout_s:.0f} s and gave up: {detail(failed[0])}"
                           f"{_where(tmp, alive[0])}", what="hung")
    return RankFailure(failed[0], detail(failed[0]))


PROCESS_START_VARIABLES = ("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD")
"""Environment variables (names, or prefixes ending in _) that the C library reads once,
when a process starts: glibc's allocator tunables and the preloaded libraries. A rank is a
fork of the forkserver, so it has the values the server started with, whatever the
caller's environment says at a later spawn."""

_server_start_environ: dict[str, str] | None = None
"""PROCESS_START_VARIABLES as they were at this process's first spawn, which starts the
forkserver (module docstring): what every rank of every later spawn runs with."""


def _process_start_values(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items()
            if any(k.startswith(p) if p.endswith("_") else k == p for p in PROCESS_START_VARIABLES)}


def check_process_start_environment(environ: dict[str, str]) -> None:
    """Raise ValueError, before any rank starts, when `environ` sets a variable the C
    library reads at process start (PROCESS_START_VARIABLES) to another value than the
    forkserver started with: the ranks would run with the server's value and the caller's
    setting would silently not apply (a benchmark's memory phase once set glibc's mmap
    threshold this way for its first spawn, and every later rank, its timed ones included,
    inherited it through the server: steps 1.6-1.9x slower). The first spawn of a process
    records the values (it starts the server)."""
    global _server_start_environ
    now = _process_start_values(environ)
    if _server_start_environ is None:
        _server_start_environ = now
        return
    differ = sorted(k for k in set(now) | set(_server_start_environ) if now.get(k) != _server_start_environ.get(k))
    if differ:
        said = ", ".join(f"{k}={now.get(k, '<unset>')!s} (ranks have {_server_start_environ.get(k, '<unset>')})"
                         for k in differ)
        raise ValueError(
            f"spawn: {said}: the C library reads these when a process starts, and ranks are forks of the "
            "forkserver this process's first spawn started, so the setting would not reach them. Set it before "
            "the first spawn (e.g. in the shell that starts the job), or in the ranks themselves (for glibc's "
            "allocator: mallopt, as benchmarks/measure_cpu.py return_freed_memory_to_os does)")


def spawn(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...] = (), *,
          collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S, timeout_s: float = 900.0,
          grace_s: float = 2.0) -> list[Any]:
    """Run `fn(rank, *args)` on `world_size` local gloo ranks; returns results by rank.

    `fn` must be importable (a module-level function) and its result picklable."""
    if world_size < 1:
        raise ValueError(f"--devices must be a positive integer, got {world_size}")
    environ = dict(os.environ)
    check_process_start_environment(environ)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="autopar-") as tmp:
        store = str(Path(tmp) / "store")
        procs = [ctx.Process(target=_worker, args=(r, world_size, store, tmp, fn, args, collective_timeout_s, environ),
                             daemon=False) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                codes = [p.exitcode for p in procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    alive = _stop(procs, grace_s, stacks=True)
                    codes = [p.exitcode for p in procs]
                    failed = [r for r, c in enumerate(codes) if c not in (None, 0) and r not in alive]
                    failure = _failure(tmp, codes, failed, alive, collective_timeout_s)
                    err = Path(tmp, f"{failure.rank}.err")
                    log.error("rank %d failed:\n%s", failure.rank, err.read_text() if err.exists() else failure.detail)
                    for r in alive:
                        stack = Path(tmp, f"{r}.stack")
                        if stack.exists() and stack.read_text().strip():
                            log.error("rank %d was still running; its stacks:\n%s", r, stack.read_text())
                    raise failure
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    _stop(procs, 0.0)
                    raise RankFailure(-1, f"job did not finish within {timeout_s:.0f} s; all ranks stopped")
                time.sleep(0.05)
        except BaseException:
            _stop(procs, 0.0)
            raise
        results = []
        for r in range(world_size):
            with open(Path(tmp) / f"{r}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results
