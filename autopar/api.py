"""`autopar.compile`: turn a model and a mesh into a parallel training step on this rank.

Where it sits: with autopar/cli.py, the only place that wires stages together. It
resolves the mesh to a world size, joins or checks the process group (torchrun's env://
world, ranks started by `autopar.runtime.launch.spawn`, or a one-rank world it creates),
takes the configuration from `plan=` (replayed after a fingerprint check), `config=`, or
else searches one (trace on the example inputs, price with the cost model,
solver/pipeline_search.py), and builds the per-rank program (autopar/runtime/program.py).

Batches: `step(batch)` takes the *global* batch, identical on every rank (as synthetic
data or a seeded loader gives it); each rank takes its data-parallel slice. Weight init:
build the model under the same `torch.manual_seed` on every rank before compiling.
"""

from __future__ import annotations

import copy
import datetime
import functools
import logging
import tempfile
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh

from autopar import batch as batches
from autopar.capabilities import zoo_family
from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.plan import InfeasiblePlanError, Plan, ProgramPlacements, fingerprint_source, module_fingerprint
from autopar.runtime.launch import destroy_at_exit, gather_build_results, init_from_env, launched_by_torchrun
from autopar.trace import trace_model, trace_step, with_precision

if TYPE_CHECKING:
    from autopar.runtime.program import OptimizerFactory

log = logging.getLogger(__name__)

MeshLike = DeviceMesh | Cluster | str | int


def _num_devices(mesh: MeshLike) -> int:
    if isinstance(mesh, DeviceMesh):
        return mesh.size()
    if isinstance(mesh, Cluster):
        return mesh.num_devices
    if isinstance(mesh, str):
        return Cluster.parse(mesh).num_devices
    if isinstance(mesh, int) and not isinstance(mesh, bool) and mesh > 0:
        return mesh
    raise ValueError(f"mesh must be a DeviceMesh, a Cluster, a string such as 'cpu:4' or a positive int, got {mesh!r}")


def _ensure_process_group(num_devices: int) -> None:
    if not dist.is_initialized():
        if launched_by_torchrun():
            init_from_env()
        elif num_devices == 1:
            store = tempfile.NamedTemporaryFile(prefix="autopar-store-", delete=False).name
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=60))
            destroy_at_exit()
        else:
            raise ValueError(
                f"autopar.compile for {num_devices} devices needs a process group: run under "
                f"`torchrun --nproc_per_node {num_devices}`, or inside ranks started by "
                "autopar.runtime.launch.spawn (or `autopar train --devices N`)"
            )
    world = dist.get_world_size()
    if world != num_devices:
        raise ValueError(f"the mesh has {num_devices} devices but the process group has {world} ranks; "
                         "make them equal")


def _cluster_of(mesh: MeshLike) -> Cluster:
    if isinstance(mesh, Cluster):
        return mesh
    if isinstance(mesh, str):
        return Cluster.parse(mesh)
    device = mesh.device_type if isinstance(mesh, DeviceMesh) else "cpu"
    hardware = "cpu" if device == "cpu" else "h100"  # a real GPU mesh without a profile: assume H100
    return Cluster.parse(f"{hardware}:1x{_num_devices(mesh)}")


LAYERS_TRACED = 2
"""Zoo models repeat one layer structure: two traced layers scale exactly to the depth."""

MAX_ZOO_TRACES = 64
_ZOO_TRACES: dict[tuple, Any] = {}
"""A zoo model's traced steps by (name, seq, rows, dtype, recompute): the zoo builds a model
from its name alone and a Graph is immutable, so a search, and the `autopar price` of
its configurations after it, trace each once per process (oldest dropped first)."""
_ZOO_FINGERPRINTS: dict[tuple, str] = {}


