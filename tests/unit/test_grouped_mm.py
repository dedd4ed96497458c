"""The experts' grouped matmul (autopar/grouped_mm.py): Hugging Face's MoE layers trace to it.

The op equals Hugging Face's `transformers.grouped_mm_fallback` and its backward on the
rows sorted by expert, an expert with no rows included. Split on the expert dim with its
`experts` operand, each shard computes its own experts' rows and the shards' outputs sum
to the whole output (the pending sum of the expert-parallel strategy) while their weight
gradients concatenate to the whole gradient; split on the rows, the outputs concatenate
and the weight gradients sum (data parallelism). Hugging Face's Mixtral and Qwen2-MoE
compute as their own experts do through it. A Mixtral traces with the op in place of
Hugging Face's and with no sort of the batch, its FLOPs counted as matmuls (2 S K N
forward, 4 S K N backward); the strategy space offers the expert-parallel layout on a mesh
axis, and a dp2 x tp2 configuration has a plan with the batch split into the op.
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


def _reference(x, w, ids, grad):
    """Hugging Face's grouped matmul on the rows sorted by expert, the results put back in
    row order: its output and the gradients of x and w."""
    order = torch.argsort(ids, stable=True)
    offs = torch.cumsum(torch.bincount(ids, minlength=w.shape[0]), 0).to(torch.int32)
    out = torch.ops.transformers.grouped_mm_fallback(x[order], w, offs)
    ref = torch.empty_like(out).index_copy(0, order, out)
    return (ref, *torch.autograd.grad(ref, (x, w), grad))


@pytest.mark.parametrize("k,n,kernel", [(5, 7, False), (8, 12, True)], ids=["loop", "grouped-kernel"])
def test_the_op_equals_hugging_faces_and_its_shards_compose_to_it(k, n, kernel):
    """Both ways the op computes: one matmul per expert where the rows are not 16-byte
    multiples, torch's grouped matmul where they are."""
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    torch.manual_seed(0)
    x, w = torch.randn(12, k, requires_grad=True), torch.randn(4, k, n, requires_grad=True)
    assert gmm.grouped_kernel(x, w) == kernel
    ids = torch.tensor([2, 0, 3, 2, 0, 3, 3, 2, 0, 2, 3, 3])  # expert 1 has no rows
    grad = torch.randn(12, n)
    ref, ref_x, ref_w = _reference(x, w, ids, grad)
    experts = torch.arange(4)
    torch.testing.assert_close(gmm.grouped_mm(x, w, ids, experts), ref, rtol=1e-6, atol=1e-6)
    got_x, got_w = gmm.grouped_mm_backward(x.detach(), w.detach(), ids, experts, grad)
    torch.testing.assert_close((got_x, got_w), (ref_x, ref_w), rtol=1e-6, atol=1e-6)
    mine = [slice(0, 2), slice(2, 4)]  # expert parallel: two ranks, two experts each
    out = sum(gmm.grouped_mm(x, w[s], ids, experts[s]) for s in mine)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    parts = [gmm.grouped_mm_backward(x.detach(), w.detach()[s], ids, experts[s], grad) for s in mine]
    torch.testing.assert_close(sum(p[0] for p in parts), ref_x, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), ref_w, rtol=1e-6, atol=1e-6)
    rows = [slice(0, 6), slice(6, 12)]  # data parallel: two ranks, six rows each, all experts
    torch.testing.assert_close(torch.cat([gmm.grouped_mm(x[r], w, ids[r], experts) for r in rows]), ref,
                               rtol=1e-6, atol=1e-6)
    parts = [gmm.grouped_mm_backward(x.detach()[r], w.detach(), ids[r], experts, grad[r]) for r in rows]
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), ref_x, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sum(p[1] for p in parts), ref_w, rtol=1e-6, atol=1e-6)


