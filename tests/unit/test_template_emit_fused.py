"""The template's module-level emit (benchmarks/baselines/template/emit.py) with fused
kernels: the per-rank program of a Llama stage calls the fused ops (torch.ops.autopar.*)
in place of the RMSNorm and SwiGLU patterns, forward and backward."""

from __future__ import annotations

import re

import pytest
import torch

from autopar.config import ParallelConfig
from autopar.models import resolve
from benchmarks.baselines.template.emit import emit


def _count(code: dict[str, str], pattern: str) -> int:
    return sum(len(re.findall(pattern, text)) for text in code.values())


def test_llama_stage_program_uses_fused_ops():
    source = resolve("llama-tiny")  # 2 layers: 2 norms per layer + the final norm
    torch.manual_seed(0)
    model = source.build()
    config = ParallelConfig(pp=2, dp=2, zero=3)
    inputs = source.example_inputs(4)
    plain = emit(model, config, example_inputs=inputs)
    fused = emit(model, config, example_inputs=inputs, fused_kernels=True)
    norms, mlps = 2 * 2 + 1, 2
    assert _count(plain, r"autopar\.") == 0 and _count(plain, r"aten\.rsqrt") == norms
    assert _count(fused, r"autopar\.rms_norm\.default") == norms
    assert _count(fused, r"autopar\.rms_norm_backward\.default") == norms
    assert _count(fused, r"autopar\.swiglu\.default") == mlps
    assert _count(fused, r"autopar\.swiglu_backward\.default") == mlps
    assert _count(fused, r"aten\.rsqrt|aten\.silu") == 0
    # the sharding is untouched: same collectives either way
    assert _count(fused, r"_c10d_functional\.\w+") == _count(plain, r"_c10d_functional\.\w+")


def test_fused_kernels_refuse_tensor_parallel_with_a_clear_message():
    source = resolve("llama-tiny")
    with pytest.raises(ValueError, match="tp=1 only"):
        emit(source.build(), ParallelConfig(tp=2, dp=2), example_inputs=source.example_inputs(4),
             fused_kernels=True)
