"""Cutting any model with a repeated layer stack into pipeline stages (no process group).

autopar/build/chunks.py `split_model` cuts the traced step at the layers; run one after the
other in one process, the stages give the unsplit model's loss, each stage reads only
values its predecessor sends (skip values relayed), and parameter names are the unsplit
model's. `autopar.capabilities.pipeline_support` says which pipelines run, with reasons.
"""

from __future__ import annotations

import operator

import pytest
import torch

from autopar.capabilities import layer_stack, pipeline_support
from autopar.config import ParallelConfig as C
from autopar.models import resolve
from autopar.build.chunks import split_model
from autopar.runtime.pipe import canonical_names
from tests import factories, hf_factories


def _run_stages(pipe, inputs):
    values = inputs
    for index in range(pipe.num_stages):
        out = pipe.get_stage_module(index)(*values)
        values = out if isinstance(out, tuple) else (out,)
    return values[0]


@pytest.mark.parametrize("factory, chunks", [(hf_factories.gpt2_4layers, 4), (hf_factories.llama, 2)],
                         ids=["hf-gpt2-4-stages", "hf-llama-2-stages"])
def test_stages_in_sequence_give_the_models_loss(factory, chunks):
    torch.manual_seed(0)
    model, (ids, labels) = factory()
    micro = (ids[:2], labels[:2])
    expected = model(*micro).detach()
    pipe, prefix, ranges = split_model(model, micro, num_chunks=chunks)
    assert pipe.num_stages == chunks and [len(r) for r in ranges] == [len(ranges[0])] * chunks
    torch.testing.assert_close(_run_stages(pipe, micro).reshape(()), expected, rtol=1e-6, atol=0)
    canonical = canonical_names(model)  # a tied tensor may sit under any of its names
    names = set()
    for index in range(chunks):
        names |= {canonical[n] for n, _ in pipe.get_stage_module(index).named_parameters(remove_duplicate=False)}
    assert names == set(canonical.values())
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    for k, call in enumerate(calls[1:], start=1):  # adjacent stages only, inputs in send order
        sources = [a.args[0] if a.target is operator.getitem else a for a in call.args]
        assert all(s is calls[k - 1] for s in sources), f"stage {k} reads past its predecessor"
        indices = [a.args[1] for a in call.args]
        assert indices == sorted(indices)


def test_pipeline_support_says_what_runs():
    hf, _ = hf_factories.gpt2()
    mlp, _ = factories.mlp()
    gpt = resolve("gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16").build()
    assert layer_stack(hf) == ("hf.transformer.h", 2) and layer_stack(mlp) == ("", 0)
    assert pipeline_support(hf, C(pp=2)) is None
    assert "--schedule zb is not run" in pipeline_support(hf, C(pp=2, dp=2, schedule="zb"))
    assert pipeline_support(mlp, C(pp=1, dp=2)) is None
    assert "repeated layer stack" in pipeline_support(mlp, C(pp=2))
    # per-op stages (autopar/runtime/pipe_spmd.py): tp and every ZeRO stage, for any model
    assert pipeline_support(hf, C(pp=2, tp=2)) is None
    assert pipeline_support(hf, C(pp=2, dp=2, zero=1)) is None
    assert pipeline_support(hf, C(pp=2, dp=2, zero=3)) is None
    assert pipeline_support(hf, C(pp=2, recompute="full")) is None
    assert "only 2 layers" in pipeline_support(hf, C(pp=2, schedule="interleaved", interleave=2))
    assert pipeline_support(gpt, C(pp=2, tp=2)) is None
    assert pipeline_support(gpt, C(pp=2, tp=4)) is None  # 2 heads: the ILP shards what divides
    assert pipeline_support(gpt, C(pp=2, tp=2, dp=2, zero=1)) is None


def test_pipeline_support_reads_a_traced_graph_too():
    """The search asks with the Graph it traced: the same answers as for the module."""
    from autopar.trace import trace_step

    for factory, runs in ((hf_factories.gpt2, True), (factories.mlp, False)):
        model, example = factory()
        _, graph = trace_step(model, example)
        assert (pipeline_support(graph, C(pp=2)) is None) is runs
        assert (pipeline_support(graph, C(pp=2)) is None) is (pipeline_support(model, C(pp=2)) is None)
        assert pipeline_support(graph, C(pp=2, tp=2)) == pipeline_support(model, C(pp=2, tp=2))

