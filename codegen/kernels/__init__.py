"""Fused kernels for memory-bound hot spots of a training step.

Where it sits: codegen, after the plan. `fusion_pass.fuse_graph` rewrites a per-rank ATen
forward graph to use the fused ops; `modules.swap_fused_modules` does the same for a
runtime that runs nn.Modules; `cross_entropy.vocab_parallel_cross_entropy` is the chunked,
vocab-sharded loss; `pricing.fused_bytes_moved` is the cost model's hook.

Modules (import what you need; nothing here imports torch or triton eagerly):
- reference.py       pure-PyTorch math, forward and backward (CPU path and test oracle)
- triton_kernels.py  Triton kernels; imported only when a fused op runs on CUDA or under
                     TRITON_INTERPRET=1
- ops.py             torch.library custom ops autopar::{rms_norm, layer_norm, swiglu,
                     bias_gelu} (+ *_backward) with fake and autograd implementations
- cross_entropy.py   autopar::vocab_parallel_ce (+ _backward)
- modules.py         fused drop-in modules and the module swap
- fusion_pass.py     the FX graph pass
- pricing.py         bytes moved, fused vs unfused (torch-free)
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "rms_norm": "ops", "layer_norm": "ops", "swiglu": "ops", "bias_gelu": "ops",
    "vocab_parallel_cross_entropy": "cross_entropy",
    "swap_fused_modules": "modules",
    "fuse_graph": "fusion_pass", "should_fuse": "fusion_pass",
    "fused_bytes_moved": "pricing", "unfused_bytes_moved": "pricing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Lazy so that `import codegen.kernels` (e.g. for pricing) stays torch- and triton-free.
    if name not in _EXPORTS:
        raise AttributeError(f"module 'codegen.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"codegen.kernels.{_EXPORTS[name]}"), name)
