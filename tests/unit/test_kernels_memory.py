"""Peak live tensor memory of the chunked cross-entropy vs eager `F.cross_entropy(h @ W.T)`.

Measured on CPU through the reference path with a TorchDispatchMode that tracks every
storage an ATen op returns until its last tensor dies (autograd's saved tensors included),
over forward + backward. Inputs and parameters are not counted; gradients are.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from codegen.kernels.cross_entropy import vocab_parallel_cross_entropy

TOKENS, HIDDEN, VOCAB, CHUNK = 2048, 32, 8192, 128
LOGITS_BYTES = TOKENS * VOCAB * 4


class PeakLiveBytes(TorchDispatchMode):
    """Peak of the summed sizes of live storages created by ops run under this mode.

    The fused ops' implementations run under the mode too, so their chunk buffers count.
    """

    def __init__(self) -> None:
        super().__init__()
        self._size: dict[int, int] = {}
        self._refs: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self.live_bytes -= self._size.pop(key)
            del self._refs[key]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "autopar":
            # A mode is popped while it handles an op: re-enter it and run the op's CPU
            # kernel directly (past this Python key) so the op's own buffers are seen.
            with self:
                out = func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self._size:  # views and in-place results share their base's storage
                self._size[key], self._refs[key] = storage.nbytes(), 0
                self.live_bytes += storage.nbytes()
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self._refs[key] += 1
            weakref.finalize(t, self._release, key)
        return out


def _peak(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
          inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, torch.Tensor, tuple[torch.Tensor, ...]]:
    h, w = (t.clone().requires_grad_() for t in inputs)
    with PeakLiveBytes() as mode:
        loss = step(h, w)
        loss.backward()
        loss = loss.detach()
    assert h.grad is not None and w.grad is not None
    return mode.peak_bytes, loss, (h.grad, w.grad)


def test_tracker_sees_known_peak() -> None:
    x = torch.randn(256, 256, requires_grad=True)
    with PeakLiveBytes() as mode:
        y = (x * 2).exp()  # two 256 KiB tensors alive at once, then only exp's output
        del y
    assert mode.peak_bytes == 2 * 256 * 256 * 4 and mode.live_bytes == 0


def test_chunked_cross_entropy_peak_is_a_small_fraction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator().manual_seed(0)
    inputs = (torch.randn(TOKENS, HIDDEN, generator=gen), torch.randn(VOCAB, HIDDEN, generator=gen) / 4)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=gen)

    eager_peak, eager_loss, eager_grads = _peak(lambda h, w: F.cross_entropy(h @ w.t(), labels), inputs)
    fused_peak, fused_loss, fused_grads = _peak(
        lambda h, w: vocab_parallel_cross_entropy(h, w, labels, chunk_tokens=CHUNK), inputs)

    torch.testing.assert_close(fused_loss, eager_loss)
    for g, g_ref in zip(fused_grads, eager_grads):
        torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=1e-4)
    print(f"peak live bytes: eager {eager_peak / 2**20:.1f} MiB, chunked {fused_peak / 2**20:.1f} MiB "
          f"(full logits {LOGITS_BYTES / 2**20:.1f} MiB)")
    assert eager_peak >= 2 * LOGITS_BYTES  # eager holds logits and log-probs together
    assert fused_peak < 0.1 * eager_peak
    # chunked: a few (chunk x vocab) buffers plus the weight gradient, never a full logits
    assert fused_peak < LOGITS_BYTES / 4
