"""torchtitan itself as the hand-tuned baseline: its Llama3 module, parallelized on this
rank by its own `parallelize_llama` / `pipeline_llm`, for one hand-picked configuration.

Where it sits: benchmarks/baselines/, outside the autopar package. benchmarks/measure_torchtitan.py
times this beside autopar's program; tests/bench/test_torchtitan_baseline.py checks that it
trains like one process. Needs the `bench` install (`make bench-install`: the `bench` extra
plus `pip install --no-deps torchtitan==0.3.0`); torch stays at the project's 2.13.0.

Terms: a `TitanConfig` holds torchtitan's own knobs (`ParallelismConfig` degrees
dp_replicate / dp_shard / tp / pp, `training.local_batch_size`, the pipeline microbatch size
and schedule, activation checkpointing); `TitanShape` is the model's size. The same weights
reach autopar through `zoo_state_dict` (autopar's zoo Llama with torchtitan's weights, RoPE
pairs and fused qkv rows rearranged so that the function computed is the same) or directly
(autopar compiles the torchtitan module itself).

CPU workarounds (torchtitan 0.3.0 targets GPUs and a torch nightly; facts in
shared/notes/torchtitan-on-cpu.md), each a few lines in this file:
  W1 device type: with no accelerator torchtitan falls back to "cuda" for its meshes;
     `_use_cpu_device` sets "cpu" in the three torchtitan modules that read it.
  W2 gloo has no PREMUL_SUM: torchtitan sets FSDP's gradient divide factor to 1.0, which
     FSDP2 sends as PREMUL_SUM; every FSDPModule gets the public
     `set_force_sum_reduction_for_comms(True)` (a plain SUM, same result).
  W3 `Llama3Model.Config.update_from_config` imports the trainer (tensorboard, datasets,
     tokenizers); `set_llama3_sharding_config` is called directly instead.
  W4 attention: "flex" always goes through torch.compile and "sdpa" is refused by the
     config; each layer's inner attention is set to `ScaledDotProductAttention.Config()`
     (causal SDPA, what the model computes with no document masks).
  W5 pipelining: the trainer's `schedule.step(arg_mbs=..., target_mbs=...)` is not in torch
     2.13's schedules; the whole-batch `step(x, target=y, losses=...)` is used.
  W6 weights: `set_model_state_dict(full_state_dict=True)` fails on the fused wqkv; each
     parameter is copied from the full tensor through `distribute_tensor`.
  And `ParallelismConfig(spmd_backend="partial_dtensor")`: the default spmd_types backend
  fails in `fully_shard` on CPU.

What this drives of torchtitan and what it leaves out: the model, `parallelize_llama`
(TP + sequence parallel + loss parallel, activation checkpointing, FSDP2 / HSDP with
torchtitan's wrapping and reshard policy), `pipeline_llm` (stage split, PipelineStage,
schedules) and `cross_entropy_loss` (sum over tokens / global tokens, as the trainer does).
Not the trainer's data loader, LR schedule, metrics or checkpointing; no gradient clipping
(autopar has none: both sides run the same AdamW step), and the global token count is a
constant (no padding) where the trainer all-reduces it each step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

TORCHTITAN_VERSION = "0.3.0"
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
"""torchtitan's names (`parallelism.pipeline_parallel_schedule`) of the schedules driven here."""
AC_MODES = ("none", "full", "selective")


