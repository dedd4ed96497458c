"""A forced configuration (`--dp --tp --zero`) as constraints on the intra-op ILP.

Where it sits: solver/, read by the ILP's callers (the search's solver/spmd_search.py and
solver/pipeline_stages.py, and autopar/placing.py when it solves a configuration given by
flags). The per-op compiler has no templates: a
configuration does not say how each op is split, only what each mesh axis is for; the
ILP still chooses every placement within these rules.

The mesh of a configuration is (dp, tp) (pp stages each get one). On the axes:
- dp (data parallel): the data inputs are split by batch (Shard(0)); activations are
  never gathered over the axis (edges that would all-gather one are absent), so every
  rank computes on its own samples. Each parameter has a compute placement and a
  weight-update placement (autopar.sharding.NodeStrategy.update), and `zero` fixes both
  over dp (for parameters with a dim that dp divides; others stay whole):
  zero 0: compute and update replicated (gradients all-reduced);
  zero 1/2: compute replicated, update sharded (the optimizer steps the shard, the
  updated weights all-gathered once per step); zero 1 reduce-scatters the gradients once
  per step, after the microbatches accumulated them whole; zero 2 reduce-scatters each
  microbatch's gradients during its backward and accumulates the shards: m
  reduce-scatters per step instead of one, gradient memory 1/N (the ILP's
  `grads_each_microbatch`), in one-stage programs and pipeline stages alike;
  zero 3: compute and update sharded (gradients reduce-scattered, weights gathered for
  each use, the ILP placing the gathers).
- tp (tensor parallel): the data inputs are whole on every rank of the axis (Replicate);
  every parameter of two or more dims is sharded over the axis (on a dim the ILP picks;
  vectors such as norm weights may stay whole), so the axis splits the model.
The loss tangent is replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from autopar.config import ParallelConfig
from autopar.ir import GROUPED_MM_FWD, Graph, Node, Role
from autopar.placement import Placements, Replicate, Shard
from solver.intra_op.ilp import solve_intra_op
from solver.intra_op.space import enumerate_strategies

DP_AXIS, TP_AXIS = 0, 1
"""Mesh axes of a configuration's (dp, tp) mesh."""


def mesh_shape(config: ParallelConfig) -> tuple[int, int]:
    return (config.dp, config.tp)


def _shardable(shape: tuple[int, ...], size: int) -> bool:
    return any(d % size == 0 and d >= size for d in shape)


def keep_placeholder(config: ParallelConfig, *, update_free: bool = False):
    """The placeholder filter for `solve_intra_op(keep_placeholder=...)`. `update_free`: a
    parameter's compute placement over dp is the ILP's choice (whole, or sharded as under
    zero 3), not fixed by `config.zero`."""

    def keep(node: Node, placements: Placements) -> bool:
        shape = node.output.shape
        dp, tp = placements[DP_AXIS], placements[TP_AXIS]
        if node.role is Role.TANGENT:
            return all(isinstance(p, Replicate) for p in placements)
        if node.role is Role.INPUT:
            batch_split = config.dp > 1 and bool(shape) and shape[0] % config.dp == 0
            return (dp == Shard(0) if batch_split else isinstance(dp, Replicate)) and isinstance(tp, Replicate)
        if node.role is Role.PARAMETER:
            if config.ep > 1 and expert_stack(shape, config.ep):
                if dp != Shard(0):  # --ep: the experts are stored split on E over dp
                    return False
            elif config.dp > 1 and not update_free:
                sharded_dp = config.zero >= 3 and _shardable(shape, config.dp)
                if sharded_dp != isinstance(dp, Shard):
                    return False
            if config.tp > 1 and len(shape) >= 2 and _shardable(shape, config.tp):
                return isinstance(tp, Shard)
        return True

    return keep


def expert_stack(shape: tuple[int, ...], ep: int) -> bool:
    """Whether a parameter of `shape` is a stack of experts (three or more dims: routed
    experts [E, d, f]) that splits ep ways on its leading dim. Under `ParallelConfig.ep` such
    a parameter is stored split so over dp, each rank holding its own experts, beside any
    ZeRO layout of the others; under ZeRO 0-2 it is then computed where it is stored, never
    gathered (`weights_whole_axes`): expert parallelism over the data-parallel ranks
    (solver/intra_op/restrict.py exchange_nodes), as Megatron-Core and torchtitan run it
    beside ZeRO-1 for the dense weights."""
    return len(shape) >= 3 and shape[0] % ep == 0