def search_plans(model: str | nn.Module, mesh: MeshLike, *, global_batch: int | None = None,
                 example_inputs: Sequence[Any] | None = None, loss_fn: Callable[..., torch.Tensor] | None = None,
                 seq: int | None = None, memory_gb: float | None = None, top: int = 5,
                 time_limit_s: float | None = None, progress: Any = None,
                 microbatch_choices: int | None = None, min_pp: int = 1, max_pp: int | None = None,
                 fixed: Any = None, precision: str = "", reduce_dtype: str = "", compiled: bool = False) -> Any:
    """The one wiring of the whole-plan search (`autopar search`, `search_plan`,
    `autopar.compile`): trace the step at each microbatch the search asks for, fingerprint
    the model, run solver/pipeline_search.py; returns its SearchResult (ranked plans, the
    best as a Plan, phases in seconds over the whole pipeline).

    `model` is a zoo name (a preset or spec: LAYERS_TRACED layers traced on fake tensors,
    float32 on the cpu profile, else bfloat16; `seq` overrides its sequence length), a
    factory name `package.module:function` (its module and batch, traced whole; the batch
    must be `global_batch`), or an nn.Module with `example_inputs`, one global batch
    (`loss_fn` as in `compile`). One-stage candidates are priced by the intra-op ILP (the
    plan's per-op placements are the program that runs), pipelines by the inter-op DP over
    ILP stage costs, ranked only where the runtime runs them. `progress(phase, done, total)`
    is told of the phases; deterministic unless `time_limit_s` stops the solver. `min_pp` > 1
    ranks pipelines only, `max_pp` = 1 one-stage plans only. `fixed` (solver.search_config.Fixed):
    price one configuration the way the search prices it (`autopar price`); its pipeline
    chunks are not traced for their placements. `precision` / `reduce_dtype` name the
    precision policy (autopar/precision.py; "" is the cluster's default, and `fixed`'s
    configuration's where it names one): the step is traced in its compute dtype, priced in
    its dtypes, and the plans record it. `compiled`: the plans run their per-rank graphs
    through Inductor (`--compile`, `fixed`'s configuration's where it says so), priced so
    (cost_model/table.py `compiled_scale`), and record it."""
    # imported on use: cost_model (under the solver) imports autopar's types, which import this module
    from solver.pipeline_search import search  # lazy: the API imports the solver only inside functions
    from solver.results import SearchResult  # lazy: the API imports the solver only inside functions
    from solver.search_config import SearchConfig  # lazy: the API imports the solver only inside functions

    t0 = time.perf_counter()
    cluster = _cluster_of(mesh).with_memory_gb(memory_gb)
    if progress:
        progress("trace", 0, 1)
    source = resolve(model).with_overrides(seq=seq) if isinstance(model, str) else None
    zoo = source is not None and source.config is not None
    num_layers = source.config.layers if zoo else None
    if fixed is not None and fixed.config.precision:
        precision, reduce_dtype = fixed.config.precision, fixed.config.reduce_dtype
    compiled = compiled or (fixed is not None and fixed.config.compiled)
    named = ParallelConfig(precision=precision, reduce_dtype=reduce_dtype,
                           compiled=compiled).resolved(cluster.hardware.name)
    module: nn.Module | None = None
    example: Sequence[Any] | None = None
    if zoo:
        name, family = model, source.family
        trace_at = _zoo_tracer(model, seq, source, named.policy(), compiled)
    else:
        module, example, name, family = _module_and_batch(model, source, example_inputs)
        global_batch = _checked_global_batch(model, source, example, global_batch)
        trace_at = _module_tracer(module, example, loss_fn, named.policy(), compiled)
    if global_batch is None:
        raise ValueError(f"searching {model!r} needs global_batch= (--global-batch)")
    t = time.perf_counter()
    fingerprint = _fingerprint(model, seq, source, zoo)
    phases = (("fingerprint", time.perf_counter() - t),)
    extra = {} if microbatch_choices is None else {"microbatch_choices": microbatch_choices}
    result = search(trace_at, cluster, SearchConfig(global_batch=global_batch, model=name, fingerprint=fingerprint,
                                                    family=family, top=top, time_limit_s=time_limit_s,
                                                    num_layers=num_layers, min_pp=min_pp, max_pp=max_pp, fixed=fixed,
                                                    **extra), progress=progress)

    # the plans record the policy and compilation they were priced under, and run them
    def recorded(config: ParallelConfig) -> ParallelConfig:
        return replace(config, precision=named.precision, reduce_dtype=named.reduce_dtype, compiled=compiled)

    best = replace(result.plan, config=recorded(result.plan.config))
    plans = tuple(replace(p, config=recorded(p.config)) for p in result.plans) if result.plans else result.plans
    if best.config.pp > 1 and fixed is None:
        # the pipeline's program: each chunk traced as the ranks trace it and solved, recorded
        t = time.perf_counter()
        best = record_stage_placements(best, module, example, loss_fn=loss_fn)
        plans = (best, *plans[1:]) if plans else plans
        phases += (("stages", time.perf_counter() - t),)
    log.info("searched plan: %s", best.config)
    ranked = tuple(replace(r, config=recorded(r.config)) for r in result.ranked)
    return SearchResult(ranked=ranked, plan=best, phases=phases + result.phases,
                        search_time_s=time.perf_counter() - t0, plans=plans, communication=result.communication)


