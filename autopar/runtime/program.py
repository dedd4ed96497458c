"""Run one parallel configuration on torch.distributed: the per-rank training program.

Where it sits: the last stage of the flow (DESIGN.md). `build_program(model, config, ...)`
runs on every rank of an initialised process group (torchrun or autopar's spawner, see
autopar/runtime/launch.py) and returns a `RankProgram` whose `step(batch)` trains once.

How each knob is realised (all with torch.distributed's own pieces):
- mesh: `init_device_mesh` with axes ("pp", "dp", "tp"), tp innermost (fastest links).
- pp: the model is cut into pp * interleave chunks (codegen/stages.py); rank r on the pp
  axis owns chunks r, r + pp, ... and runs them with `torch.distributed.pipelining`
  (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble for
  `zb`). The schedule splits the local
  batch into microbatches and scales gradients by 1/num_microbatches.
- tp: codegen/tp.py (DTensor, `parallelize_module`), optional sequence parallelism.
- dp and ZeRO, over the "dp" axis:
  zero 0: gradients all-reduced (one flat bucket per step) after the last microbatch;
  zero 1: the same all-reduce, then `ZeroRedundancyOptimizer`: each dp rank keeps the
          optimizer state of its parameter partition, steps it and broadcasts the result;
  zero 2: FSDP2 `fully_shard(reshard_after_forward=False)`: gradients reduce-scattered,
          optimizer state sharded; parameters are sharded at rest and gathered once per
          step (kept from forward through backward, no regather: ZeRO-2's traffic);
  zero 3: FSDP2 `fully_shard(reshard_after_forward=True)`: parameters also freed after
          forward and regathered in backward.
- gradient accumulation without pp: a loop over microbatches, each loss scaled by 1/M;
  FSDP's gradient sync is switched off for all but the last microbatch.
- tied embeddings with pp > 1: the first and last chunks hold separate copies of the tied
  weight (same init); their gradients are summed over a (first, last) process group
  before the optimizer, so both copies stay equal (Megatron's embedding group).
- fusion: with `compile_stages`, each layer goes through `torch.compile` (inductor); with
  `fused_kernels`, norms and MLP activations are the fused ops of codegen/kernels.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import resource
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from autopar.config import ParallelConfig
from codegen.rules import FamilyRules, permutation_for, rules_for
from codegen.stages import build_chunks
from codegen.tp import apply_tp, check_tp

log = logging.getLogger(__name__)

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
    if cfg is None or rules_for(model) is None or (config is not None and config.pp == 1):
        return {"heads": 0, "kv_heads": 0, "num_layers": 0}
    return {"heads": 0, "kv_heads": 0, "num_layers": cfg.layers}


def _split_optimizer(factory: OptimizerFactory) -> tuple[type, dict[str, Any]]:
    if isinstance(factory, functools.partial) and isinstance(factory.func, type) and not factory.args:
        return factory.func, dict(factory.keywords)
    if isinstance(factory, type):
        return factory, {}
    raise ValueError(
        f"--zero 1 needs the optimizer as a class or functools.partial(torch.optim.X, **kwargs), got "
        f"{factory!r}; pass functools.partial(torch.optim.AdamW, lr=...) or use --zero 2"
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `t`, sharing its storage. Not `DTensor.to_local()`: that goes
    through an autograd Function (~50 us a call), and the step calls this per parameter,
    gradient and optimizer state (a few percent of a small model's step on CPU)."""
    return t._local_tensor if isinstance(t, DTensor) else t


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


