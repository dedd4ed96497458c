"""Intra-op choices from the ILP (solver/intra_op/ilp.py) for a chosen plan, memoised.

Where it sits: benchmarks/baselines/template/, an optional `intra_op_fn` for the template
grid (search.py here). That search ranks candidates with the cost model's config template
(Megatron tp + dp); this module then solves the intra-op ILP for the chosen plan's repeated
layer on one pipeline stage's (dp, tp) submesh and records, per parameter, the placement
the ILP picked and the ILP objective in the search's result, so its explanation can show
where the ILP agrees with the template. The ILP is solved once per distinct (layer group
signature, submesh) and memoised in the caller-owned `cache` (no process-global state).

It does not change the ranking: the cost model prices the template; feeding ILP costs
back into pricing needs per-layer overrides in cost_model (not there yet).
"""

from __future__ import annotations

import re
from dataclasses import replace

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.ir import Graph, Role
from autopar.placement import format_placements
from benchmarks.baselines.template.intra_op import IntraOpChoice


def stage_submesh(cluster: Cluster, config: ParallelConfig) -> Cluster:
    """The cluster one pipeline stage runs on: dp * tp devices, tp innermost on a node."""
    devices = config.dp * config.tp
    per_node = min(cluster.devices_per_node, devices)
    return replace(cluster, num_nodes=max(1, devices // per_node), devices_per_node=per_node)


def ilp_intra_op(graph: Graph, cluster: Cluster, config: ParallelConfig, *,
                 cache: dict[tuple[str, tuple[int, ...]], IntraOpChoice],
                 time_limit_s: float | None = 60.0) -> tuple[IntraOpChoice, ...]:
    """One IntraOpChoice per layer group, from the ILP on the stage's (dp, tp) mesh."""
    from solver.intra_op.ilp import solve_intra_op

    sub = stage_submesh(cluster, config)
    mesh = (config.dp, config.tp)
    out = []
    for group in graph.layer_groups:
        key = (group.signature, mesh)
        if key not in cache:
            nodes = group.nodes[0]
            sol = solve_intra_op(graph, sub, mesh, nodes=tuple(nodes), time_limit_s=time_limit_s)
            placements = []
            for choice in sol.choices:
                node = graph[choice.node]
                if node.role is Role.PARAMETER and node.param_name:
                    name = re.sub(r"^(.*?)\.\d+\.", "", node.param_name, count=1)
                    placements.append((name, f"{format_placements(choice.outputs[0])} on (dp, tp) = {list(mesh)}"))
            cache[key] = IntraOpChoice(layer_group=f"layers[group {group.index}]", submesh=mesh, source="ilp",
                                       placements=tuple(sorted(placements)), cost_s=sol.cost.total_s)
        out.append(cache[key])
    return tuple(out)