def available() -> str | None:
    """None when torchtitan 0.3.0 can be imported, else why not (one line)."""
    try:
        import torchtitan  # noqa: F401
        from importlib.metadata import version

        got = version("torchtitan")
    except Exception as exc:  # ImportError, or a missing dependency of the bench install
        return f"torchtitan is not importable ({type(exc).__name__}: {exc})"
    if got != TORCHTITAN_VERSION:
        return f"torchtitan {got} is installed; the baseline is written for {TORCHTITAN_VERSION}"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class TitanShape:
    """A torchtitan Llama3 of this size (GQA, SwiGLU, untied head, RoPE without scaling)."""

    fuse_qkv: bool = True
    """torchtitan's registry flavors fuse q, k, v into one GEMM (FusedQKVLinear `wqkv`);
    False builds its stock QKVLinear (`wq`, `wk`, `wv`: three GEMMs, as autopar's zoo Llama)."""
    layers: int = 4
    dim: int = 256
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 512
    vocab: int = 1024
    seq: int = 64
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def zoo_spec(self) -> str:
        """The same shapes as an autopar zoo spec (`autopar.models.resolve`)."""
        return (f"llama:layers={self.layers},hidden={self.dim},heads={self.heads},kv_heads={self.kv_heads},"
                f"ffn={self.ffn},vocab={self.vocab},seq={self.seq}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TitanConfig:
    """torchtitan's own knobs for one run (names as in its ParallelismConfig / TrainingConfig)."""

    dp_replicate: int = 1
    """data_parallel_replicate_degree: DDP-style replicas (HSDP when dp_shard > 1)."""
    dp_shard: int = 1
    """data_parallel_shard_degree: FSDP2."""
    tp: int = 1
    pp: int = 1
    local_batch_size: int = 1
    """training.local_batch_size: sequences per data-parallel rank per forward/backward
    (with pp > 1: per step, split into pipeline microbatches)."""
    pp_microbatch_size: int = 1
    pp_schedule: str = "1F1B"
    stages_per_rank: int = 1
    """Pipeline chunks per rank (2 or more for Interleaved1F1B)."""
    ac: str = "none"
    """Activation checkpointing: none, full (every block recomputed), selective (per-op SAC)."""
    sequence_parallel: bool = True

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "local_batch_size", "pp_microbatch_size",
                     "stages_per_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.pp_schedule not in SCHEDULES:
            raise ValueError(f"pp_schedule must be one of {SCHEDULES}, got {self.pp_schedule!r}")
        if (self.pp_schedule == "Interleaved1F1B") != (self.stages_per_rank > 1):
            raise ValueError("Interleaved1F1B needs stages_per_rank >= 2 and the other schedules 1; got "
                             f"{self.pp_schedule} with stages_per_rank={self.stages_per_rank}")
        if self.ac not in AC_MODES:
            raise ValueError(f"ac must be one of {AC_MODES}, got {self.ac!r}")
        if self.pp > 1 and self.local_batch_size % self.pp_microbatch_size:
            raise ValueError(f"local_batch_size {self.local_batch_size} is not a multiple of the pipeline "
                             f"microbatch size {self.pp_microbatch_size}")

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def batch_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    def grad_accum_steps(self, global_batch: int) -> int:
        per_step = self.local_batch_size * self.batch_degree
        if global_batch % per_step:
            raise ValueError(f"global batch {global_batch} is not a multiple of local_batch_size x dp "
                             f"= {self.local_batch_size} x {self.batch_degree}")
        steps = global_batch // per_step
        if self.pp > 1 and steps != 1:
            raise ValueError("with pp > 1 give local_batch_size = global batch / dp (one pipeline step)")
        return steps


# ---- the model -----------------------------------------------------------------------------

def _use_cpu_device() -> None:
    """W1: torchtitan picks "cuda" when no accelerator is present; make it build CPU meshes."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils

    for module in (parallel_dims, dist_utils, tools_utils):
        module.device_type = "cpu"
    for module in (dist_utils, tools_utils):
        module.device_module = torch.cpu


def model_config(shape: TitanShape, *, sequence_parallel: bool = True) -> Any:
    """torchtitan's Llama3 config at `shape`, built the way its registry builds its flavors
    (its layer builder, depth-scaled init, fused wqkv), with W3 and W4 applied."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    layers = _build_llama3_layers(
        n_layers=shape.layers, dim=shape.dim, n_heads=shape.heads, n_kv_heads=shape.kv_heads,
        hidden_dim=shape.ffn, attn_backend="flex", fuse_qkv=shape.fuse_qkv,
        rope=ComplexRoPE.Config(dim=shape.head_dim, max_seq_len=shape.seq, theta=shape.rope_theta, scaling="none"))
    for layer in layers:  # W4
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = Llama3Model.Config(
        dim=shape.dim, vocab_size=shape.vocab,
        tok_embeddings=Embedding.Config(num_embeddings=shape.vocab, embedding_dim=shape.dim,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=shape.dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=shape.dim, out_features=shape.vocab, param_init=_output_linear_init(shape.dim)),
        layers=layers)
    set_llama3_sharding_config(config, enable_sp=sequence_parallel)  # W3
    return config


def reference_model(shape: TitanShape, *, seed: int = 0) -> nn.Module:
    """The unsharded torchtitan Llama3 with torchtitan's own initialisation under `seed`:
    the weights both sides start from (every rank builds the same one)."""
    torch.manual_seed(seed)
    model = model_config(shape).build()
    with torch.no_grad():
        model.init_weights()
    return model


