"""Per-op placements decided once, before any rank builds: a plan's, or the ILP's for a configuration.

Where it sits: wiring (with autopar/api.py and autopar/commands/, which call it), between
the solver and the per-rank build (autopar/build/). Every rank of a job builds its program
from a `ProgramPlacements` (autopar/plan.py) and never solves; this module makes it:
- from a plan that records its program (`Plan.placements`: a one-stage plan's one chunk,
  a pipeline's every chunk), read as it is;
- else for the configuration (given by flags, `config=`, or a plan that records no
  placements): the model traced exactly as every rank traces it (autopar/build/one_stage.py
  `trace_microbatch`, autopar/build/chunks.py `trace_chunks`) and the intra-op ILP solved
  under the configuration's rules (solver/forced.py): the whole step for pp = 1, each
  pipeline chunk on its (dp, tp) submesh for pp > 1, with the chunk's boundary values in
  the one layout both neighbours agree on (split by batch over dp where dim 0 is the
  microbatch's rows, whole over tp).
The launcher (`autopar train`) calls it before spawning ranks (`place_job`); the API
(`autopar.compile` with `config=`, or a searched plan without stage placements) on rank 0,
which sends the result to every rank. The solution's placements are recorded per node key
(Graph.node_keys: every layer of a repeated group has the same one), so each rank's own
trace of the same model matches them.
"""

from __future__ import annotations

import copy
import functools
import logging
import multiprocessing
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from autopar.batch import batch_size
from autopar.build.chunks import trace_chunks
from autopar.build.one_stage import trace_microbatch
from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.ir import GROUPED_MM_BWD, GROUPED_MM_FWD, Graph
from autopar.placement import Placements, Shard, boundary_placements
from autopar.plan import Plan, ProgramPlacements, StagePlacements
from autopar.runtime.jobs import build_model_and_batches
from autopar.sharding import InfeasiblePlanError, NodeStrategy
from codegen.kernels.modules import swap_fused_modules

log = logging.getLogger(__name__)


def program_placements(model: nn.Module, config: ParallelConfig, example_inputs: Sequence[Any], *,
                       model_name: str = "", plan: Plan | None = None, loss_fn: Callable[..., torch.Tensor] | None = None,
                       cluster: Any = None, stage_layers: Sequence[int] | None = None, device_type: str = "cpu",
                       fused_kernels: bool | None = None, in_child: bool = False) -> ProgramPlacements:
    """What every rank of a run of `config` (or `plan`) builds from. `model` is left as it
    is (a copy is traced); `example_inputs` is one global batch.

    `plan`: its own placements where it records them; else solved for its configuration.
    `cluster`: the hardware the ILP prices (default `config.num_devices` cpu devices; a
    pipeline chunk is priced on its stage's share of it). `stage_layers`: a pipeline's
    layers per stage or chunk (default the plan's, else an even split). `device_type`: the
    ranks' device ("cpu" for gloo ranks), whose default precision policy applies where
    `config` names none. `fused_kernels` (pp = 1, solved; default on where CUDA is present
    and the program is not compiled): solve on the step traced with the fused Triton ops of
    codegen/kernels swapped in, which the build then swaps in too (a plan's placements name
    the ops of the step it was searched on, unfused: it runs as searched). `in_child`:
    trace and solve in a forked child process (`_in_child`: a rank that decides for the
    others gives the trace's and the solver's memory back). Raises InfeasiblePlanError where
    no placement obeys the configuration's rules, TraceError where the step does not trace."""
    name = model_name or (plan.model if plan is not None else "") or type(model).__name__
    if plan is not None and plan.records_program_for(config):
        return ProgramPlacements.of_plan(plan, config=config,
                                         grads_each_microbatch=config.pp > 1 and config.syncs_each_microbatch)
    solve = functools.partial(_solved_placements, model, config, example_inputs, name=name, plan=plan,
                              loss_fn=loss_fn, cluster=cluster, stage_layers=stage_layers,
                              device_type=device_type, fused_kernels=fused_kernels)
    return _in_child(solve) if in_child else solve()


