"""`autopar.compile`: turn a model and a mesh into a parallel training step on this rank.

Where it sits: with autopar/cli.py, the only place that wires stages together. It
resolves the mesh to a world size, joins or checks the process group (torchrun's env://
world, ranks started by `autopar.runtime_launch.spawn`, or a one-rank world it creates),
takes the configuration from `plan=` (replayed after a fingerprint check), `config=`, or
else searches one (trace on the example inputs, price with the cost model, solver/search.py),
and builds the per-rank program (autopar/runtime.py).

Batches: `step(batch)` takes the *global* batch, identical on every rank (as synthetic
data or a seeded loader gives it); each rank takes its data-parallel slice. Weight init:
build the model under the same `torch.manual_seed` on every rank before compiling.
"""

from __future__ import annotations

import datetime
import functools
import logging
import tempfile
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.runtime import OptimizerFactory, RankProgram, build_program, model_dims
from autopar.runtime_launch import init_from_env, launched_by_torchrun

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
        else:
            raise ValueError(
                f"autopar.compile for {num_devices} devices needs a process group: run under "
                f"`torchrun --nproc_per_node {num_devices}`, or inside ranks started by "
                "autopar.runtime_launch.spawn (or `autopar train --devices N`)"
            )
    world = dist.get_world_size()
    if world != num_devices:
        raise ValueError(f"the mesh has {num_devices} devices but the process group has {world} ranks; "
                         "make them equal")


def _check_fingerprint(plan: Any, model: nn.Module) -> None:
    expected = getattr(plan, "model_fingerprint", None)
    if not expected:
        return
    try:
        from autopar.plan import model_fingerprint
    except ImportError:
        log.warning("autopar.plan.model_fingerprint unavailable: plan fingerprint not checked")
        return
    actual = model_fingerprint(tuple((n, tuple(p.shape)) for n, p in model.named_parameters()))
    if actual != expected:
        raise ValueError(
            f"the plan was made for another model (fingerprint {str(expected)[:12]}..., this model "
            f"{str(actual)[:12]}...); search a plan for this model or pass config= instead"
        )


def _cluster_of(mesh: MeshLike) -> Cluster:
    if isinstance(mesh, Cluster):
        return mesh
    if isinstance(mesh, str):
        return Cluster.parse(mesh)
    device = mesh.device_type if isinstance(mesh, DeviceMesh) else "cpu"
    hardware = "cpu" if device == "cpu" else "h100"  # a real GPU mesh without a profile: assume H100
    return Cluster.parse(f"{hardware}:1x{_num_devices(mesh)}")


def search_plan(model: nn.Module, mesh: MeshLike, *, example_inputs: Sequence[Any],
                loss_fn: Callable[..., torch.Tensor] | None = None) -> Any:
    """Trace `model` on its example inputs, search the whole plan for `mesh`, return the Plan.

    Deterministic (no time limit), so every rank that calls it gets the same plan. Models
    the runtime cannot split by tensor (unknown structure) or pipeline (no layer list) are
    searched over the knobs the runtime can execute for them."""
    import copy

    import cost_model
    from autopar.plan import model_fingerprint
    from autopar.trace import lower, trace
    from codegen.rules import rules_for
    from solver.search import SearchSpace, search

    cluster = _cluster_of(mesh)
    traced = trace(copy.deepcopy(model), tuple(example_inputs), loss_fn=loss_fn)
    first = example_inputs[0]
    graph = lower(traced, name=type(model).__name__, batch=int(first.shape[0]),
                  seq=int(first.shape[1]) if first.dim() > 1 else 1, config=getattr(model, "cfg", None))
    known = rules_for(model) is not None
    space = SearchSpace(max_tp=None if known else 1, max_pp=None if known else 1)
    profile = cost_model.profile_graph(graph)
    global_batch = int(first.shape[0])

    def price(config: ParallelConfig, stage_layers: tuple[int, ...]) -> Any:
        return cost_model.price_profile(profile, config, cluster, global_batch=global_batch, stage_layers=stage_layers)

    fingerprint = model_fingerprint(tuple((n, tuple(p.shape)) for n, p in model.named_parameters()))
    result = search(graph, cluster, global_batch=global_batch, price=price, model=type(model).__name__,
                    fingerprint=fingerprint, cost_model_name="cost_model.price_profile", space=space, top=1)
    log.info("searched plan: %s", result.plan.config)
    return result.plan


