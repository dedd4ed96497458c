"""Pipeline chunks: cut a zoo model into per-stage modules with the original parameter names.

Where it sits: benchmarks/baselines/template/, used by the template baseline
(benchmarks/baselines/template_program.py) and its source (emit.py here), never by the
runtime. A `Chunk` owns a contiguous run of layers (`layers.<i>` keep their global index,
so parameter FQNs equal the unsplit model's and checkpoints/comparisons need no renaming),
the embedding if it is the first chunk and the head if it is the last. Its forward maps
tokens (first chunk) or hidden states to hidden states, or logits on the last chunk; the
loss is applied outside (by the pipeline schedule or the runtime), so the last chunk's
output is what the schedule's loss sees.

Recomputation (`none | selective | full`) and the sequence-parallel boundary live here
because both wrap the per-layer loop: `full` checkpoints every layer, `selective`
checkpoints a layer with a policy that recomputes only the attention core (SDPA) and
saves every other activation.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopar.capabilities import split_layers
from autopar.ir import ATTENTION_FWD_OPS
from benchmarks.baselines.template.rules import FamilyRules

# The fused kernels are autopar/ir.py's ATTENTION_FWD_OPS (their one home), plus the
# composite SDPA op that dispatches to them.
_ATTENTION_CORE_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in sorted({op.split(".")[1] for op in ATTENTION_FWD_OPS} | {"scaled_dot_product_attention"})
    if hasattr(torch.ops.aten, name)
)


def _attention_core_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE if op in _ATTENTION_CORE_OPS else CheckpointPolicy.MUST_SAVE


def _selective_context() -> object:
    return create_selective_checkpoint_contexts(_attention_core_policy)


class Chunk(nn.Module):
    """One pipeline stage of a zoo model (or the whole model when it is first and last)."""

    def __init__(self, model: nn.Module, rules: FamilyRules, layer_ids: range, *, is_first: bool,
                 is_last: bool, recompute: str = "none") -> None:
        super().__init__()
        self.rules = rules
        self.is_first = is_first
        self.is_last = is_last
        self.recompute = recompute
        self.sp_mesh: DeviceMesh | None = None
        """Set by tp.py here when sequence parallelism is on: the TP mesh."""
        if is_first:
            for name in rules.embed:
                setattr(self, name, getattr(model, name))
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        if is_last:
            for name in rules.head:
                setattr(self, name, getattr(model, name))
        for name in rules.layer_extra_buffers:
            self.register_buffer(name, getattr(model, name), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.rules.embed_fn(self, x)
        extra = self.rules.layer_args_fn(self, x)
        if self.sp_mesh is not None:
            # Chunk boundaries carry plain full activations (pipeline send/recv); inside, the
            # residual stream is sequence-sharded. Replicate -> Shard(1) is a local slice.
            # Between layers the residual stream is this rank's plain sequence shard (DTensor
            # only inside the norms and regions): residual adds run as plain ATen ops.
            x = DTensor.from_local(x, self.sp_mesh, [Replicate()]).redistribute(self.sp_mesh, [Shard(1)]).to_local()
        for layer in self.layers.values():
            x = self._run_layer(layer, x, extra)
        if self.sp_mesh is not None:
            x = DTensor.from_local(x, self.sp_mesh, [Shard(1)]).full_tensor()
        if self.is_last:
            x = self.rules.head_fn(self, x)
        return x

    def _run_layer(self, layer: nn.Module, x: torch.Tensor, extra: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.recompute == "full":
            return checkpoint(layer, x, *extra, use_reentrant=False)
        if self.recompute == "selective":
            return checkpoint(layer, x, *extra, use_reentrant=False, context_fn=_selective_context)
        return layer(x, *extra)


def build_chunks(model: nn.Module, rules: FamilyRules, num_chunks: int, chunk_ids: tuple[int, ...], *,
                 stage_layers: tuple[int, ...] | None = None, recompute: str = "none") -> list[Chunk]:
    """The chunks `chunk_ids` (of `num_chunks`) of `model`; the rest of the model is dropped."""
    ranges = split_layers(len(model.layers), num_chunks, stage_layers)
    return [
        Chunk(model, rules, ranges[i], is_first=i == 0, is_last=i == num_chunks - 1, recompute=recompute)
        for i in chunk_ids
    ]


__all__ = ["Chunk", "build_chunks"]
