"""Intra-op sharding: the strategy space and the solved per-node layouts, torch-free.

Where it sits: `solver.intra_op.space.enumerate_strategies(graph, mesh_shape)` returns a
`StrategySpace`; `solver.intra_op.ilp.solve_intra_op(...)` returns an `IntraOpSolution`,
which the whole-plan search and codegen read. Both are frozen, hashable data.

Terms:
- strategy: for one node, a placement (one entry per mesh axis) for each output tensor
  and the placement each tensor input must arrive in (`NodeStrategy.inputs` is aligned
  with `Node.inputs`). Infeasible strategies (non-divisible shards) are absent.
- reshard: the collective that turns a producer's output placement into the placement a
  consumer's strategy wants (priced on graph edges; Partial outputs are reduced there).
- Partial semantics: the per-device values sum to the true value. Ops that reduce over a
  sharded dim with a mean (mean.dim, nll_loss with mean reduction) produce Partial values
  scaled by the global count, so codegen divides by the global, not the local, count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from autopar.ir import Graph, NodeId
from autopar.placement import Placements, format_placements, parse_placements, shard_factor


class InfeasiblePlanError(ValueError):
    """No sharding plan fits the memory budget; `min_memory_bytes` is the smallest any plan needs."""

    def __init__(self, message: str, *, min_memory_bytes: float | None = None) -> None:
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeStrategy:
    outputs: tuple[Placements, ...]
    """Placement of each output tensor (one entry per mesh axis)."""
    inputs: tuple[Placements, ...]
    """Placement each tensor input must have, aligned with `Node.inputs`."""
    update: Placements | None = None
    """Parameters only: the placement of the weight update (the reduced gradient, the
    optimizer state and step, the master weights), where it differs from the compute
    placement `outputs[0]`; None: the same. Weight-update sharding (Xu et al. 2020,
    "Automatic Cross-Replica Sharding of Weight Update in Data-Parallel Training"):
    compute Replicate + update Shard over an axis is ZeRO-1/2 on that axis (gradients
    reduce-scattered, the updated weights all-gathered once per step)."""

    @property
    def update_placements(self) -> Placements:
        """Where the weight update happens: `update`, else the compute placement."""
        return self.outputs[0] if self.update is None else self.update


@dataclass(frozen=True, slots=True, kw_only=True)
class StrategySpace:
    mesh_shape: tuple[int, ...]
    strategies: tuple[tuple[NodeStrategy, ...], ...]
    """Per node id, its feasible strategies (at least one: all-replicated is always there)."""
    fallback_ops: tuple[str, ...] = ()
    """Ops with no rule, replicated everywhere (logged as a warning)."""
    follows: tuple[int | None, ...] = ()
    """Per node id: for a pointwise op, the position (in Node.inputs) of the operand whose
    layout it follows (solver/intra_op/sharing.py); None otherwise. Empty: no hints."""

    def __getitem__(self, node_id: NodeId) -> tuple[NodeStrategy, ...]:
        return self.strategies[node_id]

    @property
    def num_strategies(self) -> int:
        return sum(len(s) for s in self.strategies)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeChoice:
    node: NodeId
    name: str
    op: str
    outputs: tuple[Placements, ...]
    inputs: tuple[Placements, ...]
    compute_s: float
    """Time of the local shard of this op (one traced copy, unweighted)."""
    comm_s: float
    """Collectives inside the op's strategy (0 for the project rules: reductions are resharding)."""
    reshard_s: float
    """Resharding on this node's input edges (and, for a parameter, its gradient's reshard)."""
    memory_bytes: float
    """Per-device bytes of this node's outputs (parameters: param + grad + optimizer state)."""
    weight: float = 1.0
    """How many real-model copies this traced node stands for."""
    update: Placements | None = None
    """Parameters only: the weight update's placement where it differs from `outputs[0]`
    (NodeStrategy.update)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PricedCollective:
    """One collective the solution pays for: on the edge src -> dst (for a gradient sync,
    gradient -> parameter), its kind, mesh axis and bytes per device (cost_model/table.py
    `Collective`). `weight` is how many real-model copies the traced edge stands for."""

    src: NodeId
    dst: NodeId
    kind: str
    axis: int
    bytes: int
    weight: float = 1.0
    gradient_sync: bool = False
    """Once per step rather than once per microbatch: the gradient sync after gradient
    accumulation, and the gather of updated weights from their update placement."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CostBreakdown:
    compute_s: float
    comm_s: float
    reshard_s: float
    total_s: float
    """compute + comm + reshard - sync_hidden - gather_hidden, weighted by multiplicity: the ILP objective."""
    peak_memory_bytes: float
    """Largest per-device memory over the checked liveness points (params+grads+optimizer+activations)."""
    sync_hidden_s: float = 0.0
    """The part of the gradient sync (inside `reshard_s`) that runs beside the backward and
    is not waited for (cost_model `exposed_sync_s`: S - exposed); `total_s` leaves it out."""
    gather_hidden_s: float = 0.0
    """The part of the weights' collectives (inside `reshard_s`) issued ahead of their use
    that runs beside compute (cost_model `hidden_comm_s`, codegen/prefetch.py); `total_s`
    leaves it out."""


