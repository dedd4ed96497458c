"""What each spawned rank of `autopar calibrate` measures, and the timing it measures with.

Where it sits: under autopar/calibrate.py, whose `calibrate(devices)` spawns the ranks
(`rank_measure` on each) and whose module docstring says what each figure is and how it is
fitted. This module holds the probes' sizes, the timing windows (`_repeat`), the reference
workload a later run's load is set against (`reference_workload`, `reference_time`), and
the measurements themselves, one function per kind, run in the same order on every rank.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.runtime.jobs import step_epilogue

GEMM_SHAPES = ((64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 128, 128),
               (1024, 256, 64), (256, 1024, 1024), (1024, 1024, 32))
"""(m, n, k): square sizes for the peak, thin ones for the K-ramp and per-call overhead."""
COPY_BYTES = (4 * 2**10, 256 * 2**10, 4 * 2**20, 32 * 2**20)
OPTIMIZER_SHAPES = ((1024, 1024), (1024, 1024), (2048, 512), (512,), (512,))
"""Parameters of the optimizer probe (3.1M elements, 12 MiB per state tensor: beyond the
caches, as a model's parameters are), stepped by the runtime's default optimizer."""
ACCUMULATE_ELEMENTS = 4 * 2**20
"""The in-place gradient accumulation probe: two fp32 tensors of 16 MiB."""
PARAM_TENSORS = (8, 48)
"""Parameter counts of the per-tensor epilogue probe (tiny tensors: the per-element work is ~0)."""
PARAM_TENSOR_ELEMENTS = 64
CHAIN_OPS = 200
"""Length of the small-op chains (eager+autograd, views, DTensor)."""
COLLECTIVE_BYTES = (4 * 2**10, 256 * 2**10, 2 * 2**20, 8 * 2**20)
COLLECTIVE_REPEATS = {4 * 2**10: 20, 256 * 2**10: 8, 2 * 2**20: 4, 8 * 2**20: 2}
KINDS = ("all_reduce", "all_gather", "reduce_scatter")
REFERENCE_STREAM_BYTES = 16 * 2**20
"""The reference workload's copy: a step streams its weights and activations through memory,
and another tenant's memory traffic slows that without slowing cache-resident work. With
GEMMs and small ops alone, one sweep group measured 1.3-1.4x slower than the same programs
an hour later, while its reference ran as fast as ever."""
MIN_TIME_S = 0.15
"""Length of one timing window of local work."""
WINDOWS = 3
REFERENCE_CALLS = 8
REFERENCE_WINDOWS = 11
"""`reference_s` is the fastest of REFERENCE_WINDOWS windows of REFERENCE_CALLS calls
(`reference_time`), and a later run that sets its own reference time against it must
reduce its timings the same way (benchmarks/sweep_cpu.py: one window per timed round, as
many rounds, the fastest): the fastest of more or longer windows is a faster time on an
unchanged machine. Measured back to back on 4 ranks of a quiet machine, the fastest of 3
windows of 5 calls (what calibrate timed before) came out 28.0-30.6 ms and the fastest of
7 windows of 8 calls 25.1-26.2 ms: set against each other, every sweep prediction was
scaled down by 10-15% (load factors 0.85-0.94 on a quiet machine)."""


def _param_tensor_s(mesh: Any, timed: Callable[..., float], barrier: Callable[[], None]) -> float:
    """Seconds per parameter tensor of the step's epilogue as the runtime runs it on DTensor
    parameters (autopar.runtime.jobs.step_epilogue: `gradient_for` per parameter, the default
    optimizer built by `make_optimizer`, `optimizer.step()`, `zero_grad(set_to_none=True)`): the slope
    between PARAM_TENSORS[0] and [1] tiny parameters replicated over `mesh`, so the per-step fixed part
    and the per-element work (priced per element) drop out."""
    def epilogue_s(count: int) -> float:
        params = [torch.nn.Parameter(distribute_tensor(torch.zeros(PARAM_TENSOR_ELEMENTS), mesh,
                                                       [Replicate()] * mesh.ndim)) for _ in range(count)]
        grads = [torch.full((PARAM_TENSOR_ELEMENTS,), 1e-3) for _ in range(count)]
        run = step_epilogue(params)

        def epilogue() -> None:
            run(grads)

        epilogue()  # the optimizer's state is created on its first step
        barrier()
        return timed(epilogue, barrier)

    few, many = PARAM_TENSORS
    return max(0.0, (epilogue_s(many) - epilogue_s(few)) / (many - few))


def _repeat(fn: Callable[[], None], sync: Callable[[], None], count: int | None = None) -> float:
    """Seconds per `fn()` call: the fastest of WINDOWS windows of (window wall time / calls).

    Whole windows, not single calls: with more ranks than cores the OS time-slices the
    ranks, and single short calls would see only the uninterrupted ones. The fastest
    window is the machine with the least load from other users (this one is shared); runs
    that happen under more load compare their reference time with `reference_s`.
    Local work sizes its windows to about MIN_TIME_S (the largest count any rank asks
    for, so all ranks run the same work); collectives need the same `count` on every rank
    (else the ranks deadlock). Every window starts and ends with `sync`: while one rank
    still works, the others wait, so a window is the time all ranks take together. (It
    ended on each rank's own clock before: the last ranks then ran with the cores to
    themselves, and a quiet machine measured GEMMs at 116 GFLOP/s per dedicated core, above
    what one rank alone gets, 91; steps were priced at 0.5-0.6 of their measured time.)"""
    fn()
    sync()
    if count is None:
        start = time.perf_counter()
        fn()
        count = max(1, min(10_000, int(MIN_TIME_S / max(time.perf_counter() - start, 1e-7))))

        if dist.is_initialized():  # one count on every rank: the windows are closed together
            agreed = torch.tensor([count])
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            count = int(agreed)
    per_call: list[float] = []
    for _ in range(WINDOWS):
        sync()
        start = time.perf_counter()
        for _ in range(count):
            fn()
        sync()  # a window ends when every rank's has: the ranks that finish first no longer
        # leave the last ones a core of their own (what a step's ranks never get)
        per_call.append((time.perf_counter() - start) / count)
    return min(per_call)


def reference_workload() -> Callable[[], None]:
    """A fixed mix of the local work training steps do here (GEMMs, small autograd ops, a
    copy through memory larger than the caches), to be called on every rank at once;
    returns the callable. Its time, set against `Calibration.reference_s`, says how much
    slower or faster the shared machine is now than when the profile was measured; it
    compares like with like only on as many ranks as the calibration ran (more ranks per
    core add time-slicing): a later run on more ranks times it on that many
    (benchmarks/sweep_cpu.py `REFERENCE_RANKS`).

    No collective: it had three 256 KB gloo all-reduces, over half its time, and that part
    ran 20% faster inside a process that had built and stepped training programs than at
    the start of a calibration, on an unchanged quiet machine (9.2-9.5 vs 11.6-11.7 ms; the
    local parts unchanged, 8.5-9.1 vs 8.8 ms). Every sweep group then timed it at 22.0-23.6
    ms against 27.2-29.8 ms in the calibrations minutes before, and the load factor scaled
    every prediction down by 20-25%: predictions 10% off (median) read as 30% off."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    x0 = torch.ones(16, requires_grad=True)
    w = torch.full((16,), 1.0001)
    src = torch.ones(REFERENCE_STREAM_BYTES // 4)
    dst = torch.empty_like(src)

    def run() -> None:
        dst.copy_(src)
        for _ in range(8):
            torch.mm(a, b)
        y = x0
        for _ in range(100):
            y = y * w
        y.sum().backward()

    return run


def reference_time(reference: Callable[[], None], sync: Callable[[], None]) -> float:
    """Seconds per call of `reference` (a `reference_workload`): the fastest of
    REFERENCE_WINDOWS windows of REFERENCE_CALLS calls, each window opened and closed by
    `sync` on every rank. `Calibration.reference_s` is this; see REFERENCE_WINDOWS."""
    reference()
    per_call = []
    for _ in range(REFERENCE_WINDOWS):
        sync()
        start = time.perf_counter()
        for _ in range(REFERENCE_CALLS):
            reference()
        sync()
        per_call.append((time.perf_counter() - start) / REFERENCE_CALLS)
    return min(per_call)


def _count_aten_ops(fn: Callable[[], None]) -> int:
    """ATen ops `fn()` dispatches (views included), counted with a dispatch mode."""
    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.calls


def rank_measure(rank: int) -> dict[str, Any]:
    """Runs on every spawned rank (module level: picklable for spawn): every figure of a
    Calibration, as this rank measured it, in a fixed order that every rank follows (their
    collectives and barriers meet)."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's rename
    n = dist.get_world_size()
    barrier = dist.barrier
    out: dict[str, Any] = {"gemm": [], "copy": [], "coll": [], "p2p": [], "scalar": []}
    reference = reference_workload()
    refs: list[float] = []
    reference_s = reference_time(reference, barrier)  # what a later run's load factor is set against

    def timed(fn: Callable[[], None], sync: Callable[[], None], count: int | None = None) -> float:
        """Seconds per call (`_repeat`). A short reference timing before it records how
        the machine's speed drifts over the run (`reference_drift`, logged), but does not
        scale it: scaled by (first reference timing / the one just before), each figure
        carried two timings' noise (fastest of 3 windows of 2 calls), and two consecutive
        3-run calibrations of a quiet machine measured GEMM shapes 0.74-1.33x apart and
        fitted peaks of 89.5 and 102.3 GFLOP/s; unscaled, 0.94-1.04x apart and 95.2 and
        97.1. Load between runs is what `combine` corrects (each run at its own
        `reference_s`)."""
        refs.append(_repeat(reference, barrier, 2))
        return _repeat(fn, sync, count)

    _measure_rates(out, timed, barrier)
    world_mesh = init_device_mesh("cpu", (n,))
    # on a mesh shaped as the runtime's ((pp, dp, tp), autopar.runtime.program.make_mesh):
    # DTensor's per-tensor work grows with the mesh's dimensions (18 vs 16 us a tensor, 3-D vs 1-D)
    out["param_tensor"] = _param_tensor_s(init_device_mesh("cpu", (1, n, 1), mesh_dim_names=("pp", "dp", "tp")),
                                          timed, barrier)
    _measure_host_ops(out, timed, barrier)
    _measure_dtensor_ops(out, timed, barrier, world_mesh, n)
    _measure_skew_and_attention(out, timed, barrier)
    _measure_collectives(out, timed, barrier, rank, n)
    _measure_send_recv(out, timed, barrier, rank, n)
    out["reference"] = reference_s
    out["reference_drift"] = max(refs) / min(refs)
    return out


Timed = Callable[..., float]
"""`timed(fn, sync, count=None)`: seconds per call of `fn` (rank_measure's timer)."""


def _measure_rates(out: dict[str, Any], timed: Timed, barrier: Callable[[], None]) -> None:
    """GEMMs, copies, and the step's two memory-bound passes (optimizer, accumulation)."""
    for m, nn_, k in GEMM_SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, nn_)
        barrier()
        out["gemm"].append((m, nn_, k, timed(lambda: torch.mm(a, b), barrier)))
    for nbytes in COPY_BYTES:
        src = torch.ones(nbytes // 4)
        dst = torch.empty_like(src)
        barrier()
        out["copy"].append((2 * nbytes, timed(lambda: dst.copy_(src), barrier)))

    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in OPTIMIZER_SHAPES]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    barrier()
    out["optimizer"] = timed(opt.step, barrier) / sum(p.numel() for p in params)
    del opt, params
    acc, grad = torch.zeros(ACCUMULATE_ELEMENTS), torch.randn(ACCUMULATE_ELEMENTS)
    barrier()
    out["accumulate"] = timed(lambda: acc.add_(grad), barrier) / (4 * ACCUMULATE_ELEMENTS)
    del acc, grad


def _measure_host_ops(out: dict[str, Any], timed: Timed, barrier: Callable[[], None]) -> None:
    """Per-op host cost: eager ops and views under autograd, then the same chains as the
    per-rank program runs them (make_fx graphs under no_grad)."""
    x0 = torch.ones(16, requires_grad=True)
    w = torch.full((16,), 1.0001)

    def chain() -> None:  # CHAIN_OPS forward muls, CHAIN_OPS backward muls (+ the sum and its grad)
        y = x0
        for _ in range(CHAIN_OPS):
            y = y * w
        y.sum().backward()

    barrier()
    out["eager_op"] = timed(chain, barrier) / (2 * CHAIN_OPS + 2)
    v = torch.ones(4, 4)

    def views() -> None:
        y = v
        for _ in range(CHAIN_OPS):
            y = y.t()

    barrier()
    out["view_op"] = timed(views, barrier) / CHAIN_OPS
    # the same two chains as the per-rank program runs its ops: traced by make_fx into a
    # GraphModule whose every node calls an ATen op overload, run under no_grad
    # (codegen/apply.py, autopar/runtime/spmd.py); what the cost model charges per op and per view
    def mul_chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        for _ in range(CHAIN_OPS):
            x = x * w
        return x

    def view_chain(x: torch.Tensor) -> torch.Tensor:
        for _ in range(CHAIN_OPS):
            x = x.t()
        return x

    x1 = torch.ones(16)
    op_graph, view_graph = make_fx(mul_chain)(x1, w), make_fx(view_chain)(v)

    def program_ops() -> None:
        with torch.no_grad():
            op_graph(x1, w)

    def program_views() -> None:
        with torch.no_grad():
            view_graph(v)

    barrier()  # (not all under one no_grad: `timed` runs the reference workload, which needs autograd)
    out["program_op"] = timed(program_ops, barrier) / CHAIN_OPS
    barrier()
    out["program_view"] = timed(program_views, barrier) / CHAIN_OPS


def _measure_dtensor_ops(out: dict[str, Any], timed: Timed, barrier: Callable[[], None], mesh: Any, n: int) -> None:
    """DTensor: the same small block (column-parallel linear, elementwise, view, reduction,
    forward and backward) on local tensors and on DTensors; the extra time per ATen op of
    the plain block is what a tensor-parallel layer's ops pay for DTensor dispatch."""
    wl = torch.randn(8 * n, 16, requires_grad=True)
    wd = distribute_tensor(wl.detach(), mesh, [Shard(0)]).requires_grad_()
    xl = torch.randn(8, 16)
    xd = distribute_tensor(xl, mesh, [Replicate()])

    def block(x: torch.Tensor, w: torch.Tensor) -> None:
        h = x
        for _ in range(CHAIN_OPS // 10):
            h = F.linear(x, w) * 1.0001
            h = torch.relu(h).view(8, -1).t().contiguous().t()
        (h * h).mean().backward()

    out["plain_ops"] = _count_aten_ops(lambda: block(xl, wl))
    barrier()
    out["plain_block"] = timed(lambda: block(xl, wl), barrier)
    barrier()
    out["dtensor_block"] = timed(lambda: block(xd, wd), barrier)


def _measure_skew_and_attention(out: dict[str, Any], timed: Timed, barrier: Callable[[], None]) -> None:
    """Rank skew: a collective between chunks of work waits for the last rank to arrive,
    which with more ranks than cores is whichever the OS scheduled last. Then the fused
    attention's FLOP rate."""
    ga, gb = torch.randn(192, 192), torch.randn(192, 192)
    tiny = torch.ones(1024)

    def work() -> None:
        for _ in range(8):
            torch.mm(ga, gb)

    barrier()
    t_work = timed(work, barrier, 20)
    t_coll = timed(lambda: dist.all_reduce(tiny), barrier, 20)
    t_both = timed(lambda: (work(), dist.all_reduce(tiny)), barrier, 20)
    out["sync_skew"] = max(0.0, t_both - t_work - t_coll)
    b_, h_, s_, d_ = 2, 4, 64, 32
    q, kk, vv = (torch.randn(b_, h_, s_, d_, requires_grad=True) for _ in range(3))

    def attention() -> None:
        F.scaled_dot_product_attention(q, kk, vv, is_causal=False).sum().backward()

    barrier()
    out["attention_flops_per_s"] = 3 * 4 * b_ * h_ * s_ * s_ * d_ / timed(attention, barrier)


def _measure_collectives(out: dict[str, Any], timed: Timed, barrier: Callable[[], None], rank: int, n: int) -> None:
    """KINDS of collectives (and a scalar all-reduce) at COLLECTIVE_BYTES, over the world and
    over 2-rank groups."""
    pairs = [dist.new_group([2 * j, 2 * j + 1]) for j in range(n // 2)]
    mine = pairs[rank // 2] if rank // 2 < len(pairs) else None
    # 2-rank groups: every pair at once, each pair's timing windows opened and closed on its
    # own barrier. Tried and not kept: windows closed on the world barrier (all
    # ranks busy for the whole window) read a 4 KiB pair collective at 0.56-1.34 ms instead of
    # 0.14-0.31, and the built-in profile measured so ranked the recorded CPU sweeps worse.
    pair_sync = (lambda: dist.barrier(group=mine)) if mine is not None else None
    passes = [(n, None, barrier)] + ([(2, mine, pair_sync)] if n > 2 else [])  # n = 2: the pair is the world
    for size, group, sync in passes:
        for nbytes in COLLECTIVE_BYTES:
            count = COLLECTIVE_REPEATS[nbytes]
            x = torch.ones(nbytes // 4)
            shard = torch.ones(nbytes // 4 // size)
            gathered = torch.empty(shard.numel() * size)
            barrier()
            if sync is not None:
                kw = {} if size == n else {"group": group}
                if nbytes == COLLECTIVE_BYTES[0]:
                    scalar = torch.ones(1)
                    out["scalar"].append((size, timed(lambda: dist.all_reduce(scalar, **kw), sync,
                                                      COLLECTIVE_REPEATS[nbytes])))
                out["coll"].append(("all_reduce", size, nbytes, timed(lambda: dist.all_reduce(x, **kw), sync, count)))
                out["coll"].append(("all_gather", size, nbytes, timed(
                    lambda: dist.all_gather_into_tensor(gathered, shard, **kw), sync, count)))
                out["coll"].append(("reduce_scatter", size, nbytes, timed(
                    lambda: dist.reduce_scatter_tensor(shard, gathered, **kw), sync, count)))
            else:  # the rank an odd world leaves without a pair: its reference timings inside
                for _ in KINDS + (("scalar",) if nbytes == COLLECTIVE_BYTES[0] else ()):  # `timed` meet
                    timed(lambda: None, lambda: None, count)  # the world barriers of the pairs' ones
            barrier()


def _measure_send_recv(out: dict[str, Any], timed: Timed, barrier: Callable[[], None], rank: int, n: int) -> None:
    """Point-to-point messages at COLLECTIVE_BYTES between rank pairs (ping-pong)."""
    peer = rank ^ 1
    for nbytes in COLLECTIVE_BYTES:
        x = torch.ones(nbytes // 4)
        barrier()
        if peer < n:
            def pingpong() -> None:  # one message each way; time per message = half
                if rank % 2 == 0:
                    dist.send(x, peer)
                    dist.recv(x, peer)
                else:
                    dist.recv(x, peer)
                    dist.send(x, peer)
            out["p2p"].append((nbytes, timed(pingpong, lambda: None, COLLECTIVE_REPEATS[nbytes]) / 2))
        else:  # no partner: its reference timings inside `timed` meet the others' barriers
            timed(lambda: None, lambda: None, COLLECTIVE_REPEATS[nbytes])
