"""The experts' grouped matmul (autopar/grouped_mm.py): Hugging Face's MoE layers trace to it.

The op equals Hugging Face's `transformers.grouped_mm_fallback` and its backward, an
expert with no rows included; split on the expert dim with its `experts` operand, each
shard computes its own experts' rows and the shards' outputs sum to the whole output
(the pending sum of the expert-parallel strategy) while their weight gradients
concatenate to the whole gradient. A Hugging Face Mixtral traces with the op in place
of Hugging Face's, its FLOPs counted as matmuls (2 S K N forward, 4 S K N backward), and
the strategy space offers the expert-parallel layout on a mesh axis.
"""

from __future__ import annotations

import pytest
import torch

from autopar import dtensor_bridge as bridge
from autopar import grouped_mm as gmm
from autopar.ir import GEMM_OPS, GROUPED_MM_BWD, GROUPED_MM_FWD
from autopar.placement import Partial, Replicate, Shard
from autopar.trace import trace_step
from solver.intra_op.space import enumerate_strategies

pytest.importorskip("transformers")


def test_the_op_equals_hugging_faces_and_its_expert_shards_sum_to_it():
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    torch.manual_seed(0)
    x, w = torch.randn(12, 5, requires_grad=True), torch.randn(4, 5, 7, requires_grad=True)
    offs = torch.tensor([3, 3, 8, 12], dtype=torch.int32)  # expert 1 has no rows
    grad = torch.randn(12, 7)
    ref = torch.ops.transformers.grouped_mm_fallback(x, w, offs)
    ref_x, ref_w = torch.autograd.grad(ref, (x, w), grad)
    experts = torch.arange(4)
    torch.testing.assert_close(gmm.grouped_mm(x, w, offs, experts), ref, rtol=0, atol=0)
    got_x, got_w = gmm.grouped_mm_backward(x.detach(), w.detach(), offs, experts, grad)
    torch.testing.assert_close((got_x, got_w), (ref_x, ref_w), rtol=0, atol=0)
    mine = [slice(0, 2), slice(2, 4)]  # two ranks, two experts each
    out = sum(gmm.grouped_mm(x, w[s], offs, experts[s]) for s in mine)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    parts = [gmm.grouped_mm_backward(x.detach(), w.detach()[s], offs, experts[s], grad) for s in mine]
    torch.testing.assert_close(sum(p[0] for p in parts), ref_x, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), ref_w, rtol=0, atol=0)


def test_hugging_face_moe_traces_to_the_named_experts_op():
    from tests.hf_factories import mixtral

    model, (ids, labels) = mixtral()
    _, graph = trace_step(model, (ids, labels))
    assert not [n.op for n in graph.nodes if n.op.startswith("transformers.")]
    forward = [n for n in graph.nodes if n.op == GROUPED_MM_FWD]
    backward = [n for n in graph.nodes if n.op == GROUPED_MM_BWD]
    assert len(forward) == len(backward) == 4  # 2 layers x (gate_up, down)
    assert {GROUPED_MM_FWD, GROUPED_MM_BWD} <= GEMM_OPS
    for n in forward + backward:
        (s, k), n_out = graph[n.inputs[0]].output.shape, graph[n.inputs[1]].output.shape[2]
        assert n.flops == (2 if n in forward else 4) * s * k * n_out > 0
        assert graph[n.inputs[3]].op == "aten.arange.default"  # the experts the weights hold
    bridge.register_project_rules()
    space = enumerate_strategies(graph, (1, 4))
    expert_parallel = ((Replicate(), Replicate()), (Replicate(), Shard(0)), (Replicate(), Replicate()),
                       (Replicate(), Shard(0)))
    assert any(s.inputs == expert_parallel and s.outputs == ((Replicate(), Partial()),)
               for s in space.strategies[forward[0].id])


def test_data_parallel_hugging_face_routing_is_refused_with_the_sort_named():
    """Hugging Face's routing sorts every token of the batch by expert: no split of the batch
    computes that sort, so a data-parallel configuration has no plan, and the error names
    the op, its module and why, not a reshape."""
    from autopar.cluster import Cluster
    from autopar.config import ParallelConfig
    from autopar.sharding import InfeasiblePlanError
    from solver.forced import solve_one_stage
    from tests.hf_factories import mixtral

    model, (ids, labels) = mixtral()
    _, graph = trace_step(model, (ids[:4], labels[:4]))
    with pytest.raises(InfeasiblePlanError) as info:
        solve_one_stage(graph, ParallelConfig(dp=2, tp=2, micro_batch=2), Cluster.parse("cpu:1x4"), num_microbatches=2)
    text = str(info.value)
    assert "aten.sort.default in hf.model.layers.0.mlp.experts" in text, text
    assert "sort reads every row of the batch at once" in text and "reshape" not in text, text
