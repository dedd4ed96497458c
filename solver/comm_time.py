"""Communication per step by collective kind and mesh axis, out of a priced plan's own charges.

Where it sits: solver/, after a configuration is priced (solver/pipeline_search.py
`search` with a fixed configuration, which `autopar price` runs). It splits the
communication the step time already holds; it prices nothing itself.

Why no second formula: every edge's reshard time is a sum of parts the pricer computes
(cost_model `ChargePart`: per collective, `collective_time_s`; for a grouped weight gather
or a bucketed gradient, the collective's bandwidth term plus the member's share of its one
latency, and a local copy), and the intra-op solution keeps those parts per node, weighted
as the node's `reshard_s` (`IntraOpSolution.reshard_parts`). So, with w_n the node's
multiplicity and m the microbatches per step:

    one stage:   seconds(kind, axis) = m * sum_n w_n * parts_n(kind, axis)
                 sum over (kind, axis) = m * sum_n w_n * reshard_n
                 overlapped = -m * (sync_hidden + gather_hidden) (the gradient sync hidden
                 behind the backward, cost_model `exposed_sync_s`, 0 where the program
                 syncs after it; the weights' collectives hidden behind the compute before
                 their use, `hidden_comm_s`)
                 sum over (kind, axis) + overlapped = the `reshard_s` row
    pipeline:    the critical stage k (the one `time_breakdown` names) runs its pieces
                 (solver/stage_costs.py: pre if k is first, n_k / L of the traced layers,
                 post if k is last), so
                 seconds(kind, axis) = m * sum_n w_n * f_piece(n) * parts_n(kind, axis),
                 f = 1 (pre, k = 0), n_k / L (layer), 1 (post, k = last), else 0:
                 the communication inside `critical_stage_s`; the boundary sends are the
                 whole `p2p_s` row (solver/pipeline_stages.py `boundary_p2p_s`).

Counts and bytes come from the solution's collective records (`PricedCollective`): a
record runs `weight` times per microbatch, or once per step for the gradient sync and the
gather of updated weights (`gradient_sync`); a pipeline's by the piece of the node that
reads it, with the same f. A bucket of gradients is one record, whose piece is its first
gradient's: in a pipeline the buckets are the whole traced graph's, and each stage is
charged its gradients' bytes' share of their latency (stage_costs prices pieces), so the
critical stage's count of bucketed syncs is an attribution, not the calls its program runs.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from autopar.estimate import CommunicationTime
from autopar.sharding import IntraOpSolution
from solver.spmd_search import AXIS_NAMES
from solver.stage_costs import node_pieces

LOCAL_AXIS_NAME = "-"
"""The axis column of a local copy (cost_model LOCAL_AXIS): no mesh axis."""


def collective_calls(solution: IntraOpSolution, num_microbatches: int,
                     factor: dict[int, float] | None = None) -> dict[tuple[str, str], tuple[float, float]]:
    """{(kind, axis name): (calls, bytes) per step} of the solution's collective records:
    `weight` x m per record (once per step for gradient syncs), x `factor[dst node]` where
    given (a pipeline stage's share of a piece)."""
    calls: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for c in solution.collectives:
        times = c.weight * (1 if c.gradient_sync else num_microbatches) * (1.0 if factor is None else factor[c.dst])
        entry = calls[(c.kind, AXIS_NAMES[c.axis])]
        entry[0] += times
        entry[1] += times * c.bytes
    return {k: (v[0], v[1]) for k, v in calls.items()}


def charged_seconds(solution: IntraOpSolution, num_microbatches: int,
                    factor: dict[int, float] | None = None) -> dict[tuple[str, str], float]:
    """{(kind or "local_copy", axis name or "-"): seconds per step}: m x sum over nodes of
    w_n x their reshard parts (x `factor[node]` where given)."""
    weight = {c.node: c.weight for c in solution.choices}
    out: dict[tuple[str, str], float] = defaultdict(float)
    for node, kind, axis, seconds in solution.reshard_parts:
        name = AXIS_NAMES[axis] if axis >= 0 else LOCAL_AXIS_NAME
        out[(kind, name)] += num_microbatches * weight[node] * seconds * (1.0 if factor is None else factor[node])
    return dict(out)


def _rows(seconds: dict[tuple[str, str], float], calls: dict[tuple[str, str], tuple[float, float]],
          part_of: str) -> list[CommunicationTime]:
    return [CommunicationTime(kind=kind, axis=axis, count=calls.get((kind, axis), (0.0, 0.0))[0],
                              bytes=calls.get((kind, axis), (0.0, 0.0))[1], time_s=seconds.get((kind, axis), 0.0),
                              part_of=part_of)
            for kind, axis in sorted(set(seconds) | set(calls))]


OVERLAPPED = "overlapped"
"""The kind of the row that takes the hidden collectives (the gradient sync behind the
backward, the weights' collectives behind the compute before their use) off the charged ones."""


def one_stage_communication(solution: IntraOpSolution, num_microbatches: int) -> tuple[CommunicationTime, ...]:
    """The `reshard_s` row of a one-stage plan by (kind, axis) (module docstring), and where
    the program overlaps collectives with compute, one `overlapped` row of
    -m x (sync_hidden_s + gather_hidden_s) (cost_model `exposed_sync_s`, `hidden_comm_s`):
    the kinds' rows are what the collectives take, that row what of them runs beside the
    compute, and together they add up to the `reshard_s` row the step waits for."""
    rows = _rows(charged_seconds(solution, num_microbatches), collective_calls(solution, num_microbatches),
                 "reshard_s")
    hidden = solution.cost.sync_hidden_s + solution.cost.gather_hidden_s
    if hidden:
        rows.append(CommunicationTime(kind=OVERLAPPED, axis=LOCAL_AXIS_NAME, count=0.0, bytes=0.0,
                                      time_s=-num_microbatches * hidden, part_of="reshard_s"))
    return tuple(rows)


def piece_factors(graph: Any, stage: int, num_stages: int, num_layers: int) -> dict[int, float]:
    """Per node of the traced graph: how much of it stage `stage` of `num_stages`, holding
    `num_layers` layers, runs per microbatch (module docstring's f, as solver/stage_dp.py
    `stage_time_s` adds up the pieces)."""
    share = {"pre": 1.0 if stage == 0 else 0.0, "layer": num_layers / max(1, graph.model.num_layers),
             "post": 1.0 if stage == num_stages - 1 else 0.0}
    return {n: share[p] for n, p in enumerate(node_pieces(graph))}


def pipeline_communication(result: Any, p2p_row_s: float) -> tuple[CommunicationTime, ...]:
    """The critical stage's communication per step by (kind, axis), part of
    `critical_stage_s`, and its boundary sends, the whole `p2p_s` row (`p2p_row_s`, as
    solver/pipeline_plans.py `pipeline_estimate` prices it) (module docstring).
    `result`: a solver/pipeline_stages.py PipelineResult."""
    sol, m = result.solution, result.candidate.num_microbatches
    k = max(range(len(sol.stage_times_s)), key=lambda i: sol.stage_times_s[i])
    sc = result.stages[k][0]
    num_stages = len(sol.stage_layers)
    factor = piece_factors(sc.graph, k, num_stages, sol.stage_layers[k])
    rows = _rows(charged_seconds(sc.solution, m, factor), collective_calls(sc.solution, m, factor),
                 "critical_stage_s")
    boundaries = result.schedule.chunks * ((k > 0) + (k < num_stages - 1))
    sends = sum(2 if grad else 1 for _size, grad in sc.boundary_messages)
    volume = sum(size * (2 if grad else 1) for size, grad in sc.boundary_messages)
    if boundaries and sends:
        rows.append(CommunicationTime(kind="send_recv", axis="pp", count=float(m * boundaries * sends),
                                      bytes=float(m * boundaries * volume), time_s=p2p_row_s, part_of="p2p_s"))
    return tuple(rows)