def zoo_state_dict(titan: nn.Module, shape: TitanShape, *, copy: bool = True) -> dict[str, torch.Tensor]:
    """torchtitan Llama3 parameters as autopar's zoo Llama (autopar/models/llama.py) names
    and lays them out, computing the same function:
    - fused wqkv rows are (kv head, [its q heads..., k, v], head_dim): split into wq, wk, wv
      (the stock QKVLinear's wq, wk, wv are taken as they are);
    - torchtitan's complex RoPE rotates adjacent pairs (2i, 2i+1), the zoo's rotate-half
      pairs (i, i + head_dim/2) at the same frequency i: q and k rows are permuted within
      each head to match (attention scores are unchanged: both sides permuted alike);
    - lm_head is the zoo's output.
    `copy=False`: tensors that need no change are torchtitan's own (shared storage), for a
    caller that drops the torchtitan model (`zoo_model`)."""
    p = {name: t.detach() for name, t in titan.named_parameters()}
    hd, hpk = shape.head_dim, shape.heads // shape.kv_heads
    pairs = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])

    def rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
        return w.reshape(heads, hd, -1)[:, pairs].reshape(heads * hd, -1)

    out = {"tok_embeddings.weight": p["tok_embeddings.weight"], "norm.weight": p["norm.weight"],
           "output.weight": p["lm_head.weight"]}
    for i in range(shape.layers):
        qkv = f"layers.{i}.attention.qkv_linear"
        if shape.fuse_qkv:
            w = p[f"{qkv}.wqkv.weight"].reshape(shape.kv_heads, hpk + 2, hd, shape.dim)
            wq, wk, wv = (w[:, :hpk].reshape(-1, shape.dim), w[:, hpk].reshape(-1, shape.dim),
                          w[:, hpk + 1].reshape(-1, shape.dim))
        else:
            wq, wk, wv = p[f"{qkv}.wq.weight"], p[f"{qkv}.wk.weight"], p[f"{qkv}.wv.weight"]
        out[f"layers.{i}.attention.wq.weight"] = rope_rows(wq, shape.heads)
        out[f"layers.{i}.attention.wk.weight"] = rope_rows(wk, shape.kv_heads)
        out[f"layers.{i}.attention.wv.weight"] = wv
        for name in ("attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
                     "attention_norm", "ffn_norm"):
            out[f"layers.{i}.{name}.weight"] = p[f"layers.{i}.{name}.weight"]
    return {k: v.clone() for k, v in out.items()} if copy else {k: v.contiguous() for k, v in out.items()}


def zoo_model(shape: TitanShape, *, seed: int = 0) -> nn.Module:
    """autopar's zoo Llama at `shape` holding torchtitan's initial weights (`zoo_state_dict`),
    built holding about one copy of the weights at a time, as torchtitan's side builds its
    own model: the torchtitan model is converted and dropped, then the zoo model, built on
    the meta device, takes the converted tensors themselves (`assign`), and its
    non-persistent buffers (the RoPE tables) come from a one-layer build. Built naively
    (zoo model, torchtitan model and a cloned state dict at once) the memory phase charged
    the zoo rows two extra copies of the weights that no training step holds."""
    import dataclasses

    from autopar.models import resolve

    with torch.device("cpu"):
        tables = dict(resolve(dataclasses.replace(shape, layers=1).zoo_spec).build().named_buffers())
    titan = reference_model(shape, seed=seed)
    state = zoo_state_dict(titan, shape, copy=False)
    del titan
    with torch.device("meta"):
        model = resolve(shape.zoo_spec).build()
    model.load_state_dict(state, strict=True, assign=True)
    for name, buffer in list(model.named_buffers()):
        if buffer.is_meta:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner).register_buffer(leaf, tables[name], persistent=False)
    return model


def titan_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of a plain (unsharded) torchtitan forward: autopar's `loss_fn`
    when it compiles the torchtitan module."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


# ---- one rank's training step --------------------------------------------------------------

@dataclass(kw_only=True)
class TitanProgram:
    """One rank's torchtitan training step (build with `build`; call inside the ranks)."""

    config: TitanConfig
    parts: list[nn.Module]
    """This rank's model parts (one without pp; its pipeline chunks with pp)."""
    optimizer: torch.optim.Optimizer
    global_tokens: int
    batch_rank: int
    tp_rank: int
    schedule: Any = None
    has_first: bool = True
    has_last: bool = True
    grad_accum: int = 1
    loss_fn: Any = field(default=None, repr=False)
    """pred, labels -> this rank's CE sum / global tokens (torchtitan's cross_entropy_loss)."""

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """One optimizer step on the global batch (identical on every rank); returns the
        global mean loss on every rank."""
        tokens, labels = (t.chunk(self.config.batch_degree)[self.batch_rank] for t in batch)
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            args = (tokens,) if self.has_first else ()
            kwargs = {"target": labels, "losses": losses} if self.has_last else {}
            self.schedule.step(*args, **kwargs)  # W5
            if self.has_last:
                total = torch.stack([x.detach() for x in losses]).sum()
        else:
            for tok, lab in zip(tokens.chunk(self.grad_accum), labels.chunk(self.grad_accum)):
                loss = self.loss_fn(self.parts[0](tok), lab)
                loss.backward()
                total += loss.detach()
        self.optimizer.step()
        # local sums / global tokens add up to the global mean over the data-parallel ranks
        counts = self.has_last and self.tp_rank == 0
        value = total.reshape(()).clone() if counts else torch.zeros(())
        dist.all_reduce(value)
        return float(value)


