"""Presets, spec strings and factories: everything `MODEL` on the command line can be.

- preset: a name in `PRESETS` (`gpt2`, `gpt3-175b`, `llama3-70b`, `gpt-tiny`, ...);
- spec: `gpt:layers=96,hidden=12288,heads=96,vocab=51200,seq=2048`,
  `llama:layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=128256,seq=8192` or
  `moe:layers=2,hidden=64,heads=4,vocab=256,seq=32,experts=4,top_k=2` (autopar/models/moe.py);
- factory: `package.module:function` returning `(model, example_inputs)`, where the
  model's forward returns the scalar loss.

Published sizes the presets reproduce (parameters): gpt2 124M (with a vocabulary padded
to 50304 as nanoGPT does, so it shards), gpt3-1.3b 1.3B, gpt3-175b 175B, llama3-8b 8.03B,
llama3-70b 70.6B, llama3-405b 405.9B (Llama 3 paper, Table 3; Meta model cards).
Mixture of experts (autopar/models/moe.py): mixtral-8x7b has Mixtral 8x7B's architecture
(Jiang et al. 2024, arXiv 2401.04088, Table 1: 46.7B parameters, 12.9B active) with
GShard-style capacity routing; deepseek-v3-like has DeepSeek-V3's widths, expert counts
and routing shape (arXiv 2412.19437, section 4.2: hidden 7168, 61 layers, 1 shared + 256
routed experts of inner size 2048, top-8, vocabulary 129280) with grouped-query attention
in place of multi-head latent attention and every layer a MoE layer, so its parameter
count is near, not equal to, V3's 671B. moe-tiny and moe-small are for tests.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from autopar.batch import from_factory
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig
from autopar.models.moe import MoE, MoEConfig

ModelConfig = GPTConfig | LlamaConfig | MoEConfig

PRESETS: dict[str, ModelConfig] = {
    "gpt-tiny": GPTConfig(layers=2, hidden=64, heads=4, vocab=256, seq=32),
    "gpt-small": GPTConfig(layers=4, hidden=128, heads=4, vocab=512, seq=64),
    "gpt2": GPTConfig(layers=12, hidden=768, heads=12, vocab=50304, seq=1024),
    "gpt3-1.3b": GPTConfig(layers=24, hidden=2048, heads=16, vocab=51200, seq=2048),
    "gpt3-175b": GPTConfig(layers=96, hidden=12288, heads=96, vocab=51200, seq=2048),
    "llama-tiny": LlamaConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=32),
    "llama-small": LlamaConfig(layers=4, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=512, seq=64),
    "llama3-8b": LlamaConfig(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=8192
    ),
    "llama3-70b": LlamaConfig(
        layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256, seq=8192
    ),
    "llama3-405b": LlamaConfig(
        layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256, seq=8192
    ),
    "moe-tiny": MoEConfig(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, seq=32, experts=4, top_k=2,
                          expert_ffn=64, shared_experts=1),
    "moe-small": MoEConfig(layers=4, hidden=128, heads=4, kv_heads=2, vocab=512, seq=64, experts=8, top_k=2,
                           expert_ffn=128, shared_experts=1),
    "mixtral-8x7b": MoEConfig(layers=32, hidden=4096, heads=32, kv_heads=8, vocab=32000, seq=4096, experts=8,
                              top_k=2, expert_ffn=14336, shared_experts=0, group_tokens=1024, rope_theta=1e6),
    "deepseek-v3-like": MoEConfig(layers=61, hidden=7168, heads=128, vocab=129280, seq=4096, experts=256,
                                  top_k=8, expert_ffn=2048, shared_experts=1, group_tokens=512,
                                  capacity_factor=1.0, aux_loss_coef=1e-4, rope_theta=10000.0),
}

_SPEC_KEYS: dict[str, dict[str, Callable[[str], Any]]] = {
    "gpt": {"layers": int, "hidden": int, "heads": int, "vocab": int, "seq": int, "ffn": int,
            "tie": lambda v: v not in ("0", "false", "False")},
    "llama": {"layers": int, "hidden": int, "heads": int, "vocab": int, "seq": int, "ffn": int,
              "kv_heads": int, "tie": lambda v: v not in ("0", "false", "False")},
    "moe": {"layers": int, "hidden": int, "heads": int, "vocab": int, "seq": int, "kv_heads": int,
            "experts": int, "top_k": int, "expert_ffn": int, "shared_experts": int,
            "group_tokens": int, "capacity_factor": float, "aux_loss_coef": float,
            "tie": lambda v: v not in ("0", "false", "False")},
}
_CONFIGS: dict[str, type] = {"gpt": GPTConfig, "llama": LlamaConfig, "moe": MoEConfig}
_BUILDERS: dict[type, Callable[[Any], nn.Module]] = {GPTConfig: GPT, LlamaConfig: Llama, MoEConfig: MoE}
_REQUIRED = ("layers", "hidden", "heads", "vocab", "seq")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSource:
    """Something the tracer and runtime can build: a config, or a user factory."""

    name: str
    config: ModelConfig | None = None
    factory: Callable[[], tuple[nn.Module, tuple[Any, ...]]] | None = None

    @property
    def family(self) -> str:
        if isinstance(self.config, GPTConfig):
            return "gpt"
        if isinstance(self.config, LlamaConfig):
            return "llama"
        if isinstance(self.config, MoEConfig):
            return "moe"
        return "custom"

    def with_overrides(self, *, seq: int | None = None, layers: int | None = None) -> "ModelSource":
        if self.config is None:
            if seq is not None:
                raise ValueError(f"--seq applies to presets and specs, not to factory {self.name!r}")
            return self
        changes: dict[str, int] = {}
        if seq is not None:
            changes["seq"] = seq
        if layers is not None:
            changes["layers"] = layers
        return dataclasses.replace(self, config=dataclasses.replace(self.config, **changes))

    def build(self, *, layers: int | None = None) -> nn.Module:
        """Build the model (under a FakeTensorMode if one is active: nothing is allocated)."""
        if self.config is None:
            raise ValueError(f"{self.name!r} is a factory; call it through example()")
        cfg = self.config if layers is None else dataclasses.replace(self.config, layers=layers)
        return _BUILDERS[type(cfg)](cfg)

    def example_inputs(self, batch: int, *, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Synthetic (tokens, labels) of shape (batch, seq): labels are tokens shifted by one.

        Each sequence counts from a random start with a random stride (1, 2 or 3) modulo the
        vocabulary, so there is something to learn: the loss falls from log(vocab) as a
        model picks up the stride from context, which makes a training run easy to judge."""
        if self.config is None:
            raise ValueError(f"{self.name!r} is a factory: its example inputs come from the factory")
        if batch <= 0:
            raise ValueError(f"batch must be a positive integer, got {batch}")
        cfg = self.config
        start = torch.randint(0, cfg.vocab, (batch, 1), generator=generator)
        stride = torch.randint(1, 4, (batch, 1), generator=generator)
        data = (start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def parse_spec(spec: str) -> ModelConfig:
    """`gpt:layers=2,hidden=64,heads=4,vocab=256,seq=32` -> GPTConfig (likewise llama, moe)."""
    family, _, body = spec.partition(":")
    if family not in _SPEC_KEYS:
        raise ValueError(f"unknown model family {family!r} in spec {spec!r}; use 'gpt:', 'llama:' or 'moe:'")
    keys = _SPEC_KEYS[family]
    values: dict[str, Any] = {}
    for item in filter(None, body.split(",")):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq:
            raise ValueError(f"spec item {item!r} in {spec!r} is not key=value")
        if key not in keys:
            raise ValueError(
                f"unknown key {key!r} in {family} spec {spec!r}; known keys: {', '.join(keys)}"
            )
        try:
            values[key] = keys[key](raw.strip())
        except ValueError:
            raise ValueError(f"spec key {key}={raw!r} in {spec!r} is not a valid number") from None
    missing = [k for k in _REQUIRED + (("experts",) if family == "moe" else ()) if k not in values]
    if missing:
        raise ValueError(f"{family} spec {spec!r} is missing {', '.join(missing)}")
    if "tie" in values:
        values["tie_embeddings"] = values.pop("tie")
    return _CONFIGS[family](**values)


def _load_factory(path: str) -> Callable[[], tuple[nn.Module, tuple[Any, ...]]]:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"model factory {path!r}: cannot import module {module_name!r} ({exc}); "
            "check the spelling and that its package is on PYTHONPATH"
        ) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"model factory {path!r}: module {module_name!r} has no callable {attr!r}; name a "
                         "function that returns (model, example_inputs), as 'package.module:function'")

    def factory() -> tuple[nn.Module, tuple[Any, ...]]:
        # (model, inputs) or (model, inputs, keyword inputs): one batch tuple (autopar/batch.py)
        return from_factory(fn(), f"model factory {path!r}")

    factory.__name__ = getattr(fn, "__name__", "factory")
    return factory


def resolve(name: str) -> ModelSource:
    """Turn a preset name, spec string or factory path into a ModelSource."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"model must be a preset name, spec or factory path, got {name!r}")
    if name in PRESETS:
        return ModelSource(name=name, config=PRESETS[name])
    if name.startswith(tuple(f"{family}:" for family in _SPEC_KEYS)) or ("=" in name and ":" in name):
        return ModelSource(name=name, config=parse_spec(name))
    if ":" in name and "=" not in name:
        return ModelSource(name=name, factory=_load_factory(name))
    raise ValueError(
        f"unknown model {name!r}; use a preset ({', '.join(PRESETS)}), a spec such as "
        "'gpt:layers=2,hidden=64,heads=4,vocab=256,seq=32', or a factory 'package.module:function'"
    )