class RankProgram:
    """One rank's share of the parallel training step. Build with `build_program`."""

    def __init__(self, *, config: ParallelConfig, mesh: DeviceMesh, chunks: list[nn.Module],
                 chunk_ids: tuple[int, ...], num_chunks: int, rules: FamilyRules | None,
                 loss_fn: Callable[..., torch.Tensor] | None, optimizer: torch.optim.Optimizer,
                 tie_group: dist.ProcessGroup | None, tied_fqns: tuple[str, ...]) -> None:
        self.config = config
        self.mesh = mesh
        self.chunks = chunks
        self.chunk_ids = chunk_ids
        self.num_chunks = num_chunks
        self.rules = rules
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.tie_group = tie_group
        self.tied_fqns = tied_fqns
        self.pp_rank = mesh.get_local_rank("pp")
        self.dp_rank = mesh.get_local_rank("dp")
        self.tp_rank = mesh.get_local_rank("tp")
        self.schedule = None
        self._schedules: dict[int, Any] = {}
        self.last_stats: StepStats | None = None
        self.steps_done = 0
        """Optimizer steps applied so far (restored by autopar.runtime.checkpoint.load)."""
        if config.pp > 1:
            self.schedule = self._build_schedule()

    @property
    def has_first(self) -> bool:
        return 0 in self.chunk_ids

    @property
    def has_last(self) -> bool:
        return self.num_chunks - 1 in self.chunk_ids

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        seen: dict[int, tuple[str, nn.Parameter]] = {}
        for chunk in self.chunks:
            for name, p in chunk.named_parameters():
                seen.setdefault(id(p), (name, p))
        return list(seen.values())

    # ---- the step -------------------------------------------------------------------
    def _build_schedule(self) -> Any:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                                            ScheduleInterleavedZeroBubble)

        group = self.mesh.get_group("pp")
        device = torch.device(self.mesh.device_type)
        stages = [PipelineStage(chunk, cid, self.num_chunks, device, group=group)
                  for chunk, cid in zip(self.chunks, self.chunk_ids)]
        self._pp_losses_fn = self.rules.loss_fn
        self._stages = stages
        return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
                "zb": ScheduleInterleavedZeroBubble}[self.config.schedule]

    def _local_batch(self, batch: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        dp = self.config.dp
        size = batch[0].shape[0]
        per_step = dp * self.config.micro_batch
        if size % per_step:
            raise ValueError(
                f"batch of {size} sequences does not split into dp * micro-batch = {dp} * "
                f"{self.config.micro_batch}; use a global batch that is a multiple of {per_step}"
            )
        return tuple(t.chunk(dp, dim=0)[self.dp_rank] if isinstance(t, torch.Tensor) else t for t in batch)

    def _forward_loss(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        chunk = self.chunks[0]
        if self.rules is not None:
            return self.rules.loss_fn(chunk(inputs[0]), inputs[1])
        if self.loss_fn is not None:
            return self.loss_fn(chunk(*inputs[:-1]), inputs[-1])
        return chunk(*inputs)

    def step(self, batch: Sequence[torch.Tensor]) -> float:
        """One optimizer step on the global `batch` (identical on every rank); returns the
        mean loss over the whole global batch, on every rank."""
        local = self._local_batch(batch)
        num_mb = local[0].shape[0] // self.config.micro_batch
        if self.config.pp > 1:
            loss_sum = self._pipeline_step(local, num_mb)
        else:
            loss_sum = self._accumulate_step(local, num_mb)
        named = self.named_parameters()
        self._finalize_grads(named)
        stats_grad = sum(_local(p.grad).numel() * _local(p.grad).element_size()
                         for _, p in named if p.grad is not None)
        loss = self._global_loss(loss_sum)  # the same value on every rank: all stop together
        optimizer_update(self, loss)
        self.last_stats = self._stats(named, stats_grad)
        return loss

    def _accumulate_step(self, local: tuple[torch.Tensor, ...], num_mb: int) -> torch.Tensor:
        chunk = self.chunks[0]
        fsdp = self._fsdp_active()
        total = torch.zeros(())
        for i in range(num_mb):
            mb = tuple(t.chunk(num_mb, dim=0)[i] if isinstance(t, torch.Tensor) else t for t in local)
            if fsdp and num_mb > 1:  # sync on the last microbatch only (one call walks every module)
                chunk.set_requires_gradient_sync(i == num_mb - 1)
            loss = self._forward_loss(mb)
            (loss / num_mb).backward()
            total += loss.detach().float() / num_mb
        return total

    def _pipeline_schedule(self, num_mb: int) -> Any:
        """The schedule for `num_mb` microbatches, built once: a new schedule object re-runs
        the stages' shape inference, one extra chunk forward per step."""
        if num_mb not in self._schedules:
            self._schedules[num_mb] = self._make_schedule(num_mb)
        return self._schedules[num_mb]

    def _pipeline_step(self, local: tuple[torch.Tensor, ...], num_mb: int) -> torch.Tensor:
        tokens, labels = local[0], local[1]
        schedule = self._pipeline_schedule(num_mb)
        losses: list[torch.Tensor] = []
        args = (tokens,) if self.has_first else ()
        schedule.step(*args, target=labels if self.has_last else None, losses=losses)
        if self.has_last:
            return torch.stack([l.detach().float() for l in losses]).mean()
        return torch.zeros(())

    def _make_schedule(self, num_mb: int) -> Any:
        if self.config.schedule in ("interleaved", "zb"):  # multi-stage schedules take every local chunk
            schedule = self.schedule(self._stages, n_microbatches=num_mb, loss_fn=self.rules.loss_fn)
        elif self.config.schedule == "1f1b" and num_mb < self.config.pp:
            # torch's 1F1B refuses fewer microbatches than stages; with so few, its warm-up
            # already runs every forward first, i.e. it is GPipe: same order, same memory.
            from torch.distributed.pipelining.schedules import ScheduleGPipe

            schedule = ScheduleGPipe(self._stages[0], n_microbatches=num_mb, loss_fn=self.rules.loss_fn)
        else:
            schedule = self.schedule(self._stages[0], n_microbatches=num_mb, loss_fn=self.rules.loss_fn)
        return schedule

    def _fsdp_active(self) -> bool:
        return self.config.zero >= 2 and self.config.dp > 1

    def _finalize_grads(self, named: list[tuple[str, nn.Parameter]]) -> None:
        params = [p for _, p in named if p.grad is not None]
        for p in params:
            # Sequence-parallel norms leave Partial (pending-sum) grads on the tp axis;
            # the optimizer must see them in the parameter's own layout.
            if isinstance(p, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        if self.config.dp > 1 and not self._fsdp_active():
            # Test-only hook: leave the named parameter's gradient out of the dp all-reduce, a
            # deliberately broken plan that `train --check` must catch (tests/dist/test_check_random.py).
            skip = os.environ.get("AUTOPAR_TEST_DROP_GRAD_SYNC")
            grads = [_local(p.grad) for n, p in named if p.grad is not None and n != skip]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.mesh.get_group("dp"))
            flat /= self.config.dp
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
        if self.tie_group is not None:
            for name, p in named:
                if name in self.tied_fqns and p.grad is not None:
                    dist.all_reduce(_local(p.grad), group=self.tie_group)

    def _global_loss(self, loss_sum: torch.Tensor) -> float:
        counts = self.has_last and self.tp_rank == 0
        value = loss_sum.clone() if counts else torch.zeros(())
        dist.all_reduce(value)
        return float(value) / self.config.dp

    def _stats(self, params: list[tuple[str, nn.Parameter]], grad_bytes: int) -> StepStats:
        opt = self.optimizer.optim if hasattr(self.optimizer, "optim") else self.optimizer
        state_bytes = sum(_local(v).numel() * _local(v).element_size()
                          for s in opt.state.values() for v in s.values()
                          if isinstance(v, torch.Tensor) and v.dim() > 0)
        return StepStats(
            parameter_bytes=sum(_local(p).numel() * _local(p).element_size() for _, p in params),
            gradient_bytes=grad_bytes,
            optimizer_state_bytes=state_bytes,
            peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        )

    # ---- inspection and state ---------------------------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Unsharded copies of this rank's parameters, named as in the unsplit model.
        Collective over this rank's stage (dp x tp) peers: call it on every rank."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            perm = permutation_for(name, self.rules)
            if perm is not None and self.config.tp > 1:
                full = perm.from_tp(full, self.config.tp)
            out[name] = full.detach().clone()
        return out

    def state_dict(self) -> dict[str, Any]:
        """Sharded model and optimizer state (DTensor values stay sharded), in the form
        `torch.distributed.checkpoint.save` takes. GPT's qkv rows are stored in TP order."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        model_state: dict[str, Any] = {}
        for chunk in self.chunks:
            model_state.update(get_model_state_dict(chunk))
        if hasattr(self.optimizer, "consolidate_state_dict"):
            raise ValueError("state_dict() with --zero 1 (ZeroRedundancyOptimizer) is not supported; use --zero 2")
        container = nn.ModuleList(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        optim_state = get_optimizer_state_dict(container, self.optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        for chunk in self.chunks:
            names = {n for n, _ in chunk.state_dict().items()}
            set_model_state_dict(chunk, {k: v for k, v in state["model"].items() if k in names})
        container = nn.ModuleList(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        set_optimizer_state_dict(container, self.optimizer, state["optimizer"])


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
    timeout = _default_group_timeout()
    if timeout is not None:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        override = {axis: ("gloo", options) for axis in names}
    return init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override)


def _default_group_timeout() -> Any:
    """The default gloo group's collective timeout, for the subgroups made from it.

    torch gives `new_group`/DeviceMesh subgroups the 30-minute library default, not the
    world's timeout: a hung rank would stall its dp/tp/pp peers for 30 minutes. None when
    the world is not gloo (NCCL has its own watchdog)."""
    if dist.get_backend() != "gloo":
        return None
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return backend.options._timeout


def _tie_group(mesh: DeviceMesh, config: ParallelConfig) -> dist.ProcessGroup | None:
    """The process group joining this rank with its (first, last) chunk partner, if any."""
    grid = mesh.mesh  # (pp, dp, tp) tensor of global ranks
    mine = None
    for d in range(config.dp):
        for t in range(config.tp):
            ranks = sorted({int(grid[0, d, t]), int(grid[config.pp - 1, d, t])})
            group = dist.new_group(ranks, timeout=_default_group_timeout())  # every rank calls every new_group
            if dist.get_rank() in ranks:
                mine = group
    return mine


def build_program(model: nn.Module, config: ParallelConfig, *, loss_fn: Callable[..., torch.Tensor] | None = None,
                  optimizer: OptimizerFactory | None = None, stage_layers: tuple[int, ...] | None = None,
                  compile_stages: bool | None = None, mesh: DeviceMesh | None = None,
                  fused_kernels: bool | None = None, example_inputs: Sequence[Any] | None = None,
                  plan: Any = None, cluster: Any = None) -> Any:
    """Shard `model` (built identically on every rank) as `config` (or `plan`) says; collective.

    pp = 1: the per-op program (autopar/runtime/spmd.py): the plan's per-op placements, or
    the ILP's for `config`, applied to the traced graph of one global microbatch of
    `example_inputs` (needed). pp > 1: the model cut at its repeated layers, every stage a
    per-op program on its (dp, tp) submesh (autopar/runtime/pipe_spmd.py). The module-level
    builder (`build_module_program`, family rule tables) is not on this path: benchmarks
    keep it as a baseline.

    `fused_kernels` (default: on where CUDA is present) swaps the zoo's norms and MLP
    activations for the fused Triton ops of codegen/kernels before sharding; parameter
    names and values are unchanged, so plans and checkpoints do not notice. Not with
    tp > 1 (the fused ops have no DTensor sharding rules yet)."""
    if config.pp == 1:
        from autopar.runtime.spmd import build_spmd_program

        plan = plan if plan is not None and getattr(plan, "placements", None) else None
        if (fused_kernels if fused_kernels is not None else torch.cuda.is_available()) and plan is None:
            # (a saved plan's placements name the nodes of the step it was searched on,
            # unfused: it runs as searched)
            # traced with the fused modules in: their ops (and backward ops) are in the
            # joint graph, sharded by their own DTensor rules (codegen/kernels/sharding.py)
            from codegen.kernels.modules import swap_fused_modules

            model = swap_fused_modules(model)
        if example_inputs is None:
            raise ValueError("a pp = 1 program is compiled from the traced training step: pass example_inputs= "
                             "(one global batch)")
        return build_spmd_program(model, config, example_inputs, loss_fn=loss_fn, optimizer=optimizer or default_optimizer(),
                                  plan=plan, cluster=cluster)
    # pp > 1, any model with a repeated layer stack (the zoo's included): stages cut at its
    # layers, each compiled by the per-op path on its (dp, tp) submesh (autopar/runtime/pipe_spmd.py)
    from autopar.capabilities import pipeline_support
    from autopar.runtime.pipe_spmd import build_pipe_spmd_program

    reason = pipeline_support(model, config)
    if reason is not None:
        raise ValueError(reason)
    if example_inputs is None:
        raise ValueError("a pipeline is cut from the traced training step: pass example_inputs= (one global batch)")
    return build_pipe_spmd_program(model, config, example_inputs, loss_fn=loss_fn,
                                   optimizer=optimizer or default_optimizer(), stage_layers=stage_layers, mesh=mesh,
                                   cluster=cluster, plan=plan)


def build_module_program(model: nn.Module, config: ParallelConfig, *,
                         loss_fn: Callable[..., torch.Tensor] | None = None,
                         optimizer: OptimizerFactory | None = None, stage_layers: tuple[int, ...] | None = None,
                         compile_stages: bool | None = None, mesh: DeviceMesh | None = None,
                         fused_kernels: bool | None = None) -> RankProgram:
    """The module-level program: pipeline stages cut by the family rule tables
    (codegen/rules.py), Megatron-style TP by `parallelize_module`, FSDP2 / ZeroRedundancy-
    Optimizer for ZeRO. `build_program` uses it for pp > 1 until pipelines are per-op; with
    pp = 1 it is the template baseline the per-op program is measured against
    (benchmarks/measure_cpu.py), not a path `autopar train` or `autopar.compile` takes."""
    if fused_kernels is None:
        fused_kernels = torch.cuda.is_available()
    if fused_kernels and config.tp > 1:
        # the fused ops have no DTensor sharding rules yet: tensor-parallel layers keep ATen ops
        log.info("fused kernels skipped: tp=%d layers run DTensor ops, which the fused ops do not support",
                 config.tp)
        fused_kernels = False
    if fused_kernels:
        from codegen.kernels.modules import swap_fused_modules

        model = swap_fused_modules(model)
    rules = rules_for(model)
    check_tp(rules, model, config.tp)
    if config.pp > 1 and rules is None:
        raise ValueError(
            f"--pp {config.pp} needs a model of known structure (the zoo's GPT or Llama) so it can be cut "
            f"into stages; {type(model).__name__} supports data parallel and ZeRO only. Use --pp 1"
        )
    mesh = mesh if mesh is not None else make_mesh(config)
    optimizer = optimizer or default_optimizer()
    pp_rank = mesh.get_local_rank("pp")
    num_chunks = config.pp * config.interleave
    chunk_ids = tuple(pp_rank + v * config.pp for v in range(config.interleave))
    if stage_layers is not None and len(stage_layers) != num_chunks and config.interleave > 1 \
            and len(stage_layers) == config.pp:
        # Plans count layers per pipeline rank; interleaving splits each rank's share into
        # non-contiguous chunks, so fall back to an even split over all chunks.
        log.info("stage_layers %s are per pp rank; interleave %d uses an even split", stage_layers,
                 config.interleave)
        stage_layers = None
    tied_fqns: tuple[str, ...] = ()
    if rules is not None:
        if rules.tied and model.get_parameter(rules.tied[0]) is model.get_parameter(rules.tied[1]):
            tied_fqns = rules.tied
        chunks: list[nn.Module] = list(build_chunks(model, rules, num_chunks, chunk_ids,
                                                    stage_layers=stage_layers, recompute=config.recompute))
    else:
        if config.recompute != "none":
            log.warning("recompute %s ignored: %s has no known layer structure", config.recompute,
                        type(model).__name__)
        chunks = [model]
    tie_group = _tie_group(mesh, config) if tied_fqns and config.pp > 1 else None
    if config.tp > 1:
        for chunk in chunks:
            apply_tp(chunk, rules, mesh["tp"], sequence_parallel=config.sequence_parallel)
    if compile_stages is None:
        compile_stages = torch.cuda.is_available()
    if compile_stages:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.expanduser("~/.cache/autopar/inductor"))
        for chunk in chunks:
            for layer in getattr(chunk, "layers", {}).values() if rules is not None else [chunk]:
                layer.compile()
    dp_mesh = mesh["dp"]
    if config.zero >= 2 and config.dp > 1:
        from torch.distributed.fsdp import fully_shard

        reshard = config.zero == 3
        for chunk in chunks:
            for layer in (chunk.layers.values() if rules is not None else ()):
                fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard)
            # The root keeps FSDP's default (None): it is not resharded after forward, since
            # backward gathers it straight away. An explicit True would cost one all-gather
            # per step more (what torchtitan and FSDP's own default avoid).
            fully_shard(chunk, mesh=dp_mesh, reshard_after_forward=None if reshard else False)
    params = list({id(p): p for c in chunks for p in c.parameters()}.values())
    if config.zero == 1 and config.dp > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if config.tp > 1:
            raise ValueError(
                "--zero 1 with --tp > 1 is not supported (ZeroRedundancyOptimizer takes plain tensors, "
                "TP parameters are DTensors); use --zero 2, which also shards the optimizer state"
            )
        cls, kwargs = _split_optimizer(optimizer)
        # parameters_as_bucket_view: each rank's partition lives in one flat bucket, so the
        # post-step parameter sync is one broadcast per rank, not one per parameter
        # (measured on 4 gloo ranks: dp4 ZeRO-1 step 244 -> 221 ms; z0 242 ms).
        opt = ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=mesh.get_group("dp"),
                                      parameters_as_bucket_view=True, **kwargs)
    else:
        opt = optimizer(params)
    log.info("rank %d: chunks %s of %d, %d parameters local", dist.get_rank(), chunk_ids, num_chunks, len(params))
    return RankProgram(config=config, mesh=mesh, chunks=chunks, chunk_ids=chunk_ids, num_chunks=num_chunks,
                       rules=rules, loss_fn=loss_fn, optimizer=opt, tie_group=tie_group, tied_fqns=tied_fqns)
