"""The fusion pass on real zoo graphs: fused ops replace the patterns, numerics unchanged.

Graphs are per-rank ATen forward graphs (`make_fx` over `functional_call`, parameters as
graph inputs). The oracle is the unfused graph (and eager module): outputs and every
parameter/input gradient must match. The fused ops run their reference path here, except
in the one Triton-interpreter test of a Llama block.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.func import functional_call

from autopar.models.llama import Block, LlamaConfig
from autopar.models.zoo import resolve
from autopar.trace import trace
from codegen.kernels.fusion_pass import fuse_graph, should_fuse
from codegen.kernels.modules import FusedRMSNorm, FusedSwiGLU, swap_fused_modules

CFG = LlamaConfig(layers=1, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=128, seq=8)


@pytest.fixture(autouse=True)
def _reference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _forward_graph(model: nn.Module, *inputs: torch.Tensor) -> fx.GraphModule:
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return make_fx(lambda p, *xs: functional_call(model, p, xs), tracing_mode="fake")(state, *inputs)


def _fused_counts(gm: fx.GraphModule) -> dict[str, int]:
    names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    return {op: names.count(f"autopar.{op}.default")
            for op in ("rms_norm", "layer_norm", "swiglu", "bias_gelu", "vocab_parallel_ce")}


def _run_with_grads(gm: fx.GraphModule, model: nn.Module, *inputs: torch.Tensor) -> tuple[Any, ...]:
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())
    float_inputs = [x.clone().requires_grad_() if x.is_floating_point() else x for x in inputs]
    out = gm({**params, **buffers}, *float_inputs)
    out = out[0] if isinstance(out, (tuple, list)) else out
    leaves = list(params.values()) + [x for x in float_inputs if x.requires_grad]
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    return (out.detach(), *grads)


def _llama_block() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    block = Block(CFG)
    for p in block.parameters():  # norms start at ones; randomise so weight grads are tested
        nn.init.normal_(p, std=0.2)
    x = torch.randn(2, CFG.seq, CFG.hidden)
    angles = torch.randn(CFG.seq, CFG.hidden // CFG.heads)
    return block, (x, angles.cos(), angles.sin())


def test_llama_block_rewritten_with_fused_ops_same_outputs_and_grads() -> None:
    block, inputs = _llama_block()
    gm = _forward_graph(block, *inputs)
    fused = fuse_graph(gm, target="cpu", force=True)
    assert dict(fused.counts) == {"rms_norm": 2, "swiglu": 1}
    assert _fused_counts(fused.gm) == {"rms_norm": 2, "layer_norm": 0, "swiglu": 1, "bias_gelu": 0,
                                       "vocab_parallel_ce": 0}
    remaining = {str(n.target) for n in fused.gm.graph.nodes}
    assert not remaining & {"aten.rsqrt.default", "aten.silu.default", "aten.pow.Tensor_Scalar"}
    assert _fused_counts(gm)["rms_norm"] == 0  # the input graph is left as it was

    want = _run_with_grads(gm, block, *inputs)
    got = _run_with_grads(fused.gm, block, *inputs)
    eager = block(*inputs)
    torch.testing.assert_close(want[0], eager)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_cpu_target_leaves_graph_alone_by_default() -> None:
    block, inputs = _llama_block()
    gm = _forward_graph(block, *inputs)
    assert not should_fuse("cpu") and should_fuse("cuda") and should_fuse("cpu", force=True)
    fused = fuse_graph(gm, target="cpu")
    assert fused.counts == () and fused.gm is not gm
    assert [str(n.target) for n in fused.gm.graph.nodes] == [str(n.target) for n in gm.graph.nodes]


@pytest.mark.parametrize("name, expected", [
    ("llama-tiny", {"rms_norm": 3, "swiglu": 1, "cross_entropy": 1}),
    ("gpt-tiny", {"layer_norm": 3, "bias_gelu": 1, "cross_entropy": 1}),
])
def test_whole_model_loss_and_grads_unchanged(name: str, expected: dict[str, int]) -> None:
    source = resolve(name)
    torch.manual_seed(0)
    model = source.build(layers=1)
    for n, p in model.named_parameters():
        if "norm" in n or "ln" in n:
            nn.init.normal_(p, mean=1.0, std=0.2)
    tokens, labels = source.example_inputs(2)
    labels[0, :3] = -100
    gm = _forward_graph(model, tokens, labels)
    fused = fuse_graph(gm, target="cpu", force=True, chunk_tokens=24)  # 64 tokens: ragged chunks
    assert dict(fused.counts) == expected
    want = _run_with_grads(gm, model, tokens, labels)
    got = _run_with_grads(fused.gm, model, tokens, labels)
    torch.testing.assert_close(want[0], model(tokens, labels))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_joint_graph_is_left_intact() -> None:
    """In the joint graph the backward reads the patterns' intermediates: no unsafe rewrite."""
    source = resolve("llama-tiny")
    torch.manual_seed(0)
    model = source.build(layers=1)
    joint = trace(model, source.example_inputs(2)).gm
    fused = fuse_graph(joint, target="cuda")
    assert fused.counts == ()
    assert len(fused.gm.graph.nodes) == len(joint.graph.nodes)


