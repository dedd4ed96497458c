"""Hand-tuned 3D parallelism, written the way torchtitan writes it: the baseline of
benchmarks/measure_cpu.py.

torchtitan itself is the anchor (torchtitan_baseline.py beside it, benchmarks/measure_torchtitan.py);
this imitation is kept for what torchtitan does not give: it needs no extra install (the
default `make test` checks it, tests/dist/test_handtuned_baseline.py, and measure_cpu.py
measures against it where torchtitan is absent); it shards the zoo models as they are,
including GPT (LayerNorm, GELU, learned positions, tied head; torchtitan 0.3.0 has no such
model) over dp/pp/zero; and its ZeRO-0 is DDP's bucketed flat all-reduce, where torchtitan's
data_parallel_replicate_degree is FSDP2 in replicate mode (one all-reduce per FSDP unit).

Nothing here is planned or searched: the expert picks dp/tp/pp/zero by hand and applies
- TP: `parallelize_module` with ColwiseParallel(wq, wk, wv, w1, w3) / RowwiseParallel(wo, w2),
  and with sequence parallelism SequenceParallel on the norms plus PrepareModuleInput on the
  attention and feed-forward regions (torchtitan `apply_tp`);
- ZeRO-3 / FSDP: `fully_shard` per block and on the root over the dp mesh axis;
  ZeRO-0: gradients all-reduced over dp in DDP's 25 MiB buckets (DDP's traffic). DDP
  launches each bucket during backward; here they run after it, which costs nothing
  extra on this machine (4-8 ranks on 2 cores leave no idle core for gloo to overlap on);
- PP: layers split evenly into stages, `PipelineStage` + `ScheduleGPipe` / `Schedule1F1B` /
  `ScheduleInterleaved1F1B` over the pp mesh axis.
Only the zoo's Llama gets TP (GPT's fused qkv needs a weight regrouping torchtitan does not
have); GPT runs dp/pp/zero.

Mesh layout: ("pp", "dp", "tp"), tp innermost, as torchtitan lays it out.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from autopar.models.llama import Llama


DDP_BUCKET_BYTES = 25 * 2**20
"""DistributedDataParallel's default bucket_cap_mb."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HandConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    """0 (all-reduce gradients) or 3 (fully_shard); torchtitan has no ZeRO-1/2."""
    micro_batch: int = 1
    schedule: str = "1f1b"
    interleave: int = 1
    sequence_parallel: bool = True

    def __post_init__(self) -> None:
        if self.zero not in (0, 3):
            raise ValueError(f"the hand-tuned baseline does ZeRO 0 or 3 (FSDP), got {self.zero}")


class _Stage(nn.Module):
    """One pipeline chunk: embedding on the first, norm + head on the last."""

    def __init__(self, model: nn.Module, layer_ids: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.is_llama = isinstance(model, Llama)
        self.sp_mesh: DeviceMesh | None = None
        self.embed = (model.tok_embeddings if self.is_llama else model.wte) if first else None
        self.wpe = None if self.is_llama or not first else model.wpe
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.norm = (model.norm if self.is_llama else model.ln_f) if last else None
        self.head = (model.output if self.is_llama else model.lm_head) if last else None
        if self.is_llama:
            self.register_buffer("rope_cos", model.rope_cos, persistent=False)
            self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            s = x.shape[1]
            h = self.embed(x)
            if self.wpe is not None:
                h = h + self.wpe(torch.arange(s, device=x.device))
            x = h
        s = x.shape[1]
        if self.sp_mesh is not None:  # residual stream sharded over the sequence between blocks
            x = DTensor.from_local(x, self.sp_mesh, [Replicate()]).redistribute(placements=[Shard(1)]).to_local()
        for layer in self.layers.values():
            x = layer(x, self.rope_cos[:s], self.rope_sin[:s]) if self.is_llama else layer(x)
        if self.sp_mesh is not None:
            x = DTensor.from_local(x, self.sp_mesh, [Shard(1)]).full_tensor()
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def _apply_tp(stage: _Stage, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    tp = tp_mesh.size()
    for block in stage.layers.values():
        attn, ffn = block.attention, block.feed_forward
        if attn.heads % tp or attn.kv_heads % tp:
            raise ValueError(f"tp={tp} must divide heads={attn.heads} and kv_heads={attn.kv_heads}")
        plan: dict[str, Any] = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel(),
        }
        if sequence_parallel:
            plan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, tp_mesh, plan)
        attn.heads //= tp
        attn.kv_heads //= tp
    if sequence_parallel:
        stage.sp_mesh = tp_mesh


