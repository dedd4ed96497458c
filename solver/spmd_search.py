"""One-stage (pp = 1) candidates, each priced by the intra-op ILP that runs.

Where it sits: solver/, the one-stage half of the whole-plan search in
solver/pipeline_search.py `search` (which ranks these candidates beside pipelines and
builds the Plans). Here: the candidates, their ILP solve, their step price and the Plan of
one solved candidate, whose per-op placements (`Plan.placements`, its one chunk 0) are
exactly the program the runtime builds. autopar/api.py reads `op_placements` for a
pipeline stage's placements.

The space: every configuration dp x tp = devices (tp within a node, dividing the
attention heads) x every global microbatch g (a multiple of dp dividing the global batch
B; m = B / g microbatches) x every recompute policy (the caller sets it per candidate).
Each is solved by the intra-op ILP under the configuration's rules (solver/forced.py: the
batch split over dp, every matrix sharded over tp), with each parameter's compute and
update placement over dp the ILP's choice (ZeRO 0, 1 or 3 per parameter, `update_free`).
So a configuration is priced the same way wherever it is priced: `autopar price` solves the
same ILP for one configuration, and `autopar train --dp --tp` runs it; within the rules the
ILP places every op, with no template, minimising

    step_time = m * (per-microbatch compute + resharding)  +  gradient sync (once)
                + optimizer step over the local parameters (cost_model)

where the gradient sync is charged as exposed = max(S_last, S - rho W) when the program
overlaps it with the backward (one microbatch per step, or ZeRO-2 every microbatch:
cost_model `exposed_sync_s`), else in full,

which is the ILP objective times m (gradient edges weighted 1/m) plus the optimizer
(`estimate`: the step price, with the optimizer, the microbatches' gradient accumulation
and the loss report once per step).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable

import cost_model
from cost_model import core_share, grad_accumulation_time_s
from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.ir import Graph, Role, extrapolate_batch
from autopar.placement import Shard, format_placements, shard_factor
from autopar.plan import (
    Alternative,
    InfeasiblePlanError,
    IntraOpInfo,
    OpPlacement,
    Plan,
    SearchInfo,
    StagePlacements,
)
from autopar.sharding import IntraOpSolution, parameter_placement_text, raw_gradient_bytes
from solver import forced
from solver.forced import keep_placeholder, keep_update
from solver.intra_op.backend import CutoffExceeded
from solver.intra_op.space import coverage, enumerate_strategies
from solver.results import Ranked

log = logging.getLogger(__name__)

MAX_MICROBATCH_CHOICES = 3
"""Microbatch counts tried per mesh (the largest global microbatches first): more
microbatches only save activation memory, so beyond a few the ILP re-solves for nothing."""

AXIS_NAMES = ("dp", "tp")

TraceAt = Callable[..., Graph]
"""trace_at(global microbatch sequences, recompute="none") -> the lowered training step at
that batch, rewritten for the recomputation policy (autopar/recompute.py) as the runtime
traces it. A BatchScalingTracer (the zoo's models, whose structure does not depend on the
batch: autopar/api.py) lets `traced` extrapolate the traces at 2 and 4 sequences to other
microbatches instead of tracing each; any other model (a user's or Hugging Face module may
branch on its batch size) is traced at each."""


@dataclass(frozen=True, slots=True)
class BatchScalingTracer:
    """A TraceAt whose model's structure does not depend on its batch (the zoo's models):
    `traced` extrapolates its traces at 2 and 4 sequences to any other even microbatch."""

    trace_at: TraceAt

    def __call__(self, rows: int, recompute: str = "none") -> Graph:
        return self.trace_at(rows, recompute=recompute)


def traced(graphs: dict[Any, Graph], trace_at: TraceAt, microbatch: int, recompute: str = "none") -> Graph:
    """The memoised trace at `microbatch` sequences under `recompute` (keys: the microbatch
    for no recompute, shared with the pipeline stage costs; (microbatch, policy) else)."""
    def key_at(b: int) -> Any:
        return b if recompute == "none" else (b, recompute)

    key = key_at(microbatch)
    if key not in graphs:
        got = None
        if isinstance(trace_at, BatchScalingTracer) and microbatch > 4 and microbatch % 2 == 0:
            # the traces at 2 and 4 sequences give every other even microbatch (autopar.ir
            # extrapolate_batch: exact where the two differ as a batch scaling, else None)
            got = extrapolate_batch(traced(graphs, trace_at, 2, recompute), traced(graphs, trace_at, 4, recompute),
                                    microbatch)
        if got is None:
            got = trace_at(microbatch) if recompute == "none" else trace_at(microbatch, recompute=recompute)
        graphs[key] = got
    return graphs[key]


@dataclass(frozen=True, slots=True, kw_only=True)
class SpmdCandidate:
    mesh: tuple[int, int]
    microbatch: int
    """Sequences per global microbatch (over the whole mesh)."""
    num_microbatches: int
    recompute: str = "none"
    """The step is traced under this policy (autopar/recompute.py): the ILP prices the
    recomputed ops and the shorter lifetimes, and the runtime traces the same graph."""
    ep: int = 1
    """Expert parallelism over dp forced (ParallelConfig.ep: `autopar price --ep`); 1: the
    ILP's choice, within the memory budget."""

    @property
    def config(self) -> ParallelConfig:
        return ParallelConfig(dp=self.mesh[0], tp=self.mesh[1], micro_batch=self.microbatch // self.mesh[0],
                              zero=0, ep=self.ep, recompute=self.recompute)  # type: ignore[arg-type]


