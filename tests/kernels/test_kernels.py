"""Fused kernels vs eager PyTorch: forward and backward, Triton (interpreter) and reference paths.

Triton runs here only in its interpreter (`TRITON_INTERPRET=1`, ~1000x slower than eager;
see conftest.py for how it is switched on), so shapes are tiny but deliberately awkward:
row lengths that are not powers of two and row counts that do not divide evenly over the
backward's programs.

Oracles: fp32 kernels against eager fp32 with tight tolerances; bf16 kernels against eager
fp32 on the same (upcast) bf16 inputs with bf16-level tolerances, and never worse than
eager bf16's own error plus one bf16 step.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from autopar.models.llama import RMSNorm
from codegen.kernels import ops
from codegen.kernels.cross_entropy import vocab_parallel_cross_entropy

BACKENDS = ["triton", "reference"]
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=4e-2, rtol=2e-2)}
ROWS, HIDDEN = (2, 35), 48  # 70 rows > the 64 backward programs; 48 is not a power of two


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "triton":
        request.getfixturevalue("triton_interpret")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return request.param


def _assert_backend(backend: str, t: torch.Tensor) -> None:
    # Guard against a silent fallback: the triton path must really run the Triton module.
    assert ops.kernel_backend(t).__name__.endswith("triton_kernels" if backend == "triton" else "reference")


def _check(fused: Callable[..., torch.Tensor], eager: Callable[..., torch.Tensor],
           inputs: list[torch.Tensor], dtype: torch.dtype) -> None:
    """Forward output and all input grads of `fused` match `eager` evaluated in fp32."""
    torch.manual_seed(1)
    low = [t.detach().to(dtype).requires_grad_() for t in inputs]
    high = [t.detach().float().requires_grad_() for t in low]  # same values, exact in fp32
    y = fused(*low)
    assert y.dtype == dtype and y.shape == eager(*high).shape
    dy = torch.randn(y.shape).to(dtype)
    grads = torch.autograd.grad(y, low, dy)
    y_ref = eager(*high)
    grads_ref = torch.autograd.grad(y_ref, high, dy.float())
    torch.testing.assert_close(y.float(), y_ref, **TOL[dtype])
    for name, g, g_ref in zip("abcd", grads, grads_ref):
        scale = max(1.0, g_ref.abs().max().item())  # weight grads sum 70 rows: compare relative to size
        torch.testing.assert_close(g.float() / scale, g_ref / scale, **TOL[dtype], msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_zoo_module(backend: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(*ROWS, HIDDEN), torch.randn(HIDDEN)
    _assert_backend(backend, x)

    def eager(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(RMSNorm(HIDDEN, 1e-5), {"weight": w}, (x,))

    _check(lambda x, w: ops.rms_norm(x, w, 1e-5), eager, [x, w], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_matches_eager(backend: str, dtype: torch.dtype, with_bias: bool) -> None:
    torch.manual_seed(0)
    x, w, b = torch.randn(*ROWS, HIDDEN) * 3 + 1, torch.randn(HIDDEN), torch.randn(HIDDEN)
    _assert_backend(backend, x)
    if with_bias:
        _check(lambda x, w, b: ops.layer_norm(x, w, b, 1e-5),
               lambda x, w, b: F.layer_norm(x, (HIDDEN,), w, b, 1e-5), [x, w, b], dtype)
    else:
        _check(lambda x, w: ops.layer_norm(x, w, None, 1e-5),
               lambda x, w: F.layer_norm(x, (HIDDEN,), w, None, 1e-5), [x, w], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_eager(backend: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    gate, up = torch.randn(3, 7, 50) * 3, torch.randn(3, 7, 50)  # 1050 elements: 2 blocks, ragged
    _assert_backend(backend, gate)
    _check(ops.swiglu, lambda g, u: F.silu(g) * u, [gate, up], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_gelu_matches_eager(backend: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, bias = torch.randn(3, 7, 50) * 3, torch.randn(50)
    _assert_backend(backend, x)
    _check(ops.bias_gelu, lambda x, b: F.gelu(x + b, approximate="tanh"), [x, bias], dtype)


def test_bias_gelu_backward_over_several_column_blocks(triton_interpret: None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward's 2-D grid: 50 columns in blocks of 16 (the last one partial), 21 rows
    split over more row blocks than divide them evenly."""
    from codegen.kernels import triton_kernels

    monkeypatch.setattr(triton_kernels, "COLUMN_BLOCK", 16)
    monkeypatch.setattr(triton_kernels, "NORM_BWD_PROGRAMS", 20)  # 20 / 4 blocks = 5 row blocks of 5 rows
    torch.manual_seed(1)
    x, bias = torch.randn(3, 7, 50) * 3, torch.randn(50)
    _check(ops.bias_gelu, lambda x, b: F.gelu(x + b, approximate="tanh"), [x, bias], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_matches_eager(backend: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 13, 32), torch.randn(1100, 32) / 4  # vocab > one 1024 block
    labels = torch.randint(0, 1100, (2, 13))
    labels[0, 3] = labels[1, 0] = -100  # ignored tokens leave the mean and get no gradient
    _assert_backend(backend, hidden)

    def eager(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy((h @ w.t()).reshape(-1, w.shape[0]), labels.reshape(-1))

    low = [t.to(dtype).requires_grad_() for t in (hidden, weight)]
    high = [t.detach().float().requires_grad_() for t in low]
    loss = vocab_parallel_cross_entropy(*low, labels, chunk_tokens=5)  # 26 tokens: 6 chunks, ragged
    grads = torch.autograd.grad(loss, low)
    loss_ref = eager(*high)
    grads_ref = torch.autograd.grad(loss_ref, high)
    tol = TOL[dtype]
    torch.testing.assert_close(loss, loss_ref, **tol)
    for g, g_ref in zip(grads, grads_ref):
        scale = g_ref.abs().max().item()
        torch.testing.assert_close(g.float() / scale, g_ref / scale, **tol)
    assert grads[0][0, 3].abs().max().item() == 0.0


def test_user_errors_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="swiglu: gate and up must have the same shape"):
        ops.swiglu(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"bias must have shape \(5,\)"):
        ops.bias_gelu(torch.zeros(2, 5), torch.zeros(4))
    with pytest.raises(ValueError, match="labels shape"):
        vocab_parallel_cross_entropy(torch.zeros(4, 8), torch.zeros(10, 8), torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("case", ["rms_norm", "layer_norm", "swiglu", "bias_gelu", "vocab_parallel_ce"])
def test_ops_register_consistent_fake_and_autograd(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.library.opcheck: schema, fake impl vs real, autograd registration, aot dispatch."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # opcheck runs each op many times
    torch.manual_seed(0)
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, requires_grad=True)
    args = {
        "rms_norm": (torch.ops.autopar.rms_norm, (x, w, 1e-5)),
        "layer_norm": (torch.ops.autopar.layer_norm, (x, w, w.detach().clone().requires_grad_(), 1e-5)),
        "swiglu": (torch.ops.autopar.swiglu, (x, x.detach().clone().requires_grad_())),
        "bias_gelu": (torch.ops.autopar.bias_gelu, (x, w)),
        "vocab_parallel_ce": (torch.ops.autopar.vocab_parallel_ce,
                              (x, torch.randn(9, 6, requires_grad=True), torch.tensor([1, 8, -100, 0]),
                               0, 3, -100, "")),
    }
    op, op_args = args[case]
    torch.library.opcheck(op, op_args)


def test_fused_ops_trace_as_single_nodes_under_fake_mode() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x: torch.Tensor, w: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = ops.swiglu(ops.rms_norm(x, w, 1e-5), gate)
        return torch.autograd.grad(y.sum(), (x, w, gate))

    x, w, gate = (torch.randn(3, 8, requires_grad=True), torch.randn(8, requires_grad=True),
                  torch.randn(3, 8, requires_grad=True))
    gm = make_fx(step, tracing_mode="fake")(x, w, gate)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    for name in ("autopar.rms_norm.default", "autopar.rms_norm_backward.default",
                 "autopar.swiglu.default", "autopar.swiglu_backward.default"):
        assert targets.count(name) == 1, (name, targets)
    # the traced graph runs on real tensors and gives eager's gradients
    for got, want in zip(gm(x, w, gate), step(x, w, gate)):
        torch.testing.assert_close(got, want)


def test_fused_ops_compile_with_fullgraph(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo + AOTAutograd see each op as one node (fake impl) and differentiate it (autograd impl)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch._dynamo.reset()

    def block(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, head: torch.Tensor,
              labels: torch.Tensor) -> torch.Tensor:
        h = ops.layer_norm(ops.rms_norm(x, w, 1e-5), w, b, 1e-5)
        h = ops.bias_gelu(ops.swiglu(h, h * 0.5), b)
        return vocab_parallel_cross_entropy(h, head, labels, chunk_tokens=4)

    torch.manual_seed(0)
    leaves = [torch.randn(6, 8), torch.randn(8), torch.randn(8), torch.randn(20, 8)]
    labels = torch.randint(0, 20, (6,))
    eager_in = [t.clone().requires_grad_() for t in leaves]
    compiled_in = [t.clone().requires_grad_() for t in leaves]
    want = block(*eager_in, labels)
    got = torch.compile(block, backend="aot_eager", fullgraph=True)(*compiled_in, labels)
    torch.testing.assert_close(got, want)
    for g, w in zip(torch.autograd.grad(got, compiled_in), torch.autograd.grad(want, eager_in)):
        torch.testing.assert_close(g, w)