def test_a_weight_stored_transposed_gets_its_gradient_in_its_own_layout():
    """The traced graph's fake weight gradient is `empty_like(w)`, and the ops after it
    view it so: the grouped kernel's gradient of a weight stored transposed ([E, N, K]
    read as [E, K, N]) comes back with the same strides and values."""
    torch.manual_seed(0)
    stored = torch.randn(4, 12, 8)  # [E, N, K], as Hugging Face stores gate_up_proj
    w = stored.transpose(-2, -1)
    x, grad = torch.randn(10, 8), torch.randn(10, 12)
    ids, experts = torch.tensor([0, 3, 3, 1, 0, 0, 2, 3, 1, 1]), torch.arange(4)
    assert gmm.grouped_kernel(x, w)
    _, grad_w = gmm.grouped_mm_backward(x, w, ids, experts, grad)
    assert grad_w.stride() == torch.empty_like(w).stride() == w.stride()
    ref = torch.stack([x[ids == e].t() @ grad[ids == e] for e in range(4)])
    torch.testing.assert_close(grad_w, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("factory", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_hugging_face_experts_through_the_op_compute_as_their_own(factory):
    """`experts_forward` (rows in token order through the op) gives Hugging Face's own
    experts' output and gradients, and tracing restores the model's own implementation."""
    import tests.hf_factories as factories

    torch.manual_seed(0)
    model, (ids, labels) = getattr(factories, factory)()
    before = model.hf.get_experts_implementation()
    loss = model(ids, labels)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    with gmm.experts_for_trace(model):
        assert model.hf.config._experts_implementation == gmm.EXPERTS_IMPLEMENTATION
        ours = model(ids, labels)
        our_grads = torch.autograd.grad(ours, list(model.parameters()))
    assert model.hf.get_experts_implementation() == before
    torch.testing.assert_close(ours, loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(our_grads, grads, rtol=1e-4, atol=1e-6)


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
        assert graph[n.inputs[2]].output.shape == (s,)  # each row's expert
    from solver.forced import stacked_experts

    assert stacked_experts(graph) == ()  # the pipeline search offers no --ep layout for them
    bridge.register_project_rules()
    space = enumerate_strategies(graph, (1, 4))
    expert_parallel = ((Replicate(), Replicate()), (Replicate(), Shard(0)), (Replicate(), Replicate()),
                       (Replicate(), Shard(0)))
    assert any(s.inputs == expert_parallel and s.outputs == ((Replicate(), Partial()),)
               for s in space.strategies[forward[0].id])


def test_data_parallel_hugging_face_moe_has_a_plan_with_the_batch_split():
    """The rows keep token order, so Hugging Face's routing splits with the batch: a dp2 x tp2
    configuration solves, the batch split over dp into the grouped matmuls and out of them."""
    from autopar.cluster import Cluster
    from autopar.config import ParallelConfig
    from solver.forced import solve_one_stage
    from solver.spmd_search import op_placements
    from tests.hf_factories import mixtral

    model, (ids, labels) = mixtral()
    _, graph = trace_step(model, (ids[:4], labels[:4]))
    assert not [n for n in graph.nodes if n.op == "aten.sort.default"]
    solution = solve_one_stage(graph, ParallelConfig(dp=2, tp=2, micro_batch=2), Cluster.parse("cpu:1x4"),
                               num_microbatches=2)
    rows = [r for r in op_placements(graph, solution) if r.op == GROUPED_MM_FWD]
    assert rows and all(r.inputs[0].startswith("(S(0)") for r in rows), [r.inputs for r in rows]


class _SortsTheBatch(torch.nn.Module):
    """Orders the batch's rows by a score of every row: no split of the batch computes it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        score, order = torch.sort(h[:, 0])
        return (h[order] * score[:, None]).sum()


def test_a_sort_of_the_whole_batch_is_refused_under_dp_with_the_op_named():
    from autopar.cluster import Cluster
    from autopar.config import ParallelConfig
    from autopar.sharding import InfeasiblePlanError
    from solver.forced import solve_one_stage

    _, graph = trace_step(_SortsTheBatch(), (torch.randn(8, 8),))
    with pytest.raises(InfeasiblePlanError) as info:
        solve_one_stage(graph, ParallelConfig(dp=2, micro_batch=4), Cluster.parse("cpu:1x2"), num_microbatches=1)
    text = str(info.value)
    assert "aten.sort.default" in text and "sort reads every row of the batch at once" in text, text
    assert "reshape" not in text, text


def test_ep_over_dp_is_refused_for_grouped_matmul_experts():
    """--ep splits the experts over the data-parallel ranks and moves tokens there; the
    grouped matmul of token rows has no such move, so --ep is refused with what to do."""
    from autopar.cluster import Cluster
    from autopar.config import ParallelConfig
    from solver.forced import solve_one_stage
    from tests.hf_factories import mixtral

    model, (ids, labels) = mixtral()
    _, graph = trace_step(model, (ids[:4], labels[:4]))
    with pytest.raises(ValueError, match="grouped matmul of token rows") as info:
        solve_one_stage(graph, ParallelConfig(dp=2, ep=2, micro_batch=2), Cluster.parse("cpu:1x2"), num_microbatches=1)
    assert "--tp N" in str(info.value)