def _zoo_tracer(model: str, seq: int | None, source: Any, policy: Any, compiled: bool) -> Callable[..., Any]:
    """`trace_at(rows, recompute)` of the search for a zoo model: LAYERS_TRACED layers traced
    on fake tensors in the policy's compute dtype, kept in _ZOO_TRACES (at most
    MAX_ZOO_TRACES, the oldest dropped first)."""
    captured: dict = {}  # this search's policy-free captures: each policy is a rewrite of one

    def trace_at(rows: int, recompute: str = "none") -> Any:
        key = (model, seq, rows, policy, recompute)
        if key not in _ZOO_TRACES:
            while len(_ZOO_TRACES) >= MAX_ZOO_TRACES:
                _ZOO_TRACES.pop(next(iter(_ZOO_TRACES)))
            _ZOO_TRACES[key] = with_precision(trace_model(source, batch=rows, dtype=policy.compute,
                                                          layers_traced=LAYERS_TRACED, recompute=recompute,
                                                          captured=captured),
                                              policy)
        return replace(_ZOO_TRACES[key], compiled=True) if compiled else _ZOO_TRACES[key]

    from solver.spmd_search import BatchScalingTracer  # lazy: the API imports the solver only inside functions

    return BatchScalingTracer(trace_at)  # a zoo model's structure does not depend on its batch


def _module_and_batch(model: Any, source: Any, example_inputs: Sequence[Any] | None
                      ) -> tuple[nn.Module, Sequence[Any], str, str]:
    """(module, one global batch, name, family) of a factory name or an nn.Module with its
    example inputs; ValueError for anything else."""
    if source is not None:  # a factory: runs as one stage or cut at its layers, never by the rule tables
        module, example = source.factory()
        return module, example, model, ""
    if isinstance(model, nn.Module) and example_inputs is not None:
        return model, example_inputs, type(model).__name__, zoo_family(model)
    raise ValueError(f"search a zoo or factory name, or an nn.Module with example_inputs= (one global "
                     f"batch); got {type(model).__name__} with example_inputs={example_inputs!r}")


def _checked_global_batch(model: Any, source: Any, example: Sequence[Any], global_batch: int | None) -> int:
    """The global batch of a module's search: its example batch's size, which `global_batch`
    must equal where given."""
    batch = batches.batch_size(example)
    if global_batch is not None and global_batch != batch:
        what = f"factory {model!r} gives" if source is not None else "example_inputs give"
        raise ValueError(f"{what} batches of {batch}; search it with --global-batch {batch}")
    return batch