def _solved_placements(model: nn.Module, config: ParallelConfig, example_inputs: Sequence[Any], *, name: str,
                       plan: Plan | None, loss_fn: Callable[..., torch.Tensor] | None, cluster: Any,
                       stage_layers: Sequence[int] | None, device_type: str,
                       fused_kernels: bool | None) -> ProgramPlacements:
    """`program_placements` for a configuration: `model` copied, traced and solved."""
    if stage_layers is None and plan is not None and config.pp > 1:
        stage_layers = tuple(plan.stage_layers)
    rows = config.dp * config.micro_batch
    num_microbatches = max(1, batch_size(example_inputs) // rows)
    if config.pp > 1:
        stages = solve_stage_placements(copy.deepcopy(model), config, example_inputs, cluster=cluster,
                                        num_microbatches=num_microbatches, stage_layers=stage_layers,
                                        loss_fn=loss_fn)
        return ProgramPlacements(model=name, config=config, origin="solved", stage_layers=tuple(stage_layers or ()),
                                 placements=stages, grads_each_microbatch=config.syncs_each_microbatch)
    from solver.spmd_search import op_placements  # lazy: the solver (PuLP), only when no plan has placements

    if fused_kernels is None:
        fused_kernels = torch.cuda.is_available() and not config.compiled
    traced_model = copy.deepcopy(model)
    if fused_kernels:
        traced_model = swap_fused_modules(traced_model)
    _, graph = trace_microbatch(traced_model, config, example_inputs, loss_fn=loss_fn, device_type=device_type)
    del traced_model
    if cluster is None:
        cluster = Cluster.parse(f"cpu:1x{config.num_devices}")
    solution = solve_config(graph, config, cluster, num_microbatches=num_microbatches)
    priced = priced_per_step(solution, num_microbatches, ("dp", "tp"))
    log.info("%s: placements solved for %s", name, config)
    return ProgramPlacements(model=name, config=config, origin="solved",
                             placements=(StagePlacements(chunk=0, placements=op_placements(graph, solution)),),
                             collectives=_rows(priced), grads_each_microbatch=solution.grads_each_microbatch,
                             fused_kernels=fused_kernels)


def _rows(priced: dict[tuple[str, str], tuple[int, int]]) -> tuple[tuple[str, str, int, int], ...]:
    return tuple(sorted((kind, axis, calls, nbytes) for (kind, axis), (calls, nbytes) in priced.items()))


def solve_stage_placements(model: nn.Module, config: ParallelConfig, example_inputs: Sequence[Any], *,
                           cluster: Any, num_microbatches: int, stage_layers: Sequence[int] | None = None,
                           loss_fn: Callable[..., torch.Tensor] | None = None) -> tuple[StagePlacements, ...]:
    """Every pipeline chunk's per-op placements under `config`'s rules: the chunks traced as
    each rank traces its own (autopar/build/chunks.py `trace_chunks`; `model` is cut in
    place), each solved by the stage ILP (`solve_stage`) on `cluster`, with what it prices
    per step. Raises what the cut (ValueError) or a solve (InfeasiblePlanError) raises."""
    from solver.spmd_search import op_placements  # lazy: the solver (PuLP), only when no plan has placements

    rows = config.dp * config.micro_batch
    recorded = []
    for stage in trace_chunks(model, config, example_inputs, loss_fn=loss_fn,
                              stage_layers=tuple(stage_layers) if stage_layers else None):
        solution = solve_stage(stage.graph, config, cluster, num_microbatches=num_microbatches, rows=rows)
        recorded.append(StagePlacements(chunk=stage.index, placements=op_placements(stage.graph, solution),
                                        collectives=_rows(priced_per_step(solution, num_microbatches, ("dp", "tp")))))
    return tuple(recorded)


def place_job(job: Any, *, cluster: Any = None, device_type: str = "cpu") -> Any:
    """`job` (autopar/runtime/jobs.py TrainJob) with the placements every rank builds each of
    its configurations from (`TrainJob.placements`): its plan's, else solved here for the
    configuration (`program_placements`), on the model and first batch every rank builds
    (the same seed). Call before spawning the job's ranks."""
    placed = []
    for i, config in enumerate(job.configs):
        model, batches, _ = build_model_and_batches(replace(job, steps=1))
        plan = Plan.loads(job.plans[i]) if i < len(job.plans) and job.plans[i] else None
        layers = job.stage_layers[i] if i < len(job.stage_layers) else None
        placed.append(program_placements(model, config, batches[0], model_name=job.model, plan=plan,
                                         cluster=cluster, stage_layers=layers, device_type=device_type).dumps())
    return replace(job, placements=tuple(placed))


def place_experts_split(job: Any, axis: int = 1) -> Any:
    """`job` (one configuration of one stage) with the placements of the ILP's optimum for it
    with every grouped matmul of the experts (autopar/grouped_mm.py: Hugging Face's MoE
    layers) held to its expert-parallel strategy on mesh axis `axis` (1: tp): the weights
    and the experts operand split on E there, each rank computing its experts' rows of its
    group's tokens, the partial outputs summed (Megatron-Core's all-gather dispatcher). For
    runs that set that layout beside the ILP's free choice. ValueError where the step has
    no grouped matmul."""
    from solver.forced import mesh_shape, solve_one_stage  # lazy: the solver (PuLP), only when placing
    from solver.intra_op.space import enumerate_strategies  # lazy: as above
    from solver.spmd_search import op_placements  # lazy: as above

    (config,) = job.configs
    model, batches, _ = build_model_and_batches(replace(job, steps=1))
    _, graph = trace_microbatch(copy.deepcopy(model), config, batches[0])
    grouped = (GROUPED_MM_FWD, GROUPED_MM_BWD)
    if not any(n.op in grouped for n in graph.nodes):
        raise ValueError(f"{job.model}: no grouped matmul of experts in the traced step, so there are no experts to "
                         "split; expert parallelism here applies to models whose experts trace to autopar's grouped "
                         "matmul (Hugging Face MoE models)")
    space = enumerate_strategies(graph, mesh_shape(config))
    kept = tuple(tuple(s for s in options if s.inputs[1][axis] == Shard(0)) if graph[i].op in grouped else options
                 for i, options in enumerate(space.strategies))
    m = max(1, batch_size(batches[0]) // (config.dp * config.micro_batch))
    solution = solve_one_stage(graph, config, Cluster.parse(f"cpu:1x{config.num_devices}"), num_microbatches=m,
                               space=replace(space, strategies=kept))
    placed = ProgramPlacements(model=job.model, config=config, origin="solved",
                               placements=(StagePlacements(chunk=0, placements=op_placements(graph, solution)),),
                               collectives=_rows(priced_per_step(solution, m, ("dp", "tp"))),
                               grads_each_microbatch=solution.grads_each_microbatch)
    return replace(job, placements=(placed.dumps(),))


def solve_stage(graph: Graph, config: ParallelConfig, cluster: Any, *, num_microbatches: int, rows: int) -> Any:
    """The intra-op ILP on one chunk's (dp, tp) submesh under `config`'s rules
    (solver/forced.py), its boundary inputs and tangents in the boundary layout. `cluster`:
    the whole job's (one stage's devices of it are priced, as the pipeline search prices
    a stage), default dp * tp cpu devices."""
    from solver import forced  # lazy: the solver (PuLP), only when no plan has placements

    if cluster is None:
        cluster = Cluster.parse(f"cpu:1x{config.dp * config.tp}")
    if cluster.num_devices != config.dp * config.tp:
        cluster = cluster.stage(config.dp * config.tp)

    def keep_input(node: Any, placements: Placements) -> bool:
        return tuple(placements) == boundary_placements(node.output.shape, rows, config.dp)

    return forced.solve_stage(graph, config, cluster, num_microbatches=num_microbatches, keep_input=keep_input)


def solve_config(graph: Graph, config: ParallelConfig, cluster: Any, *, num_microbatches: int) -> Any:
    """The ILP's solution for a configuration given by flags (solver/forced.py rules)."""
    from solver.forced import solve_one_stage  # lazy: the solver (PuLP), only when no plan has placements

    return solve_one_stage(graph, config, cluster, num_microbatches=num_microbatches)


def _in_child(decide: Callable[[], ProgramPlacements]) -> ProgramPlacements:
    """`decide()` (trace and solve) in a forked child process, where the platform forks:
    its placements, or the error it raised (InfeasiblePlanError, TraceError, a ValueError
    of the cut, re-raised here; a RuntimeError where the child failed otherwise).

    Why a child: tracing and solving allocate far more than the program keeps (the model
    copied whole to be traced, the fake-tensor trace, PuLP's model objects, HiGHS's native
    buffers, the allocator arenas they grow), and rank 0 alone decides for every rank.
    Solved in rank 0 itself, the solve's leftovers ran every step about 9-13 MiB above the
    other ranks on the benchmark Llama, and a pipeline's trace of every chunk put rank 0's
    build peak 8-10 MiB above the other ranks' (the per-rank peak is the max over ranks).
    A forked child shares the model copy-on-write and gives everything back when it exits;
    only the placements come back, as the JSON text a plan file holds (`ProgramPlacements
    .dumps`). Where fork is unavailable (or the child cannot start) `decide` runs here."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return decide()
    ctx = multiprocessing.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)

    def child() -> None:
        torch.set_num_threads(1)  # the parent's intra-op thread pool does not survive fork
        try:
            out: Any = decide().dumps()
        except ValueError as exc:  # InfeasiblePlanError, TraceError, a cut refused
            out = exc
        except BaseException as exc:  # noqa: BLE001 (reported to the parent, which raises it)
            out = RuntimeError(f"deciding the placements failed in a child process: {type(exc).__name__}: {exc}")
        try:
            writer.send(out)
        except Exception as exc:  # noqa: BLE001 (an unpicklable exception)
            writer.send(RuntimeError(f"deciding the placements failed in a child process: {out!r} ({exc})"))
        writer.close()

    proc = ctx.Process(target=child, name="autopar-placements")
    try:
        proc.start()
    except (AssertionError, OSError):  # e.g. a daemonic process may not have children
        reader.close()
        writer.close()
        return decide()
    writer.close()
    try:
        out = reader.recv()
    except EOFError:
        out = RuntimeError(f"deciding the placements: the child process ended without a result "
                           f"(exit code {proc.exitcode})")
    finally:
        reader.close()
        proc.join()
    if isinstance(out, BaseException):
        raise out
    return ProgramPlacements.loads(out)


def priced_per_step(solution: Any, num_microbatches: int, axis_names: Sequence[str]) -> dict[tuple[str, str], tuple[int, int]]:
    """What a solution prices per step: {(kind, axis name): (calls, bytes)} (per-microbatch
    edges m times, the bucketed gradient sync once (ZeRO-2's syncs are per-microbatch
    edges); a traced layer counts `weight` times)."""
    out: dict[tuple[str, str], list[float]] = {}
    for c in solution.collectives:
        times = c.weight * (1 if c.gradient_sync else num_microbatches)
        entry = out.setdefault((c.kind, axis_names[c.axis]), [0.0, 0.0])
        entry[0] += times
        entry[1] += times * c.bytes
    return {k: (int(round(v[0])), int(round(v[1]))) for k, v in out.items()}


def solution_choices(graph: Graph, solution: Any) -> tuple[NodeStrategy, ...]:
    by_node = {c.node: c for c in solution.choices}
    return tuple(NodeStrategy(outputs=by_node[i].outputs, inputs=by_node[i].inputs, update=by_node[i].update)
                 for i in range(len(graph)))