def build(shape: TitanShape, config: TitanConfig, *, global_batch: int, lr: float = 1e-3,
          seed: int = 0, weights: dict[str, torch.Tensor] | None = None) -> TitanProgram:
    """Parallelize torchtitan's Llama3 on this rank as `config` says (collective: every rank
    of the world calls it) and load the initial weights (`weights`, full tensors under
    torchtitan's names; default: `reference_model(shape, seed)`)."""
    import functools

    _use_cpu_device()
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import parallelize_llama

    world = dist.get_world_size()
    if config.world != world:
        raise ValueError(f"dp_replicate*dp_shard*tp*pp = {config.world} but the world has {world} ranks")
    if shape.heads % config.tp or shape.kv_heads % config.tp:
        raise ValueError(f"tp={config.tp} must divide heads={shape.heads} and kv_heads={shape.kv_heads}")
    grad_accum = config.grad_accum_steps(global_batch)
    chunks = config.pp * config.stages_per_rank
    if shape.layers < chunks:
        raise ValueError(f"{shape.layers} layers cannot fill {chunks} pipeline chunks")
    if weights is None:
        weights = dict(reference_model(shape, seed=seed).named_parameters())

    dist_utils.set_spmd_backend("partial_dtensor")
    # an even split of the layers over the chunks (what autopar's default plan does), with
    # the embedding on the first chunk and norm + head on the last
    bounds = [shape.layers * c // chunks for c in range(chunks + 1)]
    fqns = [[f"layers.{i}" for i in range(bounds[c], bounds[c + 1])] for c in range(chunks)]
    fqns[0].insert(0, "tok_embeddings")
    fqns[-1] += ["norm", "lm_head"]
    parallelism = ParallelismConfig(
        data_parallel_replicate_degree=config.dp_replicate, data_parallel_shard_degree=config.dp_shard,
        tensor_parallel_degree=config.tp, pipeline_parallel_degree=config.pp,
        pipeline_parallel_schedule=config.pp_schedule, pipeline_parallel_microbatch_size=config.pp_microbatch_size,
        module_fqns_per_model_part=fqns if config.pp > 1 else None,
        enable_sequence_parallel=config.sequence_parallel, spmd_backend="partial_dtensor")
    training = TrainingConfig(local_batch_size=config.local_batch_size, seq_len=shape.seq, dtype="float32",
                              mixed_precision_param="float32", mixed_precision_reduce="float32")
    ac = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[config.ac]
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    global_tokens = global_batch * shape.seq

    def loss_fn(pred: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        return cross_entropy_loss(pred, labels) / global_tokens, {}

    titan_config = model_config(shape, sequence_parallel=config.sequence_parallel)
    with torch.device("meta"):
        model = titan_config.build()
    common = dict(parallel_dims=dims, training=training, parallelism=parallelism,
                  compile_config=CompileConfig(enable=False), ac_config=ac, dump_folder="")
    schedule, has_first, has_last = None, True, True
    if config.pp > 1:
        schedule, parts, has_first, has_last = pipeline_llm(
            model, device=torch.device("cpu"), model_config=titan_config, parallelize_fn=parallelize_llama,
            loss_fn=loss_fn, **common)
    else:
        parts = [parallelize_llama(model, **common)]
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)  # W2
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights()  # buffers (RoPE cache); parameters are overwritten below
            for name, param in part.named_parameters():  # W6
                full = weights[name.replace("_checkpoint_wrapped_module.", "")].detach()
                if isinstance(param, DTensor):
                    param.copy_(distribute_tensor(full, param.device_mesh, param.placements))
                else:
                    param.copy_(full)
        part.train()
    params = [p for part in parts for p in part.parameters()]
    tp_rank = dims.get_mesh("tp").get_local_rank() if config.tp > 1 else 0
    batch_rank = dims.get_mesh("batch").get_local_rank() if config.batch_degree > 1 else 0
    return TitanProgram(config=config, parts=parts, optimizer=torch.optim.AdamW(params, lr=lr),
                        global_tokens=global_tokens, batch_rank=batch_rank, tp_rank=tp_rank, schedule=schedule,
                        has_first=has_first, has_last=has_last, grad_accum=grad_accum,
                        loss_fn=lambda pred, labels: loss_fn(pred, labels)[0])


def reference_losses(shape: TitanShape, batches: list[tuple[torch.Tensor, torch.Tensor]], *, lr: float = 1e-3,
                     seed: int = 0) -> list[float]:
    """Single-process losses: the unsharded torchtitan model, the same AdamW steps."""
    model = reference_model(shape, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out = []
    for tokens, labels in batches:
        opt.zero_grad(set_to_none=True)
        loss = titan_loss(model(tokens), labels)
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
        if not math.isfinite(out[-1]):
            raise ValueError(f"reference loss is {out[-1]} at step {len(out)}")
    return out