def _module_tracer(module: nn.Module, example: Sequence[Any], loss_fn: Callable[..., torch.Tensor] | None,
                   policy: Any, compiled: bool) -> Callable[..., Any]:
    """`trace_at(rows, recompute)` of the search for a module: the first `rows` rows of its
    batch traced whole, on a copy."""
    size = batches.batch_size(example)

    def trace_at(rows: int, recompute: str = "none") -> Any:
        micro = batches.rows(example, 0, rows, size)
        graph = trace_step(copy.deepcopy(module), micro, loss_fn=loss_fn, recompute=recompute, precision=policy)[1]
        return replace(graph, compiled=compiled)

    return trace_at


def _fingerprint(model: Any, seq: int | None, source: Any, zoo: bool) -> str:
    """The model's fingerprint, recorded in its plans (a zoo model's kept in _ZOO_FINGERPRINTS)."""
    if zoo:
        if (model, seq) not in _ZOO_FINGERPRINTS:
            _ZOO_FINGERPRINTS[(model, seq)] = fingerprint_source(source)
        return _ZOO_FINGERPRINTS[(model, seq)]
    return fingerprint_source(source) if source is not None else module_fingerprint(model)


UNLIMITED_MEMORY_GB = 1e9
"""The memory limit a configuration that fits no plan is re-solved under (then flagged)."""


def price(model: str, mesh: MeshLike, config: ParallelConfig, *, global_batch: int, seq: int | None = None,
          choose_zero: bool = False, stage_layers: tuple[int, ...] | None = None) -> Any:
    """One configuration priced as the search prices it (`autopar price`): the search
    restricted to `config` (solver.search_config.Fixed), its Plan returned, with the
    prediction in `plan.predicted`. `model` is a zoo or factory name. The per-op
    placements are the ILP's; `choose_zero`: each parameter's (one stage) or each stage's
    ZeRO layout is chosen as in a search rather than fixed by `config.zero`;
    `stage_layers`: the pipeline's cuts (default: the stage DP's). A configuration that
    fits no plan in the memory limit is solved without it and flagged (`fits` false)."""
    return price_result(model, mesh, config, global_batch=global_batch, seq=seq, choose_zero=choose_zero,
                        stage_layers=stage_layers).plan


def price_result(model: str, mesh: MeshLike, config: ParallelConfig, *, global_batch: int, seq: int | None = None,
                 choose_zero: bool = False, stage_layers: tuple[int, ...] | None = None) -> Any:
    """`price`'s whole SearchResult (its `plan` as `price` returns it): with the plan's
    communication per step by collective kind (`SearchResult.communication`)."""
    from solver.search_config import Fixed  # lazy: the API imports the solver only inside functions

    cluster = _cluster_of(mesh)
    fixed = Fixed(config=config, zero_given=not choose_zero, stage_layers=stage_layers)
    try:
        result = search_plans(model, cluster, global_batch=global_batch, seq=seq, top=1, fixed=fixed)
    except InfeasiblePlanError:
        try:
            result = search_plans(model, cluster.with_memory_gb(UNLIMITED_MEMORY_GB), global_batch=global_batch,
                                  seq=seq, top=1, fixed=fixed)
        except InfeasiblePlanError as exc:
            chunks = f"{config.pp} stages x {config.interleave} chunks" if config.interleave > 1 \
                else f"{config.pp} stages"
            why = str(exc) if config.pp == 1 else (
                f"check that its layers cut into {chunks} of whole layers (every stage a multiple of the "
                "interleave), and that the runtime runs such a pipeline (`autopar search` lists what it cannot run)")
            raise ValueError(f"{model} has no plan under {config} on {cluster.spec} even without a memory limit: "
                             f"{why}") from None
    plan = result.plan
    budget = cluster.device_memory_bytes
    est = replace(plan.predicted, fits=plan.predicted.peak_memory_bytes <= budget, memory_limit_bytes=int(budget))
    return replace(result, plan=replace(plan, predicted=est, memory_limit_bytes=int(budget), cluster=cluster.spec))


