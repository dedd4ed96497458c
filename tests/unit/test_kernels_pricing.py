"""The pricing hook's byte counts against bytes measured on real eager and fused runs.

Oracle: a TorchDispatchMode adds up, for every non-view ATen op of one forward + backward,
the bytes of its tensor inputs and outputs (an expanded input counts its storage, which is
what is read). For the eager patterns that is `unfused_bytes_moved`; for the fused ops it
is the bytes crossing the autopar:: op boundary (a fused kernel reads its inputs and writes
its outputs once), which is `fused_bytes_moved`.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autopar.models.llama import RMSNorm
from codegen.kernels import ops
from codegen.kernels.pricing import fused_bytes_moved, unfused_bytes_moved

ROWS, N = 512, 256
_NO_TRAFFIC = {"view", "_unsafe_view", "t", "transpose", "expand", "detach", "alias", "reshape",
               "unsqueeze", "squeeze", "slice", "select", "as_strided"}


class BytesMoved(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.total_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in _NO_TRAFFIC:
            for t in tree_leaves((args, kwargs, out)):
                if isinstance(t, torch.Tensor):
                    self.total_bytes += min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
        return out


def _measure(fn: Callable[..., torch.Tensor], *shapes: tuple[int, ...]) -> int:
    torch.manual_seed(0)
    xs = [torch.randn(*shape, requires_grad=True) for shape in shapes]
    y = fn(*xs)
    dy = torch.ones_like(y)
    y.backward(dy)  # warm-up outside the mode: first calls can allocate lazily
    xs = [x.detach().clone().requires_grad_() for x in xs]
    with BytesMoved() as mode:
        fn(*xs).backward(dy)
    return mode.total_bytes


CASES = {
    "rms_norm": ((lambda x, w: torch.func.functional_call(RMSNorm(N, 1e-5), {"weight": w}, (x,)),
                  lambda x, w: ops.rms_norm(x, w, 1e-5)), [(ROWS, N), (N,)]),
    "layer_norm": ((lambda x, w, b: F.layer_norm(x, (N,), w, b), lambda x, w, b: ops.layer_norm(x, w, b, 1e-5)),
                   [(ROWS, N), (N,), (N,)]),
    "swiglu": ((lambda g, u: F.silu(g) * u, ops.swiglu), [(ROWS, N), (ROWS, N)]),
    "bias_gelu": ((lambda x, b: F.gelu(x + b, approximate="tanh"), ops.bias_gelu), [(ROWS, N), (N,)]),
}


@pytest.mark.parametrize("pattern", sorted(CASES))
def test_bytes_moved_match_measured_traffic(pattern: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    (eager, fused), shapes = CASES[pattern]
    unfused_measured = _measure(eager, *shapes)
    fused_measured = _measure(fused, *shapes)
    assert unfused_bytes_moved(pattern, (ROWS, N), 4) == pytest.approx(unfused_measured, rel=0.02)
    assert fused_bytes_moved(pattern, (ROWS, N), 4) == pytest.approx(fused_measured, rel=0.02)


def test_fusion_saves_bytes_where_eager_decomposes() -> None:
    shape = (8192, 4096)
    assert fused_bytes_moved("rms_norm", shape, 2) * 5 < unfused_bytes_moved("rms_norm", shape, 2)
    assert fused_bytes_moved("swiglu", shape, 2) < unfused_bytes_moved("swiglu", shape, 2)
    # ATen's LayerNorm is already one kernel each way: no saving is claimed
    assert fused_bytes_moved("layer_norm", shape, 2) == unfused_bytes_moved("layer_norm", shape, 2)


def test_pricing_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown fusion pattern 'softmax'; known patterns: bias_gelu"):
        fused_bytes_moved("softmax", (4, 4), 2)
    with pytest.raises(ValueError, match="positive dims"):
        unfused_bytes_moved("rms_norm", (0, 4), 2)
