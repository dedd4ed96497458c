"""A Llama block's forward graph, fused for a GPU target, run with the Triton kernels.

The fused graph (RMSNorm x2 and SwiGLU as autopar:: ops) runs in Triton's interpreter;
its output and all parameter and input gradients must equal the unfused graph's.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.func import functional_call

from autopar.models.llama import Block, LlamaConfig
from codegen.kernels.fusion_pass import fuse_graph

CFG = LlamaConfig(layers=1, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=128, seq=8)


def _output_and_grads(gm: torch.fx.GraphModule, block: nn.Module, x: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    params = {k: v.detach().clone().requires_grad_() for k, v in block.named_parameters()}
    x = x.clone().requires_grad_()
    out = gm(params, x, cos, sin)
    grads = torch.autograd.grad(out, [*params.values(), x], torch.ones_like(out))
    return (out.detach(), *grads)


def test_llama_block_fused_graph_runs_triton_kernels(triton_interpret: None) -> None:
    torch.manual_seed(0)
    block = Block(CFG)
    for p in block.parameters():
        nn.init.normal_(p, std=0.2)
    x = torch.randn(1, CFG.seq, CFG.hidden)
    angles = torch.randn(CFG.seq, CFG.hidden // CFG.heads)
    inputs = (x, angles.cos(), angles.sin())
    gm = make_fx(lambda p, *xs: functional_call(block, p, xs), tracing_mode="fake")(
        dict(block.named_parameters()), *inputs)

    fused = fuse_graph(gm, target="cuda")  # the GPU target fuses without force
    assert dict(fused.counts) == {"rms_norm": 2, "swiglu": 1}
    got = _output_and_grads(fused.gm, block, *inputs)
    want = _output_and_grads(gm, block, *inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