class HandTuned:
    """One rank's training step under a hand-picked configuration (call inside the ranks)."""

    def __init__(self, model: nn.Module, cfg: HandConfig, *, num_microbatches: int,
                 lr: float = 1e-3) -> None:
        world = dist.get_world_size()
        if cfg.dp * cfg.tp * cfg.pp != world:
            raise ValueError(f"dp*tp*pp={cfg.dp * cfg.tp * cfg.pp} != world {world}")
        if cfg.tp > 1 and not isinstance(model, Llama):
            raise ValueError("the hand-tuned baseline shards only the zoo's Llama over tp")
        self.cfg = cfg
        self.mesh = init_device_mesh("cpu", (cfg.pp, cfg.dp, cfg.tp), mesh_dim_names=("pp", "dp", "tp"))
        self.num_microbatches = num_microbatches
        pp_rank = self.mesh.get_local_rank("pp")
        chunks = cfg.pp * cfg.interleave
        layers = len(model.layers)
        bounds = [layers * i // chunks for i in range(chunks + 1)]
        # interleaved: rank r owns chunks r, r + pp, r + 2 pp, ...
        chunk_ids = [pp_rank + k * cfg.pp for k in range(cfg.interleave)]
        self.stages: list[_Stage] = []
        for c in chunk_ids:
            stage = _Stage(model, list(range(bounds[c], bounds[c + 1])), c == 0, c == chunks - 1)
            if cfg.tp > 1:
                _apply_tp(stage, self.mesh["tp"], cfg.sequence_parallel)
            if cfg.zero == 3 and cfg.dp > 1:
                for block in stage.layers.values():
                    fully_shard(block, mesh=self.mesh["dp"])
                fully_shard(stage, mesh=self.mesh["dp"])
            self.stages.append(stage)
        params = [p for s in self.stages for p in s.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=lr)
        self.schedule = None
        if cfg.pp > 1:
            pp_group = self.mesh.get_group("pp")
            pipe_stages = [PipelineStage(s, c, chunks, torch.device("cpu"), group=pp_group)
                           for s, c in zip(self.stages, chunk_ids)]
            loss = _loss
            if cfg.schedule == "interleaved":
                self.schedule = ScheduleInterleaved1F1B(pipe_stages, n_microbatches=num_microbatches, loss_fn=loss)
            elif cfg.schedule == "gpipe":
                self.schedule = ScheduleGPipe(pipe_stages[0], n_microbatches=num_microbatches, loss_fn=loss)
            else:
                self.schedule = Schedule1F1B(pipe_stages[0], n_microbatches=num_microbatches, loss_fn=loss)
        self.is_last = chunk_ids[-1] == chunks - 1
        self.is_first = chunk_ids[0] == 0

    def _all_reduce_grads(self) -> None:
        """ZeRO-0 gradient sync as DDP does it: gradients in reverse registration order (the
        order backward produces them), flattened into buckets of DDP's default 25 MiB, one
        averaging all-reduce per bucket."""
        group = self.mesh.get_group("dp")
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                 for stage in self.stages for p in stage.parameters() if p.grad is not None]
        for bucket in _buckets(grads[::-1], DDP_BUCKET_BYTES):
            flat = torch._utils._flatten_dense_tensors(bucket)
            dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)
            for g, synced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                g.copy_(synced)

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> float | None:
        """One optimizer step on this rank's data-parallel slice; returns the loss on ranks
        that see it (the last pipeline stage), else None."""
        self.optimizer.zero_grad(set_to_none=True)
        loss_value: float | None = None
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            kwargs: dict[str, Any] = {}
            if self.is_last:
                kwargs = {"target": labels, "losses": losses}
            if self.is_first:
                self.schedule.step(tokens, **kwargs)
            else:
                self.schedule.step(**kwargs)
            if self.is_last:
                loss_value = float(torch.stack([x.detach() for x in losses]).mean())
        else:
            total = torch.zeros(())
            for tok, lab in zip(tokens.chunk(self.num_microbatches), labels.chunk(self.num_microbatches)):
                loss = _loss(self.stages[0](tok), lab) / self.num_microbatches
                loss.backward()
                total += loss.detach()
            loss_value = float(total)
        if self.cfg.zero == 0 and self.cfg.dp > 1:
            self._all_reduce_grads()
        self.optimizer.step()
        if loss_value is not None and self.cfg.dp > 1:  # report the global-batch mean
            t = torch.tensor([loss_value])
            dist.all_reduce(t, op=dist.ReduceOp.AVG, group=self.mesh.get_group("dp"))
            loss_value = float(t)
        return loss_value


def _buckets(tensors: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive groups of at most `cap_bytes` (a tensor larger than the cap is alone)."""
    out: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if out[-1] and size + nbytes > cap_bytes:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return [b for b in out if b]


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def build(model_factory: Callable[[], nn.Module], cfg: HandConfig, *, num_microbatches: int,
          lr: float = 1e-3) -> HandTuned:
    """Build the same-seeded model on every rank, then shard it by hand."""
    torch.manual_seed(0)
    model = copy.deepcopy(model_factory())
    return HandTuned(model, cfg, num_microbatches=num_microbatches, lr=lr)
