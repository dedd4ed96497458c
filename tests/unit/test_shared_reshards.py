"""An activation read by several ops of one phase is resharded once per placement: priced
once by the ILP (solver/intra_op/shared_rows.py), once by the solution, and run once by
the per-rank program (codegen/apply.py), whose every collective result is read.

Traced on a fake process group (no communication runs); tests/dist checks the numerics
and price = run on real gloo ranks."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.placement import Replicate, Shard, communicates
from autopar.placing import priced_per_step, solution_choices, solve_config
from autopar.trace import trace_step
from codegen.apply import apply, count_collectives
from codegen.emit import _clear_dtensor_caches
from solver.intra_op.shared_rows import SharedReshards

SPEC = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=16"


def test_rows_charge_each_placement_asked_once():
    """Two readers of u (owners 1 and 2) both asking for R from S(0): one reshard, its price
    counted once per twin layer; the readers' matrices keep 0 for it and forbidden pairs stay
    forbidden; its rows run over the readers' edge variables that make it, or over x where
    an owner pair has none."""
    s0, r = (Shard(0),), (Replicate(),)
    key = (("u", "forward"), s0, r)
    shared = SharedReshards()
    unit = [[5.0, 0.0], [None, 0.0]]  # rows: u at S(0) or R; columns: the reader asks R or S(0)
    kept_1 = shared.add_edge(("u", "forward"), 7, 0, [s0, r], 1, [r, s0], unit, 1.0)
    kept_2 = shared.add_edge(("u", "forward"), 7, 0, [s0, r], 2, [r, s0], unit, 1.0)
    assert kept_1 == kept_2 == [[0.0, 0.0], [None, 0.0]]
    assert shared.costs_s() == {key: 5.0}
    assert shared.pairs[key] == {(0, 1, (0,), (0,)), (0, 2, (0,), (0,))}
    assert shared.marks[(0, 1)] == [[frozenset({key}), frozenset()], [frozenset(), frozenset()]]
    # owner pair (0, 1) has edge variables (one per class pair), (0, 2) none: x's row there
    edges = {(0, 1): (None, [[0], [1]], [[0], [1]])}
    rows = shared.rows_of(key, {(0, 1): {(0, 0): "e00", (0, 1): "e01", (1, 1): "e11"}}, edges)
    assert rows == [([("e", "e00")], 0), ([("x", (0, 0)), ("x", (2, 0))], -1)]
    # a twin layer's activation (another node, the same owners) adds its multiplicity, no row
    shared.add_edge(("u", "forward"), 9, 0, [s0, r], 1, [r, s0], unit, 3.0)
    assert shared.costs_s() == {key: 5.0 * (1.0 + 3.0)}
    assert len(shared.pairs[key]) == 2
    # inside one owner: the options that move pay through the indicator, the others keep their price
    row = shared.add_within(("v", "forward"), 8, 4, [s0, s0, r], [r, s0, s0], [2.0, 0.0, None], 1.0)
    assert row == [0.0, 0.0, None]
    assert shared.rows_of((("v", "forward"), s0, r), {}, {}) == [([("x", (4, 0))], 0)]


def _program(config: ParallelConfig):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    source = resolve(SPEC)
    torch.manual_seed(0)
    example = source.example_inputs(config.dp * config.micro_batch, generator=torch.Generator().manual_seed(1))
    traced, graph = trace_step(source.build(), list(example))
    solution = solve_config(graph, config, Cluster.parse(f"cpu:{config.dp * config.tp}"), num_microbatches=1)
    choices = solution_choices(graph, solution)
    _clear_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=config.dp * config.tp)
    try:
        mesh = init_device_mesh("cpu", (config.dp, config.tp), mesh_dim_names=("dp", "tp"))
        program = apply(traced.gm, graph, choices, mesh, sync_in_step=True)
    finally:
        dist.destroy_process_group()
        _clear_dtensor_caches()
    return graph, solution, choices, program


def _shared_reads(graph, choices) -> dict:
    """{(activation, phase, target placements): readers} where two or more readers of one
    phase ask for the same placement and moving there communicates."""
    derived = graph.parameter_derived()
    asked: Counter = Counter()
    for v in graph.nodes:
        for p, u in enumerate(v.inputs):
            if u in derived or len(graph[u].outputs) != 1:
                continue
            want = choices[v.id].inputs[p]
            if communicates(choices[u].outputs[0], want):
                asked[(u, v.phase, want)] += 1
    return {k: n for k, n in asked.items() if n > 1}


def test_tensor_parallel_plan_reshards_each_shared_read_once():
    """dp2 x tp2 with ZeRO-3: the plan reshards some activation for two or more readers of
    one phase; the solution records that reshard once, and the per-rank program runs what
    was priced and reads every collective result. (That the ILP's objective charges shared
    reshards as the solution prices them: tests/unit/test_gather_groups.py, whose tp2 x dp2
    plan shares some.)"""
    config = ParallelConfig(dp=2, tp=2, zero=3, micro_batch=4)
    graph, solution, choices, program = _program(config)
    shared = _shared_reads(graph, choices)
    assert shared, "the plan resharded no activation for two readers: the test needs one that does"
    # the solution records one reshard per (activation, phase, placement), however many read it
    records = Counter((c.src, graph[c.dst].phase, c.kind, c.axis) for c in solution.collectives
                      if not c.gradient_sync and c.src not in graph.parameter_derived())
    for (u, phase, _want), readers in shared.items():
        assert all(n == 1 for (src, ph, _k, _a), n in records.items() if src == u and ph == phase), (u, readers)
    # the program runs what was priced, and reads every collective it runs
    counted: dict = {}
    for (kind, _axis), sizes in count_collectives(program.step).items():
        entry = counted.setdefault(kind, [0, 0])
        entry[0], entry[1] = entry[0] + len(sizes), entry[1] + sum(sizes)
    priced: dict = {}
    for (kind, _axis), (calls, nbytes) in priced_per_step(solution, 1, ("dp", "tp")).items():
        entry = priced.setdefault(kind, [0, 0])
        entry[0], entry[1] = entry[0] + calls, entry[1] + nbytes
    assert counted == priced
    unread = [n.name for n in program.step.graph.nodes
              if n.op == "call_function" and "wait_tensor" in str(n.target) and not n.users
              and not n.args[0].users.keys() - {n} and "all_reduce_." not in str(n.args[0].target)]
    assert not unread, f"collectives whose results nothing reads: {unread}"
