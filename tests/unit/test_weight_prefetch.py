"""The weights' collectives issued ahead of their use (codegen/prefetch.py) and priced so
(solver/intra_op/overlap_rows.py, cost_model `hidden_comm_s`).

The program: in a ZeRO-3 plan's step graph every weight all-gather but each phase's first
is issued right after the one before it is waited and copied out of its flat buffer,
ahead of the compute that runs before its own wait; the graph computes the same values
with the same collectives.
The price: on hardware that overlaps (comm_overlap 1), a one-stage solve takes
min(hideable, rho W) per phase off, in the ILP's objective and the solution's price alike;
the built-in cpu profile hides nothing (comm_overlap 0, measured)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import cost_model
from autopar.cluster import HARDWARE, Cluster
from autopar.config import ParallelConfig
from autopar.ir import Phase
from autopar.models import resolve
from autopar.placing import solution_choices, solve_config
from autopar.trace import trace_step
from codegen.apply import apply, count_collectives
from codegen.emit import _clear_dtensor_caches
from codegen.prefetch import _is_collective, _is_wait, backward_start, prefetch_program, weights_only
from solver.comm_time import OVERLAPPED, one_stage_communication
from solver.forced import price_solution
from solver.intra_op import ilp

SPEC = "llama:layers=3,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=16"
OVERLAPPING = Cluster.parse("cpu:4", hardware=replace(HARDWARE["cpu"], comm_overlap=1.0))
EXPOSED = Cluster.parse("cpu:4")


def _traced(config: ParallelConfig):
    source = resolve(SPEC)
    torch.manual_seed(0)
    example = source.example_inputs(config.dp * config.micro_batch, generator=torch.Generator().manual_seed(1))
    return trace_step(source.build(), list(example))


def _program(config: ParallelConfig):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    traced, graph = _traced(config)
    solution = solve_config(graph, config, EXPOSED, num_microbatches=1)
    choices = solution_choices(graph, solution)
    _clear_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=config.dp * config.tp)
    try:
        mesh = init_device_mesh("cpu", (config.dp, config.tp), mesh_dim_names=("dp", "tp"))
        return apply(traced.gm, graph, choices, mesh, sync_in_step=True)
    finally:
        dist.destroy_process_group()
        _clear_dtensor_caches()


def _weight_collectives(program):
    placeholders = [n for n in program.step.graph.nodes if n.op == "placeholder"]
    weights = {n.name for n, s in zip(placeholders, program.slots) if s.role.value == "parameter"}
    derived = weights_only(program.step, weights)
    nodes = list(program.step.graph.nodes)
    return nodes, [n for n in nodes if _is_collective(n) and n in derived]


def _buffer_reads(wait) -> list:
    """The nodes that read a gathered flat buffer: past the views the interpreter takes of
    it (rows, their slices), the copies out into each weight."""
    views = ("aten.view.default", "aten.select.int", "aten.slice.Tensor")
    reads, stack = [], [wait]
    while stack:
        for u in stack.pop().users:
            (stack if str(u.target) in views else reads).append(u)
    assert reads and all(str(r.target) == "aten.cat.default" for r in reads), reads
    return reads


def test_zero3_program_issues_each_weight_gather_after_the_previous_wait():
    program = _program(ParallelConfig(dp=4, zero=3, micro_batch=1))
    before = count_collectives(program.step)
    nodes, gathers = _weight_collectives(program)
    assert len(gathers) >= 4, "a ZeRO-3 step gathers weights per layer and phase"
    # as recorded, each gather is waited at once: nothing runs beside it
    position = {n: i for i, n in enumerate(nodes)}
    gaps = [position[min((u for u in g.users if _is_wait(u)), key=position.__getitem__)] - position[g]
            for g in gathers]
    assert max(gaps) == 1
    moved = prefetch_program(program)
    nodes, gathers = _weight_collectives(program)
    position = {n: i for i, n in enumerate(nodes)}
    backward = backward_start(program)
    assert backward is not None and "nll_loss_backward" in str(backward.target), backward
    forward = [g for g in gathers if position[g] < position[backward]]
    assert forward and len(forward) < len(gathers), "gathers in both phases"
    assert moved == len(gathers) - 2  # all but each phase's first
    first_wait = {g: min((u for u in g.users if _is_wait(u)), key=position.__getitem__) for g in gathers}
    for earlier, later in zip(gathers, gathers[1:]):
        # issued right after the previous one's wait (or its input's packing), before its own;
        # the backward's first stays in the backward, where its phase needs it
        assert position[first_wait[earlier]] < position[later] < position[first_wait[later]]
        if later is gathers[len(forward)]:
            assert position[later] > position[backward]
            continue
        # and after the earlier group's gathered buffer is copied out into its weights: the two
        # groups' flat buffers are never live together
        assert max(position[r] for r in _buffer_reads(first_wait[earlier])) < position[later]
        between = nodes[position[first_wait[earlier]] + 1:position[later]]
        assert all(n in weights_only(program.step, {p.name for p in nodes if p.op == "placeholder"}) for n in between)
    # compute runs between issue and wait for the prefetched gathers
    ops = [sum(1 for n in nodes[position[g] + 1:position[first_wait[g]]] if n.op == "call_function"
               and not _is_wait(n) and not _is_collective(n)) for g in gathers if g not in (gathers[0], gathers[len(forward)])]
    assert sum(1 for k in ops if k > 2) >= len(ops) // 2
    # same collectives, same bytes; the graph is well formed and its source follows it
    assert count_collectives(program.step) == before
    program.step.graph.lint()
    assert program.source.count("wait_tensor") >= len(gathers)


def _with_objective(solve):
    """(the ILP's objective, the solution) of the one solve `solve()` runs."""
    captured = {}
    original = ilp.solve

    def spy(milp, *args, **kwargs):
        solved = original(milp, *args, **kwargs)
        captured["objective"] = milp.objective(solved.values) / ilp.OBJECTIVE_SCALE
        return solved

    ilp.solve = spy
    try:
        solution = solve()
    finally:
        ilp.solve = original
    return captured["objective"], solution


@pytest.mark.parametrize("zero, m", [(3, 1), (3, 2)])
def test_price_takes_off_the_hidden_gathers_as_the_ilp_charges_them(zero, m):
    config = ParallelConfig(dp=4, zero=zero, micro_batch=1)
    graph = _traced(config)[1]
    own = solve_config(graph, config, OVERLAPPING, num_microbatches=m)
    cost = own.cost
    assert cost.gather_hidden_s > 0
    assert cost.total_s == pytest.approx(cost.compute_s + cost.comm_s + cost.reshard_s - cost.sync_hidden_s
                                         - cost.gather_hidden_s, rel=1e-12)
    # the same placements priced with and without overlap: the same collectives; the hidden
    # part is all that differs, in the objective exactly as in the price (the objective's
    # own gap to the price, tie-breakers and expected bucket sizes, is the same in both)
    objective, again = _with_objective(lambda: price_solution(graph, config, own, OVERLAPPING, num_microbatches=m))
    exposed_objective, exposed = _with_objective(
        lambda: price_solution(graph, config, own, EXPOSED, num_microbatches=m))
    assert again.cost.total_s == pytest.approx(cost.total_s, rel=1e-12)
    assert exposed.cost.gather_hidden_s == 0 == exposed.cost.sync_hidden_s
    assert exposed.cost.reshard_s == pytest.approx(cost.reshard_s, rel=1e-12)
    hidden = cost.sync_hidden_s + cost.gather_hidden_s
    assert exposed.cost.total_s == pytest.approx(cost.total_s + hidden, rel=1e-12)
    assert exposed_objective - objective == pytest.approx(hidden, rel=1e-6)
    # hidden <= rho x each phase's compute: the forward's window for the forward's
    # gathers, the backward's for the sync and the backward's gathers together
    rho = cost_model.grad_sync_overlap(OVERLAPPING)
    forward = sum(c.weight * c.compute_s for c in own.choices if graph[c.node].phase is Phase.FORWARD)
    backward = sum(c.weight * c.compute_s for c in own.choices if graph[c.node].phase is Phase.BACKWARD)
    assert hidden <= rho * (forward + backward) * (1 + 1e-9)
    # the per-kind table adds up to what the step waits for
    rows = one_stage_communication(own, m)
    assert [r.time_s for r in rows if r.kind == OVERLAPPED] == [pytest.approx(-m * hidden)]
    assert sum(r.time_s for r in rows) == pytest.approx(m * (cost.reshard_s - hidden), rel=1e-9)


def test_weights_whole_plans_hide_no_gather():
    config = ParallelConfig(dp=4, zero=1, micro_batch=1)
    graph = _traced(config)[1]
    solution = solve_config(graph, config, OVERLAPPING, num_microbatches=2)
    assert solution.cost.gather_hidden_s == 0


def test_hidden_comm_formula():
    assert cost_model.hidden_comm_s(1.0, 3.0, 0.5) == 1.0  # all of it: the window is long
    assert cost_model.hidden_comm_s(1.0, 1.0, 0.5) == 0.5  # rho x the window
    assert cost_model.hidden_comm_s(1.0, 1.0, 0.0) == 0.0
    assert cost_model.hidden_comm_s(-1.0, 1.0, 0.5) == 0.0