MAX_STAGE_TRACE_PARAMETERS = 5e8
"""Largest zoo model whose pipeline chunks the search traces with real weights (2 GB in
float32) to record their per-op placements; a larger one's plan carries none, and they are
solved for its configuration before its ranks build (autopar/placing.py; `explain` says so)."""


def record_stage_placements(plan: Plan, model: nn.Module | None = None, example_inputs: Sequence[Any] | None = None,
                            *, loss_fn: Callable[..., torch.Tensor] | None = None) -> Plan:
    """`plan` (pp > 1) with every chunk's per-op placements (`Plan.placements`), the
    program its stages run: the chunks traced in this process exactly as each rank traces
    its own at build, each solved by the stage ILP under the plan's configuration, on the
    plan's cluster (autopar/placing.py `solve_stage_placements`). `autopar search` calls it
    for the pipeline it returns; call it to record them in an older plan.

    `model` (left whole: a copy is cut) with `example_inputs` (one global batch), else the
    plan's model is built from its name with real weights (the cut runs one forward); a
    zoo model over MAX_STAGE_TRACE_PARAMETERS is left unrecorded (solved before each run)."""
    from autopar.placing import solve_stage_placements  # lazy: wires the build and solver, off `import autopar`

    config = plan.config
    if config.pp == 1:
        raise ValueError("record_stage_placements is for pipeline plans (pp > 1); the one-stage search records "
                         "a one-stage plan's per-op placements itself")
    if model is None:
        source = resolve(plan.model)
        if source.config is None:
            model, example_inputs = source.factory()
        else:
            source = source.with_overrides(seq=plan.seq)
            with FakeTensorMode():
                size = sum(p.numel() for p in source.build().parameters())
            if size > MAX_STAGE_TRACE_PARAMETERS:
                log.info("%s: %.2gB parameters, over %.2gB: its plan's chunks are solved before each run", plan.model,
                         size / 1e9, MAX_STAGE_TRACE_PARAMETERS / 1e9)
                return plan
            torch.manual_seed(0)
            model, example_inputs = source.build(), source.example_inputs(plan.global_batch)
    elif example_inputs is None:
        raise ValueError("record_stage_placements(plan, model) needs example_inputs= (one global batch)")
    else:
        model = copy.deepcopy(model)
    rows = config.dp * config.micro_batch
    num_microbatches = plan.global_batch // rows
    cluster = Cluster.parse(plan.cluster)
    try:  # the chunks as every rank cuts and traces them at build (given the plan's stage_layers)
        recorded = solve_stage_placements(model, config, example_inputs, cluster=cluster,
                                          num_microbatches=num_microbatches, stage_layers=plan.stage_layers,
                                          loss_fn=loss_fn)
    except InfeasiblePlanError as exc:  # a chunk's stage ILP: the build's placements are solved where it runs
        log.warning("%s: the chunks' placements were not recorded (%s); they are solved before each build",
                    plan.model, exc)
        return plan
    except ValueError as exc:  # the cut: the build refuses it the same way; the plan is still the search's answer
        log.warning("%s: the plan's pipeline chunks were not traced (%s); they are solved before each build",
                    plan.model, exc)
        return plan
    return replace(plan, placements=recorded)


def search_plan(model: nn.Module, mesh: MeshLike, *, example_inputs: Sequence[Any],
                loss_fn: Callable[..., torch.Tensor] | None = None, precision: str = "",
                compiled: bool = False) -> Plan:
    """Trace `model` on its example inputs (one global batch), search the whole plan for
    `mesh` (`search_plans`, under the precision policy `precision`, compiled by Inductor
    where `compiled`) and return the best Plan. Deterministic (no time limit)."""
    return search_plans(model, mesh, example_inputs=example_inputs, loss_fn=loss_fn, top=1, precision=precision,
                        compiled=compiled).plan