@dataclass(frozen=True, slots=True, kw_only=True)
class IntraOpSolution:
    graph_fingerprint: str
    cluster: str
    mesh_shape: tuple[int, ...]
    choices: tuple[NodeChoice, ...]
    cost: CostBreakdown
    memory_budget_bytes: float | None
    status: str
    """"optimal", or "time_limit" when the solver stopped with a feasible, unproven plan."""
    solver: str
    num_variables: int
    num_constraints: int
    collectives: tuple[PricedCollective, ...] = ()
    """Every collective the chosen placements imply (the per-rank program runs these)."""
    grad_sync_weight: float = 1.0
    """Weight of the gradient syncs in `cost` (1/m for m microbatches per step; 1 where the
    gradients sync every microbatch)."""
    grads_each_microbatch: bool = False
    """ZeRO-2: every microbatch's gradients are synced to their weight-update placement as
    the backward leaves them, and accumulated there (solve_intra_op `grads_each_microbatch`)."""
    reshard_parts: tuple[tuple[NodeId, str, int, float], ...] = ()
    """Every node's `reshard_s` split by what it pays for: (node, collective kind or
    "local_copy", mesh axis or -1, seconds), the pricer's own parts of each charge
    (cost_model `ChargePart`), weighted as the node's `reshard_s` is: per node, the parts
    add up to its `reshard_s`. What `autopar price` reports per collective kind."""
    solve_time_s: float = field(default=0.0, compare=False)
    """Wall time; not part of the JSON so that the same inputs give byte-identical files."""

    def choice(self, node_id: NodeId) -> NodeChoice:
        for c in self.choices:
            if c.node == node_id:
                return c
        raise KeyError(f"node {node_id} is not in this solution")

    def to_dict(self) -> dict[str, Any]:
        return {
            "graph_fingerprint": self.graph_fingerprint,
            "cluster": self.cluster,
            "mesh_shape": list(self.mesh_shape),
            "status": self.status,
            "solver": self.solver,
            "num_variables": self.num_variables,
            "num_constraints": self.num_constraints,
            "memory_budget_bytes": self.memory_budget_bytes,
            "grad_sync_weight": self.grad_sync_weight,
            **({"grads_each_microbatch": True} if self.grads_each_microbatch else {}),
            "collectives": [[c.src, c.dst, c.kind, c.axis, c.bytes, c.weight, c.gradient_sync]
                            for c in self.collectives],
            "reshard_parts": [list(p) for p in self.reshard_parts],
            "cost": {
                "compute_s": self.cost.compute_s, "comm_s": self.cost.comm_s,
                "reshard_s": self.cost.reshard_s, "total_s": self.cost.total_s,
                "peak_memory_bytes": self.cost.peak_memory_bytes,
                **({"sync_hidden_s": self.cost.sync_hidden_s} if self.cost.sync_hidden_s else {}),
                **({"gather_hidden_s": self.cost.gather_hidden_s} if self.cost.gather_hidden_s else {}),
            },
            "choices": [
                {
                    "node": c.node, "name": c.name, "op": c.op,
                    "outputs": [format_placements(p) for p in c.outputs],
                    "inputs": [format_placements(p) for p in c.inputs],
                    "compute_s": c.compute_s, "comm_s": c.comm_s, "reshard_s": c.reshard_s,
                    "memory_bytes": c.memory_bytes, "weight": c.weight,
                    **({"update": format_placements(c.update)} if c.update is not None else {}),
                }
                for c in self.choices
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "IntraOpSolution":
        d = json.loads(text)
        cost = CostBreakdown(**d["cost"])
        choices = tuple(
            NodeChoice(
                node=c["node"], name=c["name"], op=c["op"],
                outputs=tuple(parse_placements(p) for p in c["outputs"]),
                inputs=tuple(parse_placements(p) for p in c["inputs"]),
                compute_s=c["compute_s"], comm_s=c["comm_s"], reshard_s=c["reshard_s"],
                memory_bytes=c["memory_bytes"], weight=c["weight"],
                update=parse_placements(c["update"]) if "update" in c else None,
            )
            for c in d["choices"]
        )
        return cls(graph_fingerprint=d["graph_fingerprint"], cluster=d["cluster"],
                   mesh_shape=tuple(d["mesh_shape"]), choices=choices, cost=cost,
                   memory_budget_bytes=d["memory_budget_bytes"], status=d["status"],
                   solver=d["solver"], num_variables=d["num_variables"],
                   num_constraints=d["num_constraints"], grad_sync_weight=d["grad_sync_weight"],
                   grads_each_microbatch=bool(d.get("grads_each_microbatch", False)),
                   collectives=tuple(PricedCollective(src=a, dst=b, kind=k, axis=x, bytes=n, weight=w, gradient_sync=g)
                                     for a, b, k, x, n, w, g in d["collectives"]),
                   reshard_parts=tuple((n, k, x, t) for n, k, x, t in d.get("reshard_parts", ())))

    def explain(self, *, all_nodes: bool = False) -> str:
        """One line per node: op, placements, compute, communication and memory.

        By default views and getitems are left out (they cost nothing and follow their producer).
        """
        c = self.cost
        lines = [
            f"intra-op plan on {self.cluster} mesh {self.mesh_shape}: {self.status} ({self.solver})",
            f"  total {c.total_s * 1e3:.4f} ms = compute {c.compute_s * 1e3:.4f} + comm "
            f"{c.comm_s * 1e3:.4f} + reshard {c.reshard_s * 1e3:.4f}"
            + (f" - gradient sync hidden {c.sync_hidden_s * 1e3:.4f}" if c.sync_hidden_s else "")
            + (f" - weight collectives hidden {c.gather_hidden_s * 1e3:.4f}" if c.gather_hidden_s else "")
            + "; peak memory "
            f"{c.peak_memory_bytes / 2**30:.3f} GiB"
            + (f" of {self.memory_budget_bytes / 2**30:.3f} GiB" if self.memory_budget_bytes else ""),
            f"  {'node':>5} {'op':<44} {'x':>6} {'outputs':<24} {'inputs':<40} "
            f"{'compute_ms':>10} {'reshard_ms':>10} {'mem_MiB':>9}",
        ]
        for ch in self.choices:
            trivial = ch.compute_s == 0 and ch.reshard_s == 0 and not ch.op == "placeholder"
            if trivial and not all_nodes:
                continue
            outs = " ".join(format_placements(p) for p in ch.outputs)
            ins = " ".join(format_placements(p) for p in ch.inputs)
            lines.append(
                f"  {ch.node:>5} {(ch.op + ' ' + ch.name)[:44]:<44} {ch.weight:>6.3g} {outs:<24} "
                f"{ins:<40} {ch.compute_s * 1e3:>10.4f} {ch.reshard_s * 1e3:>10.4f} "
                f"{ch.memory_bytes / 2**20:>9.3f}"
            )
        return "\n".join(lines)


UPDATE_SEPARATOR = " update "
"""Joins a parameter's compute and weight-update placements in explain text and plan
summaries: "(R, R) update (S(0), R)"."""


def parameter_placement_text(choice: NodeChoice | NodeStrategy) -> str:
    """A parameter's placement as text: its compute placement, and its weight-update
    placement after UPDATE_SEPARATOR where that differs."""
    text = format_placements(choice.outputs[0])
    if choice.update is not None and choice.update != choice.outputs[0]:
        text += UPDATE_SEPARATOR + format_placements(choice.update)
    return text


def raw_gradient_bytes(graph: Graph, solution: IntraOpSolution) -> dict[NodeId, float]:
    """Per gradient node: the bytes one rank accumulates over a step's microbatches, each raw
    gradient as the backward leaves it (its own placement: a pending sum over dp is whole, a
    tensor-parallel weight's gradient is sharded like the weight's use), before the
    once-per-step sync, times the node's multiplicity (layers traced once count for all).
    The accumulation term of the one-stage estimate (solver/spmd_search.py) and of the
    pipeline stage costs (solver/stage_costs.py, per piece)."""
    by_node = {c.node: c for c in solution.choices}
    out: dict[NodeId, float] = {}
    for param, grad in graph.param_grads:
        c = by_node.get(grad)
        if c is not None:
            # ZeRO-2 accumulates the synced gradient, in the parameter's update placement
            p = by_node.get(param)
            where = (p.outputs[0] if p.update is None else p.update) \
                if solution.grads_each_microbatch and p is not None else c.outputs[0]
            out[grad] = c.weight * graph.grad_meta(grad).size_bytes / shard_factor(where, solution.mesh_shape)
    return out
