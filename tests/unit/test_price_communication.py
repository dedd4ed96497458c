"""`autopar price` splits the communication its time table charges by collective kind and
mesh axis (solver/comm_time.py), and the split closes: the rows of one time-table row add
up to its communication. Each kind's seconds are recomputed here from the solution's
collective records (`PricedCollective`) with the cost model's per-collective time function,
`cost_model.collective_time_s`, times the calls per step (weight x microbatches, once per
step for gradient syncs). Grouped weight all-gathers and bucketed gradient syncs are
included: their members' latency shares are against the groups and buckets the program
forms, so each record pays exactly one latency.

The solution and pipeline result are the priced plan's own, taken from the calls to
solver/comm_time.py as `autopar price` makes them (the real functions run)."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

import cost_model
import solver.pipeline_search as pipeline_search
from autopar.cli import main
from autopar.cluster import Cluster
from cost_model.collectives import collective_latency_s
from solver.comm_time import piece_factors
from solver.spmd_search import AXIS_NAMES


def _price(capsys, monkeypatch, args: list[str]) -> tuple[dict, dict]:
    """`autopar price ARGS --json` and the (solution or pipeline result) it split."""
    seen: dict = {}
    one, pipe, solve = (pipeline_search.one_stage_communication, pipeline_search.pipeline_communication,
                        pipeline_search.solve_candidate)
    solved: list = []

    def one_stage(solution, m):
        graph = next(s.graph for s in solved if s is not None and s.solution is solution)
        seen.update(solution=solution, m=m, graph=graph)
        return one(solution, m)

    def solve_candidate(*args, **kwargs):
        solved.append(solve(*args, **kwargs))
        return solved[-1]

    def pipeline(result, p2p_s):
        seen.update(result=result)
        return pipe(result, p2p_s)

    monkeypatch.setattr(pipeline_search, "one_stage_communication", one_stage)
    monkeypatch.setattr(pipeline_search, "pipeline_communication", pipeline)
    monkeypatch.setattr(pipeline_search, "solve_candidate", solve_candidate)
    assert main(["price", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out), seen


def _by_records(solution, m: int, links, factor=None) -> dict[tuple[str, str], float]:
    """Seconds per step per (kind, axis): every record through collective_time_s."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    for c in solution.collectives:
        calls = c.weight * (1 if c.gradient_sync else m) * (1.0 if factor is None else factor[c.dst])
        one = cost_model.Collective(kind=c.kind, axis=c.axis, bytes=c.bytes)
        out[(c.kind, AXIS_NAMES[c.axis])] += calls * cost_model.collective_time_s(one, links)
    return out


def _rows(out: dict) -> dict[tuple[str, str], dict]:
    return {(r["kind"], r["axis"]): r for r in out["communication"]}


@pytest.mark.parametrize("zero", ["0", "1"])
def test_one_stage_tp2_rows_close_on_reshard_and_match_the_records(capsys, monkeypatch, zero) -> None:
    """At zero 1 the updated weights are gathered too, once per step, in per-layer groups
    over dp (solver/intra_op/solution.py `update_gathers`)."""
    out, seen = _price(capsys, monkeypatch, ["llama-small", "--cluster", "cpu:4", "--global-batch", "8", "--tp", "2",
                                             "--zero", zero])
    solution, m = seen["solution"], seen["m"]
    rows = _rows(out)
    reshard = out["time_breakdown"]["reshard_s"]
    assert {r["part_of"] for r in rows.values()} == {"reshard_s"}
    assert sum(r["time_s"] for r in rows.values()) == pytest.approx(reshard, rel=1e-12)
    # the closure is against the solution's own per-node reshard, not only the parts
    assert reshard == pytest.approx(m * sum(c.weight * c.reshard_s for c in solution.choices), rel=1e-12)
    for r in rows.values():
        assert r["share"] == pytest.approx(r["time_s"] / out["step_time_s"])
    # counts and bytes are the plan's collectives (the existing table), kind by kind
    for kind, axis, count, nbytes in out["collectives"]:
        assert rows[(kind, axis)]["count"] == pytest.approx(count, abs=0.5)
        assert rows[(kind, axis)]["bytes"] == pytest.approx(nbytes, abs=0.5)
    links = cost_model.mesh_axis_links(Cluster.parse("cpu:4"), solution.mesh_shape)
    run = _by_records(solution, m, links)
    assert set(run) == {k for k in rows if k[0] != "local_copy"}
    for key in run:  # every kind, grouped weight gathers and gradient buckets included
        assert rows[key]["time_s"] == pytest.approx(run[key], rel=1e-9), key
    assert {("all_gather", "tp"), ("all_reduce", "dp"), ("reduce_scatter", "tp")} <= set(run)
    assert (("all_gather", "dp") in run) == (zero == "1")
    assert _partial_gather_groups(seen)  # groups gathering some, not all, of a layer's weights
    assert rows[("local_copy", "-")]["time_s"] > 0  # bucket copies: charged, no collective


def _partial_gather_groups(seen: dict) -> list:
    """The grouped weight gathers (all-gathers from a parameter-derived tensor) whose group
    holds fewer bytes than every parameter-derived tensor its layer and phase read: where
    a member's share against all of them would charge only part of the group's latency."""
    graph = seen["graph"]
    derived = graph.parameter_derived()
    read: dict[tuple, dict] = defaultdict(dict)
    for v in graph.nodes:
        for u in v.inputs:
            if u in derived and v.id not in derived and len(graph[u].outputs) == 1:
                read[(v.layer, v.phase.value)][u] = graph[u].output.size_bytes
    return [c for c in seen["solution"].collectives if c.kind == "all_gather" and c.src in derived
            and not c.gradient_sync and c.bytes < sum(read[(graph[c.dst].layer, graph[c.dst].phase.value)].values())]


