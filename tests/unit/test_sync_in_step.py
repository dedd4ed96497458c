"""With one microbatch per step the per-op step graph reduces each gradient bucket itself
(codegen/apply.py `sync_in_step`): the same collectives and bytes as the separate
`grad_sync` graph and as the ILP priced them (price = run), each issued during the
backward, right after its bucket's last gradient, and waited only at the end of the step
(so it runs beside the rest of the backward); reduce-scatters go per layer
(autopar/buckets.py `gradient_bucket_key`), so a layer's full-size gradients are freed
during the backward, not held to the end of the step.

Traced on a fake process group of 4 ranks (no communication runs); tests/dist checks the
numerics on real gloo ranks (tests/dist/test_train_numerics.py dp4 / zero3, one
microbatch per step)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autopar.buckets import BUCKET_BYTES, gradient_bucket_key, plan_buckets
from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.placing import priced_per_step, solution_choices, solve_config
from autopar.trace import trace_step
from codegen.apply import apply, count_collectives
from codegen.emit import _clear_dtensor_caches

LAYERS = 3


def _programs(config: ParallelConfig) -> tuple:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    source = resolve(f"llama:layers={LAYERS},hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=16")
    torch.manual_seed(0)
    example = source.example_inputs(config.dp * config.micro_batch, generator=torch.Generator().manual_seed(1))
    traced, graph = trace_step(source.build(), list(example))
    solution = solve_config(graph, config, Cluster.parse("cpu:4"), num_microbatches=1)
    choices = solution_choices(graph, solution)
    _clear_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=config.dp * config.tp)
    try:
        mesh = init_device_mesh("cpu", (config.dp, config.tp), mesh_dim_names=("dp", "tp"))
        return (apply(traced.gm, graph, choices, mesh), apply(traced.gm, graph, choices, mesh, sync_in_step=True),
                priced_per_step(solution, 1, ("dp", "tp")))
    finally:
        dist.destroy_process_group()
        _clear_dtensor_caches()


def _by_kind(*counts: dict) -> dict:
    out: dict = {}
    for c in counts:
        for (kind, _), sizes in c.items():
            entry = out.setdefault(kind, [0, 0])
            entry[0] += len(sizes)
            entry[1] += sum(sizes)
    return {k: tuple(v) for k, v in out.items()}


def test_reduce_scatters_bucket_per_layer():
    rs = ((("reduce_scatter", 0, "sum"),), "float32")
    ar = ((("all_reduce", 0, "sum"),), "float32")
    assert gradient_bucket_key(rs, 1) != gradient_bucket_key(rs, 2)
    assert gradient_bucket_key(ar, 1) == gradient_bucket_key(ar, 2) == ar
    assert gradient_bucket_key(None, 1) is None


def test_a_layers_reduce_scatter_is_one_collective_however_large():
    """A layer's reduce-scatters travel in one bucket whatever its size (FSDP's one call per
    unit: 33 reduce-scatters a step for a 32-layer model, not one per weight); all-reduces,
    and reduce-scatters outside the layer stack (the embedding and the head, at the two ends
    of the backward), keep DDP's cap."""
    rs = ((("reduce_scatter", 0, "sum"),), "float32")
    ar = ((("all_reduce", 0, "sum"),), "float32")
    big = BUCKET_BYTES  # each alone fills a capped bucket
    layers = [0, 0, 0, 1, 1, 1]
    assert plan_buckets([(gradient_bucket_key(rs, k), big) for k in layers]) == [[0, 1, 2], [3, 4, 5]]
    assert plan_buckets([(gradient_bucket_key(ar, k), big) for k in layers]) == [[i] for i in range(6)]
    assert plan_buckets([(gradient_bucket_key(rs, None), big)] * 2) == [[0], [1]]
    assert plan_buckets([(gradient_bucket_key(rs, None), big // 4)] * 2) == [[0, 1]]


@pytest.mark.parametrize("config, kind", [(ParallelConfig(dp=4, zero=3, micro_batch=1), "reduce_scatter"),
                                          (ParallelConfig(dp=4, micro_batch=1), "all_reduce")])
def test_buckets_reduced_in_the_backward(config, kind):
    separate, fused, priced = _programs(config)
    assert separate.grad_sync is not None and fused.grad_sync is None
    # same collectives, same bytes per step (m = 1), and what the ILP priced
    assert _by_kind(count_collectives(fused.step)) == _by_kind(count_collectives(separate.step),
                                                               count_collectives(separate.grad_sync))
    priced_by_kind: dict = {}
    for (k, _), (calls, nbytes) in priced.items():
        entry = priced_by_kind.setdefault(k, [0, 0])
        entry[0] += calls
        entry[1] += nbytes
    assert _by_kind(count_collectives(fused.step)) == {k: tuple(v) for k, v in priced_by_kind.items()}

    # the gradient buckets' collectives: reduce-scatters (the step's own edges gather), and
    # in-place all-reduces (an edge's all-reduce, e.g. of the loss, is the functional one)
    target = {"reduce_scatter": "_c10d_functional.reduce_scatter", "all_reduce": "_c10d_functional.all_reduce_."}[kind]

    def syncs(gm):
        return [n for n in gm.graph.nodes if str(n.target).startswith(target)]

    assert syncs(separate.step) == []
    nodes = list(fused.step.graph.nodes)
    at = [nodes.index(n) for n in syncs(fused.step)]
    assert len(at) == len(syncs(separate.grad_sync))
    if kind == "reduce_scatter":  # one per layer, plus the head's/norm's and the embedding's
        assert len(at) >= LAYERS + 1
    matmuls = [i for i, n in enumerate(nodes) if n.target in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)]
    if kind == "reduce_scatter":
        # the first bucket is reduced before the backward's last matmul (during the backward),
        # not at the end as the separate sync does
        assert at[0] < matmuls[-1]
    # each bucket's wait is deferred (codegen/collectives.py GradSync.issue / wait): it comes
    # after backward ops issued after its collective, so the collective runs beside them
    # (what the cost model hides)
    waits = [next(u for u in n.users if "wait_tensor" in str(u.target)) for n in syncs(fused.step)]
    assert [nodes.index(w) for w in waits] == sorted(nodes.index(w) for w in waits)
    if kind == "all_reduce":  # in place: waited at the end of the step, holding nothing more
        assert all(nodes.index(w) > matmuls[-1] for w in waits)
    else:
        # one reduce-scatter in flight (FSDP's bound): each is waited as the next one starts,
        # after the backward matmuls between the two (the next layer's), so a layer's
        # full-size gradients are freed during the backward, not held to its end
        for k in range(len(at) - 1):
            assert at[k + 1] < nodes.index(waits[k]) < at[k + 1] + 8
        assert any(at[0] < i < nodes.index(waits[0]) for i in matmuls) and nodes.index(waits[0]) < matmuls[-1]
    # and the separate grad_sync graph issues every bucket before it waits on the first
    sep = list(separate.grad_sync.graph.nodes)
    issued = [sep.index(n) for n in syncs(separate.grad_sync)]
    first_wait = min(sep.index(u) for n in syncs(separate.grad_sync) for u in n.users
                     if "wait_tensor" in str(u.target))
    assert max(issued) < first_wait
    # the step returns the gradients in their parameters' placements
    assert "# grad_sync" not in fused.source and "gradients in their parameters' placements" in fused.source
