"""Vocab-parallel chunked cross-entropy on 2 real gloo processes vs the unsharded loss.

Each rank holds half of the output layer's rows (its vocab slice); hidden states and labels
are replicated. The loss on every rank, the hidden-state gradient (all-reduced inside the
op's backward) and each rank's weight-slice gradient must equal `F.cross_entropy` over the
full logits computed in one process. Each worker checks the reference (CPU) path and then
the Triton kernels in the interpreter; a spawned worker is a fresh process, so setting
TRITON_INTERPRET=1 before its first `import triton` is enough.

The ranks start through autopar.runtime.launch.spawn, as autopar's own ranks do. This test
used to abort now and then at exit ("terminate called without an active exception"): the
custom op's first call imports torch._dynamo, which imported torch.distributed.nn.functional
after the group existed and pinned it in default arguments, so destroy_process_group left
its gloo threads running into interpreter shutdown. The launcher now imports that module
first (autopar/runtime/launch.py import_before_process_group); the worker checks the group is not pinned.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.runtime.launch import spawn

WORLD = 2
TOKENS, HIDDEN, VOCAB = 37, 16, 90  # 37 tokens over chunks of 8: ragged last chunk


def _worker(rank: int) -> None:
    # triton must first be imported with the interpreter on (see tests/kernels/conftest.py)
    os.environ["TRITON_INTERPRET"] = "1"
    from codegen.kernels import ops, triton_kernels

    del os.environ["TRITON_INTERPRET"]  # reference path first
    from codegen.kernels.cross_entropy import vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(0)  # same data on both ranks
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    labels[5] = -100
    # labels straddle the split so both ranks own some targets
    assert (labels >= VOCAB // 2).any() and ((labels >= 0) & (labels < VOCAB // 2)).any()

    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss_ref = F.cross_entropy(h_ref @ w_ref.t(), labels)
    loss_ref.backward()

    local = VOCAB // WORLD
    for backend in ("reference", "triton"):
        if backend == "reference":
            assert ops.kernel_backend(hidden).__name__.endswith("reference")
        else:
            os.environ["TRITON_INTERPRET"] = "1"  # read per call by codegen.kernels.ops
            assert ops.kernel_backend(hidden) is triton_kernels
        h = hidden.clone().requires_grad_()
        w_local = weight[rank * local:(rank + 1) * local].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(h, w_local, labels, chunk_tokens=8, group=dist.group.WORLD)
        loss.backward()

        torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h.grad, h_ref.grad, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(w_local.grad, w_ref.grad[rank * local:(rank + 1) * local],
                                   atol=1e-6, rtol=1e-5)
        assert h.grad[5].abs().max().item() == 0.0
    # the custom op's calls imported torch._dynamo; the group must still be free to destroy
    import torch.distributed.nn.functional as dist_functional

    assert "torch._dynamo" in sys.modules
    pinned = dist.group.WORLD in dist_functional.all_reduce.__defaults__ + dist_functional.broadcast.__defaults__
    assert not pinned, "torch.distributed.nn.functional pins the live group: destroy_process_group cannot free it"


@pytest.mark.dist
def test_vocab_parallel_ce_on_two_gloo_ranks_matches_unsharded() -> None:
    spawn(_worker, WORLD)