def _search_on_rank0(model: nn.Module, mesh: MeshLike, *, example_inputs: Sequence[Any],
                     loss_fn: Callable[..., torch.Tensor] | None, precision: str = "", compiled: bool = False) -> Plan:
    """Rank 0 searches; every rank gets the plan (as its JSON text, never a pickle)."""
    text = None
    if dist.get_rank() == 0:
        text = search_plan(model, mesh, example_inputs=example_inputs, loss_fn=loss_fn, precision=precision,
                           compiled=compiled).dumps()
    return Plan.loads(gather_build_results(text)[0])  # the others wait out the search, however long


def rank0_placements(model: nn.Module, config: ParallelConfig, example: Sequence[Any], *, plan: Plan | None = None,
                     loss_fn: Callable[..., torch.Tensor] | None = None, cluster: Cluster | None = None,
                     stage_layers: Sequence[int] | None = None) -> ProgramPlacements:
    """What every rank builds from (autopar/placing.py), for callers already inside the
    ranks (`autopar.compile`, the benchmarks' workers); collective. A plan's recorded
    placements are read on every rank; else rank 0 traces and solves the configuration (in
    a forked child, which gives the trace's and the solver's memory back) and every rank receives
    the placements as JSON text (or the error, which every rank raises). No rank but rank 0
    enters the solver; `autopar train` decides them before its ranks start instead.
    `stage_layers`: a pipeline's layers per stage or chunk (default the plan's, else even)."""
    from autopar.placing import program_placements  # lazy: wires the build and solver, off `import autopar`

    device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"  # init_mesh's
    if plan is not None and plan.records_program_for(config):
        return program_placements(model, config, example, plan=plan, loss_fn=loss_fn, cluster=cluster,
                                  device_type=device_type)
    mine: Any = None
    if dist.get_rank() == 0:
        try:
            mine = program_placements(model, config, example, plan=plan, loss_fn=loss_fn, cluster=cluster,
                                      stage_layers=stage_layers, device_type=device_type,
                                      in_child=True).dumps()
        except ValueError as exc:  # InfeasiblePlanError, TraceError, a cut refused: every rank raises it
            mine = exc
    got = gather_build_results(mine)[0]  # the other ranks wait out the solve, however long
    if isinstance(got, Exception):
        raise got
    return ProgramPlacements.loads(got)