def test_module_swap_same_loss_and_grads() -> None:
    for name in ("llama-tiny", "gpt-tiny"):
        source = resolve(name)
        torch.manual_seed(0)
        model = source.build(layers=2)
        tokens, labels = source.example_inputs(2)
        swapped = swap_fused_modules(model)
        kinds = {type(m).__name__ for m in swapped.modules()}
        if name == "llama-tiny":
            assert isinstance(swapped.layers[0].attention_norm, FusedRMSNorm)
            assert isinstance(swapped.layers[1].feed_forward, FusedSwiGLU)
            assert "RMSNorm" not in kinds and "FeedForward" not in kinds
        else:
            assert {"FusedLayerNorm", "FusedBiasGeluMLP"} <= kinds and "LayerNorm" not in kinds
        assert not any(type(m).__name__.startswith("Fused") for m in model.modules())  # input untouched
        assert [n for n, _ in swapped.named_parameters()] == [n for n, _ in model.named_parameters()]
        loss_ref, loss = model(tokens, labels), swapped(tokens, labels)
        loss_ref.backward()
        loss.backward()
        torch.testing.assert_close(loss, loss_ref)
        for (n, p), (_, q) in zip(swapped.named_parameters(), model.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def _loss_and_grads(model, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(*inputs)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_module_swap_reaches_hugging_face_models() -> None:
    """No rule names a family: Hugging Face Llama's LlamaRMSNorm (epsilon under
    `variance_epsilon`) and LlamaMLP (gate_proj, up_proj, down_proj beside an activation
    module) are swapped by their structure, once the probe shows the fused forms compute
    them; same loss and gradients, same parameter names in the same order."""
    pytest.importorskip("transformers")
    from tests.hf_factories import llama

    torch.manual_seed(0)
    model, inputs = llama()
    swapped = swap_fused_modules(model)
    kinds = [type(m).__name__ for m in swapped.modules()]
    assert kinds.count("FusedRMSNorm") == 2 * 2 + 1 and kinds.count("FusedSwiGLU") == 2, kinds
    assert "LlamaRMSNorm" not in kinds and "LlamaMLP" not in kinds
    assert [n for n, _ in swapped.named_parameters()] == [n for n, _ in model.named_parameters()]
    loss_ref, grads_ref = _loss_and_grads(model, inputs)
    loss, grads = _loss_and_grads(swapped, inputs)
    torch.testing.assert_close(loss, loss_ref)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


class _OnePlusNorm(nn.Module):
    """Gemma's RMSNorm: scales by (1 + weight). Structurally a norm candidate, not one."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.eps = 1e-6
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


class _GeluMLP(nn.Module):
    def __init__(self, d: int, approximate: str) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate=self.approximate))


class _GatedMLP(nn.Module):
    def __init__(self, d: int, p: float) -> None:
        super().__init__()
        self.a = nn.Linear(d, 2 * d, bias=False)
        self.b = nn.Linear(d, 2 * d, bias=False)
        self.out = nn.Linear(2 * d, d, bias=False)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(self.a(x) * F.silu(self.b(x))))


def test_module_swap_keeps_modules_whose_math_differs() -> None:
    """The probe decides, not the structure: a (1 + weight) norm, an exact-erf GELU MLP
    and a gated MLP with dropout in training mode keep their modules; the tanh GELU MLP and
    the same gated MLP without dropout (its gate the second Linear: roles come from the
    probe, not from names) are swapped."""
    torch.manual_seed(0)
    d = 16
    model = nn.ModuleDict({"gemma_norm": _OnePlusNorm(d), "erf": _GeluMLP(d, "none"), "tanh": _GeluMLP(d, "tanh"),
                           "dropped": _GatedMLP(d, 0.5), "gated": _GatedMLP(d, 0.0)})
    swapped = swap_fused_modules(model)
    kinds = {name: type(m).__name__ for name, m in swapped.items()}
    assert kinds == {"gemma_norm": "_OnePlusNorm", "erf": "_GeluMLP", "tanh": "FusedBiasGeluMLP",
                     "dropped": "_GatedMLP", "gated": "FusedSwiGLU"}, kinds
    assert swapped["gated"].roles == ("b", "a", "out")
    x = torch.randn(2, 5, d)
    for name in ("tanh", "gated"):
        torch.testing.assert_close(swapped[name](x), model[name](x), atol=1e-5, rtol=1e-5)
    # in eval mode the dropout is the identity: the same gated MLP is then swapped
    assert type(swap_fused_modules(model.eval())["dropped"]).__name__ == "FusedSwiGLU"
