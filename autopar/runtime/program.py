"""Run one parallel configuration on torch.distributed: what every per-rank program shares.

Where it sits: the last stage of the flow (DESIGN.md). The per-rank build
(autopar/build/ `build_program`, on every rank of an initialised process group: torchrun
or autopar's spawner, autopar/runtime/launch.py) returns the rank's program, whose
`step(batch)` trains once:
- pp = 1: the per-op program (autopar/runtime/spmd.py): the per-rank graphs of the
  traced training step with its per-op placements applied;
- pp > 1: the model cut at its repeated layers, every stage a per-op program on its
  (dp, tp) submesh, run by torch.distributed.pipelining's schedules
  (autopar/runtime/pipe_spmd.py).
Beside it, what both programs share: the ("pp", "dp", "tp") mesh with the job's collective
timeout (`make_mesh`, `init_mesh`), the end of every step (`optimizer_update`: a non-finite
loss stops training), the measured `StepStats`, and the sharded state dict of a program's
chunks (`chunks_state_dict`, `load_chunks_state_dict`). No per-family rule table is read
here: the module-level template program (pipeline stages cut by rule tables, Megatron TP
by `parallelize_module`) is a baseline in benchmarks/baselines/template_program.py.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from autopar.capabilities import zoo_family
from autopar.config import ParallelConfig

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
DEFAULT_LR = 1e-3


def default_optimizer() -> OptimizerFactory:
    return functools.partial(torch.optim.AdamW, lr=DEFAULT_LR)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepStats:
    """What one rank measured; bytes are this rank's local (sharded) tensors."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    peak_rss_bytes: int


def model_dims(model: nn.Module, config: ParallelConfig | None = None) -> dict[str, int]:
    """Heads, key/value heads and layers of a zoo model (0 where unknown), for config.check.

    Every program is per-op (one stage, or pipeline stages each compiled by the per-op
    path: autopar/runtime/pipe_spmd.py), which splits any op the ILP can shard, so no head count
    constrains tp (0 here); a pipeline still needs as many layers as chunks."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or not zoo_family(model) or (config is not None and config.pp == 1):
        return {"heads": 0, "kv_heads": 0, "num_layers": 0}
    return {"heads": 0, "kv_heads": 0, "num_layers": cfg.layers}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `t`, sharing its storage. Not `DTensor.to_local()`: that goes
    through an autograd Function (~50 us a call), and the step calls this per parameter,
    gradient and optimizer state (a few percent of a small model's step on CPU)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def gradient_for(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's gradient shard) as the `.grad` of the DTensor `param`: a DTensor
    sharing the parameter's spec where the shard has the parameter's local shape and dtype
    (the usual case; laid out in the parameter's strides first where it is not), else
    `DTensor.from_local`. The spec is the parameter's own (same
    mesh, placements, global shape and stride); `from_local` rebuilds it through an autograd
    Function, ~14 us a call against ~2 us (torch 2.13 on a 2-core CPU), paid per
    parameter every step: the step's epilogue `autopar calibrate` times per parameter
    tensor (`optimizer_tensor_overhead_s`)."""
    if not isinstance(param, DTensor):
        return local
    mine = param._local_tensor
    if local.shape == mine.shape and local.dtype == mine.dtype and local.stride() != mine.stride():
        # laid out as the shard: a step graph can leave a gradient transposed (the weight
        # gradient of a transposed view: a Mixtral's experts under tp 2 with several
        # microbatches), and AdamW then updated those shards wrongly (all expert weights off
        # by up to 2 lr after one step; where in the update is not isolated: a bare AdamW
        # step on such a DTensor gradient is right). One copy into the shard's layout.
        local = torch.empty_strided(mine.shape, mine.stride(), dtype=mine.dtype, device=mine.device).copy_(local)
    if local.shape == mine.shape and local.dtype == mine.dtype and local.stride() == mine.stride() \
            and not local.requires_grad:
        return DTensor(local, param._spec, requires_grad=False)
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