def expert_moves(config: ParallelConfig, *, update_free: bool = False) -> bool:
    """Whether the ILP may move tokens over dp to experts split there (the dispatch and
    combine all-to-alls of expert parallelism: restrict.py exchange_nodes): where the
    experts may be split over dp for compute, under `ep`, ZeRO-3 or a free layout; under
    ZeRO 0-2 without `ep` they are whole over dp, and a move could only split compute that
    already is."""
    return config.dp > 1 and (update_free or config.zero >= 3 or config.ep > 1)


def rows_experts(graph: Graph) -> bool:
    """Whether the experts run through the grouped matmul of token rows (autopar/grouped_mm.py:
    Hugging Face's experts), which moves no tokens over dp."""
    return any(n.op == GROUPED_MM_FWD for n in graph.nodes)


def stacked_experts(graph: Graph) -> tuple[int, ...]:
    """The leading dim of each parameter of three or more dims (routed experts [E, d, f])
    that `ParallelConfig.ep` may split over dp; none where the experts run through the
    grouped matmul of token rows (autopar/grouped_mm.py: Hugging Face's experts), which
    moves no tokens over dp (`check_expert_degree`)."""
    if rows_experts(graph):
        return ()
    return tuple(n.output.shape[0] for n in graph.by_role(Role.PARAMETER) if len(n.output.shape) >= 3)


def check_expert_degree(graph: Graph, config: ParallelConfig, *, whole_model: bool = True) -> None:
    """Raises ValueError where `config.ep` > 1 has nothing to split: no parameter of three or
    more dims whose leading (expert) dim ep divides. A pipeline chunk (`whole_model` false)
    may hold no experts at all. Also where the experts run through the grouped matmul of
    token rows (autopar/grouped_mm.py: Hugging Face's experts), which moves no tokens over
    dp: their rows and experts cannot both split there."""
    if config.ep == 1:
        return
    if rows_experts(graph):
        raise ValueError(f"--ep {config.ep}: the experts of {graph.model.name} run through a grouped matmul of token "
                         "rows (Hugging Face's experts), which has no token exchange over dp, so they cannot be "
                         "split over the data-parallel ranks; drop --ep: the ILP may split them on E over tp "
                         "(--tp N) or keep them whole, and `autopar explain` says which and why")
    stacked = {n.param_name or n.name: n.output.shape[0] for n in graph.by_role(Role.PARAMETER)
               if len(n.output.shape) >= 3}
    if not stacked and whole_model:
        raise ValueError(f"--ep {config.ep}: {graph.model.name} has no routed experts to split (no parameter of "
                         "three or more dims, such as stacked expert weights [E, d, f]); drop --ep")
    if stacked and not any(e % config.ep == 0 for e in stacked.values()):
        name, e = next(iter(stacked.items()))
        raise ValueError(f"--ep {config.ep}: the experts of {graph.model.name} ({name}: E = {e}) do not split "
                         f"{config.ep} ways; use a --dp and --ep that divide {e}")


def weights_whole_axes(config: ParallelConfig, *, update_free: bool = False) -> tuple[int, ...]:
    """Axes on which no weight is gathered per use: dp under ZeRO 0-2 (weights are computed
    whole or, for experts split over dp, where they are stored; the ZeRO-1/2 gather of
    updated weights is the update edge's, once per step); none under ZeRO-3 or where the
    ILP chooses each parameter's layout."""
    return (DP_AXIS,) if config.dp > 1 and config.zero < 3 and not update_free else ()


def keep_update(config: ParallelConfig, *, update_free: bool = False):
    """The weight-update filter for `solve_intra_op(keep_update=...)`: the update differs
    from the compute placement only by a dp shard, under zero 1/2, wherever dp divides a dim.
    `update_free`: the ILP chooses per parameter whether to shard its update over dp."""

    def keep(node: Node, compute: Placements, update: Placements) -> bool:
        if update_free:
            return update == compute or (isinstance(compute[DP_AXIS], Replicate)
                                         and isinstance(update[DP_AXIS], Shard) and update[TP_AXIS] == compute[TP_AXIS])
        if update == compute:
            return isinstance(compute[DP_AXIS], Shard) or not (
                config.zero in (1, 2) and config.dp > 1 and _shardable(node.output.shape, config.dp))
        return config.zero in (1, 2) and isinstance(compute[DP_AXIS], Replicate) \
            and isinstance(update[DP_AXIS], Shard) and update[TP_AXIS] == compute[TP_AXIS]

    return keep


def zero_2_syncs(config: ParallelConfig) -> bool:
    """Whether `config`'s programs sync every microbatch's gradients to their update shard
    (zero 2 over a dp axis): the ILP's `grads_each_microbatch`, the runtime's in-step sync
    (autopar/build/one_stage.py, autopar/build/pipeline.py build_stage_runner)."""
    return config.zero == 2 and config.dp > 1


def gather_free_axes(config: ParallelConfig) -> tuple[int, ...]:
    return (DP_AXIS,) if config.dp > 1 else ()


