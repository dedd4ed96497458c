"""ZeRO-3 under full recompute gathers each weight once per phase, as FSDP unshards a unit
once for its recomputed forward and its backward together, and the program runs the
gathers the ILP priced.

Before, the recompute rewrite copied a weight's transpose into the backward (a value
computed from parameters alone, not an activation) and the backward's own transpose of
it followed its forward producer's sharded layout, so the backward gathered every
matrix twice: the 405B Llama at tp8 x dp16 moved 1.7 layers' weights per layer in its
backward instead of one (autopar/recompute.py, solver/intra_op/sharing.py).

Traced on a fake process group of 4 ranks (no communication runs); tests/dist checks the
numerics of ZeRO-3 with full recompute on real gloo ranks (test_train_numerics.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.ir import Role
from autopar.models import resolve
from autopar.placement import single_gather_axis
from autopar.placing import priced_per_step, solution_choices, solve_config
from autopar.trace import trace_step
from codegen.apply import apply, count_collectives
from codegen.emit import _clear_dtensor_caches

LAYERS = 3
CONFIGS = [ParallelConfig(dp=4, zero=3, micro_batch=1, recompute="full"),
           ParallelConfig(dp=2, tp=2, zero=3, micro_batch=2, recompute="full")]
IDS = ["dp4", "dp2xtp2"]


def _solved(config: ParallelConfig):
    source = resolve(f"llama:layers={LAYERS},hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=16")
    torch.manual_seed(0)
    example = source.example_inputs(config.dp * config.micro_batch, generator=torch.Generator().manual_seed(1))
    traced, graph = trace_step(source.build(), list(example), recompute="full")
    solution = solve_config(graph, config, Cluster.parse("cpu:4"), num_microbatches=1)
    return traced, graph, solution


def _root(graph, n: int) -> int:
    """The parameter a parameter-derived value is computed from (its first input's, down)."""
    while graph[n].role is not Role.PARAMETER:
        n = graph[n].inputs[0]
    return n


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_each_weight_is_gathered_once_per_layer_and_phase(config):
    _traced, graph, solution = _solved(config)
    derived = graph.parameter_derived()
    choice = {c.node: c for c in solution.choices}
    gathered: dict[tuple, set] = {}
    for v in graph.nodes:
        for p, u in enumerate(v.inputs):
            if u in derived and v.id in choice and u in choice \
                    and single_gather_axis(choice[u].outputs[0], choice[v.id].inputs[p]) == 0:
                gathered.setdefault((v.layer, v.phase.value), set()).add((u, choice[u].outputs[0],
                                                                         choice[v.id].inputs[p]))
    layer_matrices = {p.id for p in graph.by_role(Role.PARAMETER) if p.layer is not None and len(p.output.shape) == 2}
    for layer in range(LAYERS):
        for phase in ("forward", "backward"):
            roots = [_root(graph, u) for u, _, _ in gathered[(layer, phase)]]
            assert len(roots) == len(set(roots)), f"layer {layer} {phase}: a weight gathered twice"
            # every matrix of the layer is read in both phases (the recomputed forward and the
            # gradient matmuls), and gathered there
            assert {r for r in roots if r in layer_matrices} == {m for m in layer_matrices if graph[m].layer == layer}


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_the_program_runs_the_priced_gathers(config):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    traced, graph, solution = _solved(config)
    choices = solution_choices(graph, solution)
    _clear_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=config.dp * config.tp)
    try:
        mesh = init_device_mesh("cpu", (config.dp, config.tp), mesh_dim_names=("dp", "tp"))
        program = apply(traced.gm, graph, choices, mesh)
    finally:
        dist.destroy_process_group()
        _clear_dtensor_caches()
    ran: dict = {}
    for gm in (program.step, program.grad_sync):
        if gm is None:
            continue
        for (kind, _), sizes in count_collectives(gm).items():
            entry = ran.setdefault(kind, [0, 0])
            entry[0] += len(sizes)
            entry[1] += sum(sizes)
    priced = priced_per_step(solution, 1, ("dp", "tp"))
    assert tuple(ran["all_gather"]) == tuple(map(sum, zip(*(v for (k, _), v in priced.items() if k == "all_gather"))))
    if config.tp == 1:  # forward and backward each gather every layer once (one flat all-gather
        # per layer and phase), plus the embedding's and the head's
        assert ran["all_gather"][0] <= 2 * LAYERS + 4
