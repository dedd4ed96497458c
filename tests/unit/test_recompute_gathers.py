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
CONFIG = ParallelConfig(dp=4, zero=3, micro_batch=1, recompute="full")


def _solved():
    source = resolve(f"llama:layers={LAYERS},hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=16")
    torch.manual_seed(0)
    example = source.example_inputs(CONFIG.dp, generator=torch.Generator().manual_seed(1))
    traced, graph = trace_step(source.build(), list(example), recompute="full")
    solution = solve_config(graph, CONFIG, Cluster.parse("cpu:4"), num_microbatches=1)
    return traced, graph, solution


def _root(graph, n: int) -> int:
    """The parameter a parameter-derived value is computed from (its first input's, down)."""
    while graph[n].role is not Role.PARAMETER:
        n = graph[n].inputs[0]
    return n


def test_each_weight_is_gathered_once_per_layer_and_phase():
    _traced, graph, solution = _solved()
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


def test_the_program_runs_the_priced_gathers():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    traced, graph, solution = _solved()
    choices = solution_choices(graph, solution)
    _clear_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=CONFIG.dp)
    try:
        mesh = init_device_mesh("cpu", (CONFIG.dp, 1), mesh_dim_names=("dp", "tp"))
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
    assert tuple(ran["all_gather"]) == priced[("all_gather", "dp")]
    # forward and backward each gather every layer once (one flat all-gather per layer and
    # phase), plus the embedding's and the head's
    assert ran["all_gather"][0] <= 2 * LAYERS + 4