class Compiled:
    """A model compiled for this rank: `.step(batch)`, `.plan`, `.config`, `.code`, state dicts."""

    def __init__(self, program: RankProgram, *, plan: Any, pristine: nn.Module,
                 example_inputs: tuple[Any, ...] | None) -> None:
        self.program = program
        self.plan = plan
        """The Plan replayed (when `plan=` was given), else None; `.config` is always set."""
        self.config: ParallelConfig = program.config
        self._pristine = pristine
        self._example_inputs = example_inputs
        self._code: dict[str, str] | None = None

    def step(self, batch: torch.Tensor | Sequence[torch.Tensor]) -> float:
        """One optimizer step on the global batch; returns the global mean loss (every rank)."""
        return self.program.step((batch,) if isinstance(batch, torch.Tensor) else tuple(batch))

    @property
    def code(self) -> dict[str, str]:
        """Readable source of this rank's stage program(s) (codegen.emit), traced locally with
        fake tensors on this rank's mesh: no communication, no collective call needed."""
        if self._code is None:
            from codegen.emit import emit

            if self._example_inputs is None:
                raise ValueError("compiled.code needs example_inputs= at compile time (a global batch)")
            self._code = emit(self._pristine, self.config, example_inputs=self._example_inputs,
                              mesh=self.program.mesh, stage_layers=getattr(self.plan, "stage_layers", None))
        return self._code

    def state_dict(self) -> dict[str, Any]:
        return self.program.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.program.load_state_dict(state)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self.program.full_parameters()

    def save_checkpoint(self, directory: str, *, step: int | None = None) -> str:
        """Write a sharded, plan-independent checkpoint (autopar/checkpoint.py) under
        `directory`; collective. `step` defaults to the steps done so far. Unlike
        `state_dict()` (this plan's layout, GPT qkv rows in TP order), it loads under any plan."""
        from autopar import checkpoint

        done = self.program.steps_done if step is None else step
        return str(checkpoint.save(self.program, directory, step=done))

    def load_checkpoint(self, path: str) -> Any:
        """Load the newest complete checkpoint under `path` (or that `step_<N>` directory),
        resharding it to this plan; collective. Returns its `CheckpointInfo`."""
        from autopar import checkpoint

        return checkpoint.load(self.program, path)


def _compile_module(model: nn.Module, mesh: MeshLike, *, example_inputs: Sequence[Any] | None,
                    loss_fn: Callable[..., torch.Tensor] | None, optimizer: OptimizerFactory | None,
                    plan: Any, config: ParallelConfig | None, compile_stages: bool | None) -> Compiled:
    import copy

    num_devices = _num_devices(mesh)
    _ensure_process_group(num_devices)
    if plan is not None and config is not None:
        raise ValueError("pass plan= or config=, not both (a plan carries its config)")
    if plan is not None:
        _check_fingerprint(plan, model)
        config = plan.config
    if plan is None and config is None:
        if example_inputs is None:
            raise ValueError("autopar.compile needs example_inputs= (one global batch) to search a plan, "
                             "or plan= / config= to run one without searching")
        plan = search_plan(model, mesh, example_inputs=example_inputs, loss_fn=loss_fn)
        config = plan.config
    if example_inputs is not None:
        config.check(global_batch=int(example_inputs[0].shape[0]), num_devices=num_devices, **model_dims(model))
    pristine = copy.deepcopy(model)  # codegen.emit traces an unsharded copy
    device_mesh = mesh if isinstance(mesh, DeviceMesh) and mesh.mesh_dim_names == ("pp", "dp", "tp") else None
    program = build_program(model, config, loss_fn=loss_fn, optimizer=optimizer, compile_stages=compile_stages,
                            stage_layers=tuple(plan.stage_layers) if getattr(plan, "stage_layers", None) else None,
                            mesh=device_mesh)
    return Compiled(program, plan=plan, pristine=pristine,
                    example_inputs=tuple(example_inputs) if example_inputs is not None else None)


def compile(model: nn.Module | type | Callable[..., Any] | None = None, mesh: MeshLike | None = None, *,
            example_inputs: Sequence[Any] | None = None, loss_fn: Callable[..., torch.Tensor] | None = None,
            optimizer: OptimizerFactory | None = None, plan: Any = None, config: ParallelConfig | None = None,
            compile_stages: bool | None = None) -> Any:
    """Compile `model` for `mesh` on this rank, or decorate a module class / factory.

    - `compile(module, "cpu:4", example_inputs=(tokens, labels))` -> Compiled
    - `@compile(mesh="cpu:4")` on an nn.Module class: calling the class returns a Compiled;
      on a factory returning a module or `(module, example_inputs)`: likewise.
    `loss_fn(output, target)` applies when the model returns outputs rather than the loss
    (the last element of a batch is the target). `optimizer` is a factory over parameters,
    e.g. `functools.partial(torch.optim.AdamW, lr=3e-4)` (AdamW lr 1e-3 by default).
    """
    options = dict(example_inputs=example_inputs, loss_fn=loss_fn, optimizer=optimizer, plan=plan,
                   config=config, compile_stages=compile_stages)
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
                made, inputs = made[0], (made[1] if inputs is None else inputs)
            if not isinstance(made, nn.Module):
                raise ValueError(f"{getattr(target, '__name__', target)!r} returned {type(made).__name__}; "
                                 "a decorated factory must return an nn.Module or (module, example_inputs)")
            return _compile_module(made, mesh, **{**options, "example_inputs": inputs})

        return build

    return decorate if model is None else decorate(model)