def test_pipeline_rows_close_on_the_critical_stage_and_p2p(capsys, monkeypatch) -> None:
    out, seen = _price(capsys, monkeypatch, ["llama-small", "--cluster", "h100:16x8", "--global-batch", "1024",
                                             "--tp", "2", "--pp", "2", "--zero", "1"])
    result = seen["result"]
    sol, m = result.solution, result.candidate.num_microbatches
    k = max(range(len(sol.stage_times_s)), key=lambda i: sol.stage_times_s[i])
    sc = result.stages[k][0]
    rows = _rows(out)
    terms = out["time_breakdown"]
    factor = piece_factors(sc.graph, k, len(sol.stage_layers), sol.stage_layers[k])
    stage_reshard = m * sum(c.weight * factor[c.node] * c.reshard_s for c in sc.solution.choices)
    critical = [r for r in rows.values() if r["part_of"] == "critical_stage_s"]
    assert sum(r["time_s"] for r in critical) == pytest.approx(stage_reshard, rel=1e-12)
    assert 0 < stage_reshard < terms["critical_stage_s"]
    # the boundary sends are the p2p row: each message send_recv_time_s on the pp axis
    link = cost_model.mesh_axis_links(Cluster.parse("h100:16x8"), (2, 64))[0]
    sends = sum(cost_model.send_recv_time_s(size, link) * (2 if grad else 1) for size, grad in sc.boundary_messages)
    assert rows[("send_recv", "pp")]["time_s"] == terms["p2p_s"]
    assert terms["p2p_s"] == pytest.approx(m * sends * ((k > 0) + (k < 1)), rel=1e-12)
    links = cost_model.mesh_axis_links(Cluster.parse("h100:16x8").stage(64), sc.solution.mesh_shape)
    run = _by_records(sc.solution, m, links, factor)
    for key in ("all_reduce", "dp"), ("all_reduce", "tp"), ("reduce_scatter", "dp"):
        assert rows[key]["time_s"] == pytest.approx(run[key], rel=1e-9), key
        assert rows[key]["count"] > 0
    # each stage's collectives per microbatch (the plan's stage table) are its own pieces',
    # as the rows attribute them: the critical stage's x m are its rows' counts
    per_microbatch = {(name.split(" ", 2)[2], axis): count for name, axis, count, _ in out["collectives"]
                      if name.startswith(f"stage {k} ")}
    counted = {key: r["count"] for key, r in rows.items() if r["part_of"] == "critical_stage_s" and r["count"]}
    assert set(per_microbatch) == set(counted)
    for key, count in counted.items():
        assert m * per_microbatch[key] == pytest.approx(count, abs=m / 2), key


@pytest.mark.parametrize("spec", ["cpu:4", "h100:2x8"])
def test_pricer_parts_add_up_to_its_times_bit_for_bit(spec) -> None:
    """Every time the pricer charges is its parts' sum in order (cost_model `charged_s`),
    so the split cannot drift from the price: a plain reshard over both axes, a grouped
    gather and a bucketed gradient sync, each with its kinds and its local copy."""
    from autopar.ir import TensorMeta
    from autopar.placement import Partial, Replicate, Shard
    from cost_model import LOCAL_COPY, ReshardPricer, bucket_copy_s_per_byte, charged_s

    cluster = Cluster.parse(spec)
    mesh = (2, cluster.num_devices // 2)
    pricer = ReshardPricer(cost_model.mesh_axis_links(cluster, mesh), gloo=cost_model.runs_gloo(cluster.hardware),
                           copy_s_per_byte=bucket_copy_s_per_byte(cluster))
    meta = TensorMeta(shape=(1024, 512), dtype="float32")
    plain = pricer.reshard_parts(meta, (Partial(), Shard(0)), (Replicate(), Replicate()))
    assert [(kind, axis) for kind, axis, _ in plain] == [(c.kind, c.axis) for c in pricer.collectives(
        meta, (Partial(), Shard(0)), (Replicate(), Replicate()))] and len(plain) == 2
    assert charged_s(plain) == pricer(meta, (Partial(), Shard(0)), (Replicate(), Replicate()))
    gather = pricer.gather_parts(meta, (Replicate(), Shard(0)), (Replicate(), Replicate()), 0.25)
    assert [kind for kind, _, _ in gather] == ["all_gather", LOCAL_COPY] and gather[1][2] > 0
    assert charged_s(gather) == pricer.gather_time(meta, (Replicate(), Shard(0)), (Replicate(), Replicate()), 0.25)
    sync = pricer.grad_sync_parts(meta, (Partial(), Replicate()), (Replicate(), Replicate()), share=0.5)
    assert [kind for kind, _, _ in sync] == [LOCAL_COPY, "all_reduce"]
    assert charged_s(sync) == pricer.grad_sync_time(meta, (Partial(), Replicate()), (Replicate(), Replicate()),
                                                    share=0.5)
    # the all-reduce's part is its bandwidth term plus half its latency
    link = pricer.links[0]
    whole = cost_model.collective_time_s(cost_model.Collective(kind="all_reduce", axis=0, bytes=1024 * 512 * 4),
                                         pricer.links)
    assert sync[1][2] == pytest.approx(whole - 0.5 * collective_latency_s("all_reduce", link), rel=1e-12)