class Compiled:
    """A model compiled for this rank: `.step(batch)`, `.plan`, `.config`, `.code`, state dicts.

    Without example inputs a one-stage program is compiled at the first `step` (the
    traced step needs a batch's shapes)."""

    def __init__(self, build: Callable[[Sequence[Any]], Any], *, config: ParallelConfig, plan: Plan | None,
                 example_inputs: tuple[Any, ...] | None) -> None:
        self._build: Callable[[Sequence[Any]], Any] | None = build
        self.plan: Plan | None = plan
        """The Plan replayed or searched, else None (a configuration given by config=)."""
        self.config: ParallelConfig = config
        self._example_inputs = example_inputs
        self._program: Any = self._make(example_inputs) if example_inputs is not None else None
        self._code: dict[str, str] | None = None

    def _make(self, example: Sequence[Any]) -> Any:
        """The program, built once. The build closure is dropped with it: it holds the
        user's unsharded model, which the program never reads again (it holds its own
        shards), so the full weights are freed as soon as the caller drops the model, as
        a model parallelised in place would be."""
        assert self._build is not None, "a Compiled program is built once"
        program = self._build(example)  # a failed build (a bad first batch) may be retried
        self._build = None
        return program

    @property
    def program(self) -> Any:
        if self._program is None:
            raise ValueError("this model is compiled at its first step (no example_inputs were given); "
                             "call .step(batch) first, or pass example_inputs= to autopar.compile")
        return self._program

    def step(self, batch: Any = (), **keywords: Any) -> float:
        """One optimizer step on the global batch (a tensor, a dict, a tuple of inputs; keyword
        inputs as keywords); returns the global mean loss (every rank)."""
        batch = (batch,) if isinstance(batch, (torch.Tensor, dict)) else tuple(batch)
        batch = batches.join(*batches.split(batch)) if not keywords else batches.join(batch, keywords)
        if self._program is None:
            self._program = self._make(batch)
        return self._program.step(batch)

    @property
    def code(self) -> dict[str, str]:
        """Source of this rank's program as it runs (ATen ops and collectives on local
        shards, codegen/apply.py): for a one-stage plan the per-rank step, for a pipeline
        the forward/backward graphs of each of this rank's chunks (`stage<k>`)."""
        if self._code is None:
            program = self.program
            # a pipeline: this rank's chunks, by chunk; one stage: its step
            self._code = dict(program.sources) if hasattr(program, "sources") else {"stage0": program.code}
        return self._code

    def state_dict(self) -> dict[str, Any]:
        return self.program.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.program.load_state_dict(state)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self.program.full_parameters()

    def save_checkpoint(self, directory: str, *, step: int | None = None) -> str:
        """Write a sharded, plan-independent checkpoint (autopar/runtime/checkpoint.py) under
        `directory`; collective. `step` defaults to the steps done so far. Unlike
        `state_dict()` (this plan's layout, GPT qkv rows in TP order), it loads under any plan."""
        from autopar.runtime import checkpoint  # lazy: loads torch.distributed.tensor, off `import autopar`

        done = self.program.steps_done if step is None else step
        return str(checkpoint.save(self.program, directory, step=done))

    def load_checkpoint(self, path: str) -> Any:
        """Load the newest complete checkpoint under `path` (or that `step_<N>` directory),
        resharding it to this plan; collective. Returns its `CheckpointInfo`."""
        from autopar.runtime import checkpoint  # lazy: loads torch.distributed.tensor, off `import autopar`

        return checkpoint.load(self.program, path)


def _compile_module(model: nn.Module, mesh: MeshLike, *, example_inputs: Sequence[Any] | None,
                    loss_fn: Callable[..., torch.Tensor] | None, optimizer: OptimizerFactory | None,
                    plan: Plan | None, config: ParallelConfig | None, compiled: bool = False,
                    precision: str = "") -> Compiled:
    from autopar.build import build_program  # lazy: loads torch.distributed.tensor, off `import autopar`
    from autopar.runtime.program import model_dims  # lazy: loads torch.distributed.tensor, off `import autopar`

    num_devices = _num_devices(mesh)
    _ensure_process_group(num_devices)
    if plan is not None and config is not None:
        raise ValueError("pass plan= or config=, not both (a plan carries its config)")
    if plan is not None:
        plan.check_model(module_fingerprint(model))
        config = plan.config
    if plan is None and config is None:
        if example_inputs is None:
            raise ValueError("autopar.compile needs example_inputs= (one global batch) to search a plan, "
                             "or plan= / config= to run one without searching")
        plan = _search_on_rank0(model, mesh, example_inputs=example_inputs, loss_fn=loss_fn, precision=precision,
                                compiled=compiled)
        config = plan.config
    if example_inputs is not None:
        config.check(global_batch=batches.batch_size(example_inputs), num_devices=num_devices,
                     **model_dims(model, config))
    device_mesh = mesh if isinstance(mesh, DeviceMesh) and mesh.mesh_dim_names == ("pp", "dp", "tp") else None
    cluster = _cluster_of(mesh)

    def build(example: Sequence[Any]) -> Any:
        placed = rank0_placements(model, config, example, plan=plan, loss_fn=loss_fn, cluster=cluster)
        return build_program(model, placed, example_inputs=example, loss_fn=loss_fn, optimizer=optimizer,
                             mesh=device_mesh)

    return Compiled(build, config=config, plan=plan,
                    example_inputs=tuple(example_inputs) if example_inputs is not None else None)