class NonFiniteLossError(ValueError):
    """The global loss of a step is NaN or infinite: training stops instead of applying it."""

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(
            f"loss is {loss} at step {step}; the optimizer step was not applied and training stopped. "
            "Lower the learning rate (--lr), check the data and the loss for NaN/inf, or resume from "
            "the last checkpoint with a smaller learning rate")
        self.step = step
        self.loss = loss


def optimizer_update(program: Any, loss: float) -> None:
    """The end of every program's step: refuse a non-finite loss (same value on every rank,
    so all stop together), else step the optimizer, clear the gradients, count the step."""
    if not math.isfinite(loss):
        program.optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLossError(program.steps_done + 1, loss)
    program.optimizer.step()
    program.optimizer.zero_grad(set_to_none=True)
    program.steps_done += 1


def chunks_state_dict(chunks: Sequence[nn.Module], optimizer: Any) -> dict[str, Any]:
    """Sharded model and optimizer state of a program's chunks (DTensor values stay sharded,
    names as in the unsplit model), in the form `torch.distributed.checkpoint.save` takes."""
    from torch.distributed.checkpoint.state_dict import (  # lazy: torch.distributed.checkpoint, only to save or load
        get_model_state_dict, get_optimizer_state_dict)

    model_state: dict[str, Any] = {}
    for chunk in chunks:
        model_state.update(get_model_state_dict(chunk))
    if hasattr(optimizer, "consolidate_state_dict"):
        raise ValueError("state_dict() with --zero 1 (ZeroRedundancyOptimizer) is not supported; use --zero 2")
    container = nn.ModuleList(chunks) if len(chunks) > 1 else chunks[0]
    return {"model": model_state, "optimizer": get_optimizer_state_dict(container, optimizer)}


def load_chunks_state_dict(chunks: Sequence[nn.Module], optimizer: Any, state: dict[str, Any]) -> None:
    """Fill a program's chunks and optimizer from `chunks_state_dict`'s form."""
    from torch.distributed.checkpoint.state_dict import (  # lazy: torch.distributed.checkpoint, only to save or load
        set_model_state_dict, set_optimizer_state_dict)

    for chunk in chunks:
        names = {n for n, _ in chunk.state_dict().items()}
        set_model_state_dict(chunk, {k: v for k, v in state["model"].items() if k in names})
    container = nn.ModuleList(chunks) if len(chunks) > 1 else chunks[0]
    set_optimizer_state_dict(container, optimizer, state["optimizer"])


def make_mesh(config: ParallelConfig, device_type: str | None = None) -> DeviceMesh:
    world = dist.get_world_size()
    if config.num_devices != world:
        raise ValueError(
            f"dp * tp * pp = {config.dp} * {config.tp} * {config.pp} = {config.num_devices} but the "
            f"process group has {world} ranks; choose degrees whose product is {world}"
        )
    return init_mesh((config.pp, config.dp, config.tp), ("pp", "dp", "tp"), device_type)


def init_mesh(shape: tuple[int, ...], names: tuple[str, ...], device_type: str | None = None) -> DeviceMesh:
    """A device mesh over the whole world whose gloo groups keep the job's collective
    timeout (init_device_mesh's subgroups would otherwise get gloo's 30-minute default)."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu")
    override = None
    timeout = default_group_timeout()
    if timeout is not None:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        override = {axis: ("gloo", options) for axis in names}
    return init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override)


def default_group_timeout() -> Any:
    """The default gloo group's collective timeout, for the subgroups made from it.

    torch gives `new_group`/DeviceMesh subgroups the 30-minute library default, not the
    world's timeout: a hung rank would stall its dp/tp/pp peers for 30 minutes. None when
    the world is not gloo (NCCL has its own watchdog)."""
    if dist.get_backend() != "gloo":
        return None
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return backend.options._timeout