def solve_stage(graph: Graph, config: ParallelConfig, cluster: Any, *, num_microbatches: int,
                keep_input: Callable[[Node, Placements], bool] | None = None,
                time_limit_s: float | None = None, space: Any = None, prune_memo: dict | None = None,
                update_free: bool = False) -> Any:
    """The intra-op ILP of a pipeline stage on its (dp, tp) submesh under `config`'s rules,
    its gradient syncs weighted 1 / num_microbatches (once per step; 1 under zero 2, whose
    stages sync every microbatch). One solve for both
    sides of a pipeline plan: the wiring solves each chunk's graph with `keep_input`
    holding its boundary inputs in the layout they travel in
    (autopar/placing.py solve_stage, before the ranks build), and the pipeline search prices every stage
    from this solve of the whole traced step (solver/pipeline_search.py), so what a stage
    is priced at is what it runs. `cluster`: the stage's devices (Cluster.stage); `space`:
    the graph's strategy enumeration on this mesh, where the caller has it; `prune_memo`:
    solver/intra_op/restrict.py prune_gather_free's, shared by the caller's solves."""
    check_expert_degree(graph, config, whole_model=False)
    base = keep_placeholder(config, update_free=update_free)
    zero2 = not update_free and zero_2_syncs(config)

    def keep(node: Node, placements: Placements) -> bool:
        if keep_input is not None and node.role is Role.INPUT:
            return keep_input(node, placements)
        return base(node, placements)

    return solve_intra_op(graph, cluster, mesh_shape(config), keep_placeholder=keep,
                          keep_update=keep_update(config, update_free=update_free),
                          gather_free_axes=gather_free_axes(config), grad_sync_weight=1.0 / num_microbatches,
                          weights_whole_axes=weights_whole_axes(config, update_free=update_free),
                          expert_moves=expert_moves(config, update_free=update_free),
                          time_limit_s=time_limit_s, space=space, prune_memo=prune_memo, grads_each_microbatch=zero2)


def solve_one_stage(graph: Graph, config: ParallelConfig, cluster: Any, *, num_microbatches: int,
                    space: Any = None, update_free: bool = False, memory_budget_bytes: float | None = None,
                    time_limit_s: float | None = None, cutoff_s: float | None = None) -> Any:
    """The intra-op ILP of a one-stage configuration under its rules (what a run solves before its ranks build:
    autopar/placing.py `solve_config`); `space`: the strategies to choose from (default:
    the graph's enumeration on the configuration's mesh). A one-stage program issues its
    weights' collectives ahead of their use (codegen/prefetch.py), and is priced so
    (`overlap_weights`)."""
    check_expert_degree(graph, config)
    return solve_intra_op(graph, cluster, mesh_shape(config),
                          keep_placeholder=keep_placeholder(config, update_free=update_free),
                          keep_update=keep_update(config, update_free=update_free),
                          gather_free_axes=gather_free_axes(config), num_microbatches=num_microbatches, space=space,
                          weights_whole_axes=weights_whole_axes(config, update_free=update_free),
                          expert_moves=expert_moves(config, update_free=update_free),
                          grads_each_microbatch=not update_free and zero_2_syncs(config),
                          memory_budget_bytes=memory_budget_bytes, time_limit_s=time_limit_s, cutoff_s=cutoff_s,
                          overlap_weights=True)


def price_solution(graph: Graph, config: ParallelConfig, solution: Any, cluster: Any, *,
                   num_microbatches: int) -> Any:
    """`solution`'s placements (a `solve_one_stage` solution) priced on
    `cluster`: the same ILP restricted to the strategy `solution` chose for every node, so
    the result is what another hardware profile charges for the program `solution` runs
    (a fresh solve on that profile may choose, and price, another program)."""
    mesh = mesh_shape(config)
    if tuple(solution.mesh_shape) != tuple(mesh):
        raise ValueError(f"price_solution: the solution is on mesh {solution.mesh_shape}, the configuration "
                         f"{config} on {mesh}")
    space = enumerate_strategies(graph, mesh)
    chosen = {c.node: (c.outputs, c.inputs, c.update) for c in solution.choices}
    kept = []
    for n, options in enumerate(space.strategies):
        if n not in chosen:
            kept.append(options)
            continue
        match = tuple(o for o in options if (o.outputs, o.inputs, o.update) == chosen[n])
        if not match:
            raise ValueError(f"price_solution: node {n} ({graph[n].name}) chose {chosen[n]}, which the strategy "
                             "space of this graph and mesh does not offer: the solution is of another graph")
        kept.append(match)
    restricted = replace(space, strategies=tuple(kept))
    return solve_one_stage(graph, config, cluster, num_microbatches=num_microbatches, space=restricted)