def compile(model: nn.Module | type | Callable[..., Any] | None = None, mesh: MeshLike | None = None, *,
            example_inputs: Sequence[Any] | None = None, loss_fn: Callable[..., torch.Tensor] | None = None,
            optimizer: OptimizerFactory | None = None, plan: Plan | None = None, config: ParallelConfig | None = None,
            compiled: bool = False, example_kwargs: dict[str, Any] | None = None,
            precision: str = "") -> Any:
    """Compile `model` for `mesh` on this rank, or decorate a module class / factory.

    - `compile(module, "cpu:4", example_inputs=(tokens, labels))` -> Compiled
    - `@compile(mesh="cpu:4")` on an nn.Module class: calling the class returns a Compiled;
      on a factory returning a module or `(module, example_inputs)`: likewise.
    `loss_fn(output, target)` applies when the model returns outputs rather than the loss
    (the last element of a batch is the target). `optimizer` is a factory over parameters,
    e.g. `functools.partial(torch.optim.AdamW, lr=3e-4)` (AdamW lr 1e-3 by default).
    Inputs may be pytrees of tensors (a dict batch: `example_inputs=({"input_ids": ...},)`);
    `example_kwargs` are keyword inputs (a forward with keyword-only arguments), and
    `Compiled.step(batch, **keywords)` takes them likewise (autopar/batch.py).
    `precision` names the precision policy a searched plan is priced and run under
    (autopar/precision.py: "fp32", "bf16-mixed", "bf16"; default the hardware's: fp32 on
    CPU, bf16-mixed on accelerators); a `plan` or `config` carries its own. `compiled=True`
    runs the per-rank graphs through Inductor (codegen/inductor.py) and searches the plan
    priced so; a `plan` or `config` carries its own (`ParallelConfig(compiled=True)`).
    """
    if example_kwargs:
        example_inputs = batches.join(example_inputs if example_inputs is not None else (), example_kwargs)
    if precision and (plan is not None or config is not None):
        raise ValueError(f"precision={precision!r} with plan= or config=: they carry their own precision policy "
                         "(config=ParallelConfig(..., precision=...))")
    if compiled and (plan is not None or config is not None):
        raise ValueError("compiled=True with plan= or config=: they say themselves whether the program is compiled "
                         "(config=ParallelConfig(..., compiled=True); a plan searched with compiled=True)")
    options = dict(example_inputs=example_inputs, loss_fn=loss_fn, optimizer=optimizer, plan=plan,
                   config=config, compiled=compiled, precision=precision)
    if isinstance(model, nn.Module):
        if mesh is None:
            raise ValueError("autopar.compile(model, mesh): give a mesh ('cpu:4', a Cluster, a DeviceMesh or an int)")
        return _compile_module(model, mesh, **options)
    if mesh is None:
        raise ValueError("@autopar.compile needs mesh=..., e.g. @autopar.compile(mesh='cpu:4')")

    def decorate(target: type | Callable[..., Any]) -> Callable[..., Compiled]:
        @functools.wraps(target)
        def build(*args: Any, **kwargs: Any) -> Compiled:
            made = target(*args, **kwargs)
            inputs = options["example_inputs"]
            if isinstance(made, tuple):
                made, given = batches.from_factory(made, repr(getattr(target, "__name__", target)))
                inputs = given if inputs is None else inputs
            if not isinstance(made, nn.Module):
                raise ValueError(f"{getattr(target, '__name__', target)!r} returned {type(made).__name__}; "
                                 "a decorated factory must return an nn.Module or (module, example_inputs)")
            return _compile_module(made, mesh, **{**options, "example_inputs": inputs})

        return build

    return decorate if model is None else decorate(model)