def mesh_candidates(cluster: Cluster, *, heads: int = 0, kv_heads: int = 0) -> list[tuple[int, int]]:
    """(dp, tp) over all devices, dp largest first: tp within a node (tensor-parallel
    collectives run every layer) and dividing the attention heads where the model has them."""
    n = cluster.num_devices
    out = []
    for dp in range(n, 0, -1):
        tp = n // dp
        if n % dp or tp > cluster.devices_per_node or cluster.devices_per_node % tp:
            continue
        if tp > 1 and ((heads and heads % tp) or (kv_heads and kv_heads % tp)):
            continue
        out.append((dp, tp))
    return out


def candidates(cluster: Cluster, global_batch: int, microbatch_choices: int = MAX_MICROBATCH_CHOICES, *,
               heads: int = 0, kv_heads: int = 0) -> list[SpmdCandidate]:
    """(dp x tp, microbatch g) pairs: g sequences split over dp (g % dp == 0), the largest
    `microbatch_choices` per mesh."""
    out = []
    for dp, tp in mesh_candidates(cluster, heads=heads, kv_heads=kv_heads):
        sizes = [g for g in range(global_batch, 0, -1) if global_batch % g == 0 and g % dp == 0]
        for g in sizes[:microbatch_choices]:
            out.append(SpmdCandidate(mesh=(dp, tp), microbatch=g, num_microbatches=global_batch // g))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Solved:
    candidate: SpmdCandidate
    graph: Graph
    solution: IntraOpSolution
    estimate: cost_model.Estimate
    coverage: float
    fallback_ops: tuple[str, ...]


def _local_parameters(graph: Graph, solution: IntraOpSolution) -> float:
    """The parameter elements a rank's optimizer steps: each parameter's update shard."""
    by_node = {c.node: c for c in solution.choices}
    total = 0.0
    for node in graph.by_role(Role.PARAMETER):
        c = by_node.get(node.id)
        if c is not None:
            update = c.outputs[0] if c.update is None else c.update
            total += node.output.numel * graph.weight(node.id) / shard_factor(update, solution.mesh_shape)
    return total


def memory_breakdown(graph: Graph, solution: IntraOpSolution) -> tuple[tuple[str, float], ...]:
    """The solution's peak per-device memory by component: the parameters' weights,
    gradients and optimizer state as the ILP charges them (cost_model.parameter_state_bytes
    at each parameter's compute and update placements, a tied alias being its parameter;
    the gradients are what the cost table charged beyond those: each raw gradient at its
    gradient node's placement, `raw_gradient_state_bytes`, or where the step syncs them in
    its backward, the synced ones with their parameters), and the rest of the ILP's peak,
    the live activations and temporaries at that point."""
    aliases = {alias for alias, _ in graph.tied_params}
    mesh = solution.mesh_shape
    parts = [0.0, 0.0, 0.0]
    for c in solution.choices:
        node = graph[c.node]
        if node.role is Role.GRADIENT:
            parts[1] += c.weight * c.memory_bytes
        if node.role is not Role.PARAMETER or c.node in aliases:
            continue
        update = c.outputs[0] if c.update is None else c.update
        weights, _, state = cost_model.parameter_state_bytes(node.output.numel, shard_factor(c.outputs[0], mesh),
                                                             shard_factor(update, mesh),
                                                             precision=graph.model.precision)
        parts[0] += c.weight * weights
        parts[2] += c.weight * state
        parts[1] += c.weight * max(0.0, c.memory_bytes - weights - state)
    activations = max(0.0, solution.cost.peak_memory_bytes - sum(parts))
    return (("weights_bytes", parts[0]), ("gradients_bytes", parts[1]), ("optimizer_state_bytes", parts[2]),
            ("activations_bytes", activations))


def _local_parameter_tensors(graph: Graph, solution: IntraOpSolution) -> float:
    """The parameter tensors a rank holds (one local shard each, whatever its placement; a
    tied alias is the same tensor): what the optimizer's per-tensor epilogue is paid on."""
    chosen = {c.node for c in solution.choices}
    aliases = {alias for alias, _ in graph.tied_params}
    return sum(graph.weight(node.id) for node in graph.by_role(Role.PARAMETER)
               if node.id in chosen and node.id not in aliases)


def derived_zero(graph: Graph, solution: IntraOpSolution) -> int:
    """3 when most parameter bytes are computed sharded over the first (dp) axis and
    gathered there for use, else 1 when most have their weight update sharded over it (2
    when the solution syncs the gradients every microbatch), else 0: a label for tables;
    the placements are the plan. A weight split over dp and never gathered there (experts
    stored split on E: expert parallelism) counts as an update shard, as under ZeRO-1."""
    by_node = {c.node: c for c in solution.choices}
    sharded = updated = whole = 0.0
    for node in graph.by_role(Role.PARAMETER):
        c = by_node.get(node.id)
        size = node.output.size_bytes * graph.weight(node.id)
        whole += size
        if c is not None and solution.mesh_shape[0] > 1:
            sharded += size * (isinstance(c.outputs[0][0], Shard) and not _split_where_used(graph, by_node, node.id))
            updated += size * isinstance((c.outputs[0] if c.update is None else c.update)[0], Shard)
    if whole and sharded / whole > 0.5:
        return 3
    if whole and updated / whole > 0.5:
        return 2 if solution.grads_each_microbatch else 1
    return 0


def _split_where_used(graph: Graph, by_node: dict, param: int) -> bool:
    """Whether every op reading `param` (or a view or cast of it) reads it split over the
    first (dp) axis: it is computed where it is stored, never gathered there."""
    derived = graph.parameter_derived()
    todo, seen = [param], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in graph.users(n):
            if user in derived:
                todo.append(user)
                continue
            c = by_node.get(user)
            if c is not None and any(u == n and not isinstance(c.inputs[k][0], Shard)
                                     for k, u in enumerate(graph[user].inputs)):
                return False
    return True


def zero_is_uniform(graph: Graph, solution: IntraOpSolution, config: ParallelConfig) -> bool:
    """Whether every parameter's (compute, update) placement is one that `config`'s ZeRO
    layout allows (solver/forced.py's rules): then solving under that layout finds this
    solution's objective, since it is feasible there and the layout's space is a subset."""
    keep, keep_up = keep_placeholder(config), keep_update(config)
    by_node = {c.node: c for c in solution.choices}
    for node in graph.by_role(Role.PARAMETER):
        c = by_node.get(node.id)
        if c is None:
            continue
        compute = c.outputs[0]
        if not keep(node, compute) or not keep_up(node, compute, compute if c.update is None else c.update):
            return False
    return True


def loss_report_s(graph: Graph, solution: IntraOpSolution, cluster: Cluster,
                  world_link: cost_model.AxisLink | None = None) -> float:
    """The step's loss reduced for reporting, from the loss's chosen placement on this
    solution's mesh (cost_model.loss_report_time_s; `world_link` for a pipeline)."""
    placements = solution.choice(graph.loss).outputs[0]
    return cost_model.loss_report_time_s(placements, cost_model.mesh_axis_links(cluster, solution.mesh_shape),
                                         world_link)


def exposed_reshard_s(solution: IntraOpSolution) -> float:
    """The solution's resharding per microbatch that the step waits for: its `reshard_s`
    less the gradient sync hidden behind the backward (`CostBreakdown.sync_hidden_s`,
    cost_model `exposed_sync_s`) and the weights' collectives hidden behind the compute
    before their use (`gather_hidden_s`, cost_model `hidden_comm_s`): the `reshard_s` row
    of the step's time breakdown."""
    return solution.cost.reshard_s - solution.cost.sync_hidden_s - solution.cost.gather_hidden_s


def estimate(graph: Graph, solution: IntraOpSolution, cand: SpmdCandidate, cluster: Cluster,
             global_batch: int) -> cost_model.Estimate:
    """Step time, throughput and memory of a solved candidate (the ILP's own costs)."""
    m = cand.num_microbatches
    per_micro = solution.cost.total_s  # gradient-sync edges already weighted 1/m
    optimizer = cost_model.optimizer_time_s(_local_parameters(graph, solution), cluster.hardware,
                                            tensors=_local_parameter_tensors(graph, solution)) * core_share(cluster)
    # i15c: the microbatches' gradient accumulation (cost_model.compute.grad_accumulation_time_s)
    accumulate = grad_accumulation_time_s(sum(raw_gradient_bytes(graph, solution).values()), m, 1, cluster.hardware) \
        * core_share(cluster)
    report = loss_report_s(graph, solution, cluster)
    step = m * per_micro + optimizer + accumulate + report
    devices = cluster.num_devices
    tokens = global_batch * graph.model.seq
    flops = graph.flops_per_step * m
    peak_flops = cluster.hardware.peak_flops(graph.model.dtype)
    tflops = flops / step / devices / 1e12 if step else 0.0
    budget = cluster.device_memory_bytes
    peak = int(solution.cost.peak_memory_bytes)
    config = replace(cand.config, zero=derived_zero(graph, solution))
    cfg = dict(config.to_json(), num_microbatches=m)
    return cost_model.Estimate(
        step_time_s=step, tokens_per_s=tokens / step if step else 0.0,
        tokens_per_s_per_device=tokens / step / devices if step else 0.0, model_tflops_per_device=tflops,
        mfu=tflops * 1e12 / peak_flops if peak_flops else 0.0, peak_memory_bytes=peak, fits=peak <= budget,
        memory_limit_bytes=int(budget),
        time_breakdown=(("compute_s", m * solution.cost.compute_s), ("reshard_s", m * exposed_reshard_s(solution)),
                        ("optimizer_s", optimizer), ("grad_accum_s", accumulate), ("loss_report_s", report)),
        memory_breakdown=memory_breakdown(graph, solution), config=tuple(sorted(cfg.items())),
        hardware_tflops_per_device=tflops)


def solve_candidate(trace_at: TraceAt, cand: SpmdCandidate, cluster: Cluster, global_batch: int, *,
                    graphs: dict[Any, Graph], time_limit_s: float | None,
                    smallest: list[float] | None = None, cutoff_step_s: float | None = None,
                    zero: int | None = None, reasons: list[str] | None = None) -> Solved | None:
    """The ILP for one candidate (None when nothing fits its memory; the smallest memory it
    needs is appended to `smallest`). With `cutoff_step_s`, raises
    solver.intra_op.CutoffExceeded when the ILP's LP relaxation proves the step time at
    least that (m x its bound on the objective, which is the step time / m: the
    per-microbatch costs plus the optimizer and accumulation terms / m). `zero`: the ZeRO
    layout the configuration fixes (solver/forced.py); None: each parameter's is the ILP's.
    `reasons` collects why the ILP found no plan."""
    graph = traced(graphs, trace_at, cand.microbatch, cand.recompute)
    space = enumerate_strategies(graph, cand.mesh)
    try:
        config = cand.config if zero is None else replace(cand.config, zero=zero)
        cutoff_s = None if cutoff_step_s is None else cutoff_step_s / cand.num_microbatches
        solution = forced.solve_one_stage(graph, config, cluster, num_microbatches=cand.num_microbatches, space=space,
                                          update_free=zero is None, memory_budget_bytes=cluster.device_memory_bytes,
                                          time_limit_s=time_limit_s, cutoff_s=cutoff_s)
    except InfeasiblePlanError as exc:
        if smallest is not None and exc.min_memory_bytes is not None:
            smallest.append(exc.min_memory_bytes)
        if reasons is not None:
            reasons.append(str(exc))
        return None
    except RuntimeError as exc:  # the per-solve time limit ended the ILP before any plan: none found
        log.info("candidate %s: %s", cand, exc)
        return None
    solved = Solved(candidate=cand, graph=graph, solution=solution,
                    estimate=estimate(graph, solution, cand, cluster, global_batch),
                    coverage=coverage(graph, space), fallback_ops=space.fallback_ops)
    if zero is None and cand.mesh[0] > 1 and cand.num_microbatches > 1 and derived_zero(graph, solution) == 3:
        # the memory budget pushed weights to ZeRO-3 (gathered per use): ZeRO-2 keeps them
        # whole and holds a gradient shard only (each microbatch reduce-scattered), which
        # may fit and run faster; the ILP models it as `grads_each_microbatch`
        bound = solved.estimate.step_time_s if cutoff_step_s is None else min(cutoff_step_s,
                                                                               solved.estimate.step_time_s)
        try:  # it must beat this solution (and the search's cutoff): its LP bound prunes it first
            zero2 = solve_candidate(trace_at, cand, cluster, global_batch, graphs=graphs, time_limit_s=time_limit_s,
                                    zero=2, cutoff_step_s=bound)
        except CutoffExceeded:
            zero2 = None
        if zero2 is not None and zero2.estimate.step_time_s < solved.estimate.step_time_s:
            return zero2
    return solved


def op_placements(graph: Graph, solution: IntraOpSolution) -> tuple[OpPlacement, ...]:
    """One entry per distinct node key (layer-shared nodes have one choice)."""
    by_node = {c.node: c for c in solution.choices}
    seen: dict[str, OpPlacement] = {}
    for node, key in zip(graph.nodes, graph.node_keys()):
        c = by_node[node.id]
        seen.setdefault(key, OpPlacement(key=key, op=node.op, outputs=tuple(format_placements(p) for p in c.outputs),
                                         inputs=tuple(format_placements(p) for p in c.inputs),
                                         update=format_placements(c.update) if c.update is not None else ""))
    return tuple(seen.values())


def intra_op_info(graph: Graph, solved: Solved) -> IntraOpInfo:
    sol = solved.solution
    m = solved.candidate.num_microbatches
    calls: Counter = Counter()
    volume: Counter = Counter()
    for c in sol.collectives:
        times = c.weight * (1 if c.gradient_sync else m)
        key = (c.kind, AXIS_NAMES[c.axis])
        calls[key] += times
        volume[key] += times * c.bytes
    collectives = tuple((k, a, int(round(calls[(k, a)])), int(round(volume[(k, a)]))) for k, a in sorted(calls))
    return IntraOpInfo(status=sol.status, coverage=solved.coverage, fallback_ops=solved.fallback_ops,
                       num_variables=sol.num_variables, collectives=collectives,
                       time_s=(("compute_s", m * sol.cost.compute_s), ("reshard_s", m * exposed_reshard_s(sol))),
                       parameters=parameter_placements(graph, sol))


def parameter_placements(graph: Graph, solution: IntraOpSolution) -> tuple[tuple[str, str], ...]:
    """(name, placement) per parameter, the layers' under `layers.*` once per layer group."""
    by_node = {c.node: c for c in solution.choices}
    out: dict[str, str] = {}
    for node in graph.by_role(Role.PARAMETER):
        name = node.param_name or node.name
        if node.layer is not None:
            name = re.sub(r"\.\d+\.", ".*.", name, count=1)
        out.setdefault(name, parameter_placement_text(by_node[node.id]))
    return tuple(out.items())


def spmd_plan(best: Solved, ranked: tuple[Ranked, ...], cluster: Cluster, *, global_batch: int, model: str,
          fingerprint: str, num_candidates: int, not_fit: int) -> Plan:
    graph, est = best.graph, best.estimate
    first = ranked[0]
    alternatives = tuple(Alternative(config=r.config, stage_layers=r.stage_layers, step_time_s=r.estimate.step_time_s,
                                     peak_memory_bytes=int(r.estimate.peak_memory_bytes), fits=bool(r.estimate.fits))
                         for r in ranked[1:9])
    info = SearchInfo(cost_model="solver.intra_op (per-op ILP)", num_candidates=num_candidates,
                      num_priced=num_candidates, num_pruned_memory=0, num_pruned_dominated=0,
                      num_not_fitting=not_fit, complete=True, alternatives=alternatives)
    config = first.config
    return Plan(model=model, model_fingerprint=fingerprint, num_layers=first.stage_layers[0], seq=graph.model.seq,
                global_batch=global_batch, cluster=cluster.spec, memory_limit_bytes=int(cluster.device_memory_bytes),
                config=config, stage_layers=first.stage_layers, mesh_shape=(1, config.dp, config.tp), stages=(),
                predicted=est, search=info,
                placements=(StagePlacements(chunk=0, placements=op_placements(graph, best.solution)),),
                intra_op_info=intra_op_info(graph, best))
