"""The solver's cost table: every price the intra-op ILP and the stage pricer use, as data.

Where it sits: cost_model/, between the strategies and the solve (DESIGN.md flow):
`cost_table(graph, space, cluster) -> CostTable` after
`solver.intra_op.space.enumerate_strategies` and before the ILP (solver/intra_op/ilp.py).
The solver reads these prices and imports nothing else of cost_model's internals (the
`cost_model` package re-exports this module's names; tests/unit/test_layering.py checks).
What it hands over:
- `CostTable`: per node, per strategy, compute time, communication time and per-device
  memory (`strategy_cost`), with the mesh axes' links;
- `ReshardPricer`: resharding, grouped-gather and bucketed gradient-sync times of an edge
  (None where DTensor cannot reshard), memoised per solve, and the collectives behind them;
  each time also as its parts (`ChargePart`: per collective kind and axis, and the local
  copies), whose in-order sum it is;
- `collective_time_s(Collective, links)`: one collective on its mesh axis;
- `core_share(cluster)`: the CPU contention factor every op time is multiplied by.
It calls the formulas of cost_model/ (roofline compute.py, alpha-beta collectives.py per
mesh axis) and returns new frozen tables (the strategy space is not touched).

Math, for node n under strategy s on a mesh with axis sizes (n_1..n_k):
    local(t, pl)   = bytes of tensor t on one device: sharded dims divided by the axis
                     sizes sharding them; Replicate and Partial keep the full size
    work(n, s)     = max over n's tensors of their shard factor (the share of the op's
                     FLOPs one device does: every device computes only its shard)
    compute(n, s)  = compute_time_s(flops_n / work, sum of distinct local input bytes +
                     local output bytes, hardware, dtype); a view op's host
                     time instead (`view_host_s`: view_overhead_s x core share); a
                     memory-bound op's and a view's time x compiled_memory_factor where
                     the program is compiled by Inductor (`compiled_scale`)
    comm(n, s)     = 0: DTensor's strategies leave reductions pending (Partial outputs),
                     priced as resharding on the consumer's edge
    memory(n, s)   = sum of local output bytes; for a parameter instead
                     numel * ((weight + grad) / f_compute + optimizer / f_update): 2 + 2 bytes
                     in its compute placement, 12 (fp32 master, momentum, variance) in its
                     weight-update placement (cost_model/memory.py; 16 / f where the two are
                     one placement, ZeRO-1's 4 + 12 / N where only the update is sharded)
    reshard(u->v)  = sum over the steps DTensor's redistribute takes from out(u, s_u) to
                     in(v, s_v) (autopar/placement.py `redistribute_plan`) of the alpha-beta
                     time of that step's collective on its mesh axis; None where DTensor
                     cannot redistribute (a shard to a pending sum, one pending reduction
                     to another): such pairs are absent from the ILP.
    collectives    = the same steps as (kind, axis, bytes): what the per-rank program runs
                     on that edge (price = run). On gloo (the cpu profile) DTensor's
                     shard-to-shard all-to-all is an all-gather and a local chunk.
    grad_sync(g->p) = reshard(g->p), except for a bucketable gradient (one all-reduce or
                     reduce-scatter, autopar/buckets.py): its bandwidth term plus its share
                     of its bucket's latency, plus copying its local bytes into the bucket
                     (`bucket_copy_s_per_byte`). The program runs one collective per bucket,
                     however small, so a bucket's members pay one whole latency together:
                     in the plan's price (solver/intra_op/solution.py `extract_solution`) each pays its
                     bytes over its real bucket's; in the ILP's objective, before the
                     buckets are known, over the bucket it is expected to share
                     (`expected_bucket_bytes`: the bucket autopar/buckets.py would put it in
                     if every gradient synced one way). Charging bytes / BUCKET_BYTES
                     instead would let a small model's single all-reduce bucket pay a few %
                     of its latency and ZeRO's per-layer reduce-scatters almost none (the
                     CPU sweep's S model: 5 reduce-scatters priced at 0.13 latencies).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from autopar.cluster import Cluster
from autopar.ir import ATTENTION_OPS, DTYPE_BYTES, GEMM_OPS, Graph, Node, Role, TensorMeta
from autopar.placement import (
    Placements,
    Shard,
    redistribute_steps,
    redistribute_supported,
    single_gather_axis,
    shard_factor,
    transfer_kind,
)
from autopar.sharding import NodeStrategy, StrategySpace
from autopar.buckets import BUCKET_BYTES
from cost_model.efficiency import Efficiency, efficiency_for
from cost_model.memory import parameter_state_bytes, raw_gradient_state_bytes
from cost_model.collectives import (
    AxisLink,
    all_gather_time_s,
    collective_latency_s,
    all_reduce_time_s,
    all_to_all_time_s,
    mesh_axis_links,
    reduce_scatter_time_s,
)
from cost_model.compute import compute_time_s


@dataclass(frozen=True, slots=True, kw_only=True)
class Collective:
    """One collective of the per-rank program: its kind, mesh axis and bytes.

    bytes: all_gather the gathered (output) tensor, reduce_scatter the full input,
    all_reduce the tensor, all_to_all the local input; per device."""

    kind: str
    axis: int
    bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StrategyCost:
    compute_s: float
    comm_s: float
    memory_bytes: float


@dataclass(frozen=True, slots=True, kw_only=True)
class CostTable:
    mesh_shape: tuple[int, ...]
    links: tuple[AxisLink, ...]
    nodes: tuple[tuple[StrategyCost, ...], ...]
    """Per node id, aligned with `StrategySpace.strategies[node]`."""


def local_bytes(meta: TensorMeta, placements: Placements, mesh_shape: tuple[int, ...]) -> float:
    return meta.numel * DTYPE_BYTES.get(meta.dtype, 4) / shard_factor(placements, mesh_shape)


def strategy_cost(graph: Graph, node: Node, strategy: NodeStrategy, cluster: Cluster,
                  mesh_shape: tuple[int, ...], dtype: str, grads_at_update: bool = False) -> StrategyCost:
    """Compute time, communication time and per-device memory of one node under one strategy.

    A parameter's memory is its state (memory.py `parameter_state_bytes`: master weight and
    optimizer state in the update placement, compute copy in the compute placement, in the
    dtypes of the plan's precision policy) but its raw gradient, which its gradient node
    charges (`raw_gradient_state_bytes`) in the placement the backward leaves it in, held
    over the step's microbatches until its sync; where the step syncs the gradients in its
    backward (`grads_at_update`: one microbatch, or ZeRO-2, whose shards accumulate) the
    raw ones are freed bucket by bucket and the parameter charges the synced gradient, in
    the update placement."""
    if node.role is Role.PARAMETER:
        computed, updated = shard_factor(strategy.outputs[0], mesh_shape), shard_factor(
            strategy.update_placements, mesh_shape)
        weights, grads, state = parameter_state_bytes(node.output.numel, computed, updated,
                                                      grads_at_update=grads_at_update,
                                                      precision=graph.model.precision)
        return StrategyCost(compute_s=0.0, comm_s=0.0,
                            memory_bytes=weights + state + (grads if grads_at_update else 0.0))
    cost = _op_cost(graph, node, strategy, cluster, mesh_shape, dtype)
    if node.role is Role.GRADIENT:
        return replace(cost, memory_bytes=0.0 if grads_at_update else raw_gradient_state_bytes(
            node.output.numel, shard_factor(strategy.outputs[0], mesh_shape), graph.model.precision))
    return cost


def _op_cost(graph: Graph, node: Node, strategy: NodeStrategy, cluster: Cluster, mesh_shape: tuple[int, ...],
             dtype: str) -> StrategyCost:
    """`strategy_cost` of an op: its time and its output's bytes."""
    out_bytes = sum(local_bytes(t, pl, mesh_shape) for t, pl in zip(node.outputs, strategy.outputs))
    fused = compiled_scale(graph, cluster)
    if node.is_view:
        return StrategyCost(compute_s=view_host_s(node, cluster) * fused, comm_s=0.0, memory_bytes=out_bytes)
    if node.bytes_moved == 0 and node.flops == 0:
        return StrategyCost(compute_s=0.0, comm_s=0.0, memory_bytes=out_bytes)
    seen: dict[int, float] = {}
    for src, pl in zip(node.inputs, strategy.inputs):
        producer = graph[src]
        if len(producer.outputs) == 1:
            seen.setdefault(src, local_bytes(producer.output, pl, mesh_shape))
    work = max([shard_factor(pl, mesh_shape) for pl in strategy.inputs + strategy.outputs] + [1])
    op_class = "gemm" if node.op in GEMM_OPS else "attention" if node.op in ATTENTION_OPS else "memory"
    t = compute_time_s(node.flops / work, sum(seen.values()) + out_bytes, cluster.hardware, dtype,
                       op_class=op_class, causal=node.is_causal)
    if op_class == "memory":
        t *= fused
    return StrategyCost(compute_s=t * core_share(cluster), comm_s=0.0, memory_bytes=out_bytes)


def compiled_scale(graph: Graph, cluster: Cluster) -> float:
    """What remains of a memory-bound op's or a view's eager time where the program runs
    its graphs through Inductor (`graph.compiled`; codegen/inductor.py):
    `Efficiency.compiled_memory_factor` (Inductor fuses pointwise and reduction chains into
    one kernel, and views become index arithmetic in its code; the closed-form baseline
    scales the same traffic by the same constant, benchmarks/baselines/analytic/step.py); 1 eager."""
    if not graph.compiled:
        return 1.0

    return efficiency_for(cluster.hardware).compiled_memory_factor


HOSTLESS_VIEWS = frozenset({"getitem", "placeholder", "constant"})
"""View-like trace nodes that are no op call in the per-rank program: a tuple index (a
Python `getitem`, ~0.3 us), an input slot, a constant."""


def view_host_s(node: Node, cluster: Cluster) -> float:
    """Host time of one view op (t, view, transpose, slice, ...): no data moves, but the
    per-rank program calls it like any other op (`Efficiency.view_overhead_s`, what
    `autopar calibrate` measured a view to cost on the runtime's path; 0 on GPUs, where the
    host runs ahead of the kernels), x `core_share`. The baseline's price_profile makes
    the same charge per view op (benchmarks/baselines/analytic/step.py `_host_time`)."""
    if node.op in HOSTLESS_VIEWS:
        return 0.0

    return efficiency_for(cluster.hardware).view_overhead_s * core_share(cluster)


def core_share(cluster: Cluster) -> float:
    """Ranks per core on a node (the cpu profile's cores_per_node; 1 on GPUs): ranks sharing
    cores run their ops that much slower (the one definition: the solver's stage and plan
    pricers multiply by it, and so does the baseline, benchmarks/baselines/analytic/step.py)."""
    cores = getattr(cluster.hardware, "cores_per_node", 0)
    return max(1.0, cluster.devices_per_node / cores) if cores else 1.0


def pipeline_call_time_s(cluster: Cluster, efficiency: Efficiency | None = None) -> float:
    """Host time of one pipeline stage's chunk call (a microbatch's forward and backward
    through the schedule), beyond its graph's ops and boundary messages:
    `Efficiency.pipeline_call_host_s` (per dedicated core; 0 on GPUs) x `core_share`. Charged
    per stage per microbatch per chunk (solver/stage_dp.py `StageOption.call_s`; the
    baseline's stage times, benchmarks/baselines/analytic/step.py). `efficiency`: replacement
    constants (the profile's overrides win)."""
    return efficiency_for(cluster.hardware, efficiency).pipeline_call_host_s * core_share(cluster)


def grad_sync_overlap(cluster: Cluster) -> float:
    """rho of `exposed_sync_s` on `cluster`: `Efficiency.grad_sync_overlap_efficiency` (the
    one model's fitted constant) x the hardware's `comm_overlap` (1 on GPUs, where NCCL runs
    on its own stream beside the backward's kernels; the cpu profile's measured value, 0
    where gloo on shared cores hides nothing)."""
    hw = cluster.hardware
    return efficiency_for(hw).grad_sync_overlap_efficiency * hw.comm_overlap


def exposed_sync_s(sync_s: float, last_s: float, backward_s: float, rho: float) -> float:
    """The part of a gradient sync the step waits for, when its buckets overlap the backward:

        exposed = max(S_last, S - rho x W) = S - min(S - S_last, rho x W)

    S (`sync_s`): the summed time of the sync's collectives and copies, as charged when
    exposed (`ReshardPricer.grad_sync_time` over every gradient); S_last (`last_s`): the
    part of S of the gradient computed last in the backward, whose bucket is issued when
    nothing of the backward is left to hide it; W (`backward_s`): the backward compute of
    the microbatch whose backward issues the buckets; rho in [0, 1] (`grad_sync_overlap`).
    Each bucket's collective is issued where its last gradient is computed and waited at
    the end of the step (codegen/collectives.py `GradSync`, as DDP's and FSDP's bucketed
    reductions: Zhao et al., arXiv 2304.11277, Sec. 3.3; Megatron-LM's
    `overlap_grad_reduce`), so it runs beside the rest of that backward; W bounds what it
    can hide behind, rho takes what the collectives' share of the device and the late
    buckets' shorter windows leave of it (fitted on published runs). Linear in the ILP
    (solver/intra_op/ilp.py: hidden h <= rho W(x), h <= S(x) - S_last(x)). S_last is the
    last-computed gradient's own sync with its share of its bucket's latency, a lower bound
    on its bucket's: exact where that gradient fills a bucket alone (a Llama's embedding
    gradient, 128256 x 4096 x 4 bytes = 2.1 GB for the 8B, is a bucket of its own). S holds
    the copies into the buckets too, which run on the compute stream, not beside it: on
    GPUs they are a small part of S (2 bytes of HBM traffic per gradient byte against its
    collective's bus time), left to what rho absorbs."""
    return sync_s - hidden_comm_s(sync_s - last_s, backward_s, rho)


def hidden_comm_s(hideable_s: float, window_s: float, rho: float) -> float:
    """The part of collectives issued ahead of their use that compute hides:

        hidden = min(H, rho x W)

    H (`hideable_s`): the summed time of the collectives that have compute to run beside
    (a phase's weight collectives but its first layer's, each issued as soon as the one
    before it in its phase is waited: codegen/prefetch.py, as FSDP prefetches the next unit's all-gather, Zhao et
    al., arXiv 2304.11277, Sec. 3.3-3.4; with the gradient sync but its last bucket in the
    backward, `exposed_sync_s`); W (`window_s`): the phase's compute; rho: the share of a
    collective's time compute hides (`grad_sync_overlap`). One phase's collectives share
    its window (solver/intra_op/overlap_rows.py writes this as linear rows)."""
    return min(max(0.0, hideable_s), rho * window_s)


def bucket_copy_s_per_byte(cluster: Cluster) -> float:
    """A bucketed gradient sync copies each raw local gradient into one flat buffer before
    the collective (codegen/collectives.py `GradSync.reduce`: read it, write the buffer; the
    all-reduce then runs in place and the synced gradients are views of the buffer):
    2 bytes of memory traffic per gradient byte at achievable bandwidth, ranks sharing
    cores (`core_share`). Measured on the CPU sweep's large model (dp4, 4 ranks on 2
    cores, torch.profiler): `aten::copy_` 9.8-14.0 ms per step, against no price before."""
    hw = cluster.hardware
    eff = efficiency_for(hw)
    return 2.0 * core_share(cluster) / (hw.memory_bandwidth_bytes_per_s * eff.memory_efficiency)


def cost_table(graph: Graph, space: StrategySpace, cluster: Cluster, *, grads_at_update: bool = False,
               memo: dict | None = None) -> CostTable:
    """Cost of every strategy of every node (nodes with identical structure priced once).
    The solver assembles a plan's Estimate from these costs (solver/spmd_search.py,
    solver/stage_costs.py).
    `grads_at_update`: the gradients held are the synced ones, in the weight-update placement
    (synced in the step's backward: one microbatch, or ZeRO-2).
    `memo` (one search's, shared by its solves): each node's row by (node, strategy list
    identity) for this graph, cluster, mesh and `grads_at_update`, so the solves of one
    graph whose spaces share a node's list (the ZeRO layouts of one stage differ in the
    parameters' lists only) price it once. A row is a function of exactly those, so
    the table is the one a fresh call returns."""
    mesh_shape = space.mesh_shape
    links = mesh_axis_links(cluster, mesh_shape)
    dtype = graph.model.dtype
    cache: dict[tuple, tuple[StrategyCost, ...]] = {}
    rows: dict[tuple[int, int], tuple] | None = None
    if memo is not None:  # the graph is kept beside its rows: its id stays its own
        rows = memo.setdefault(("cost rows", cluster, mesh_shape, grads_at_update, id(graph)), (graph, {}))[1]
    table = []
    for node, strategies in zip(graph.nodes, space.strategies):
        seen = None if rows is None else rows.get((node.id, id(strategies)))
        if seen is not None:
            table.append(seen[1])
            continue
        key = (node.op, node.role, node.outputs, tuple(graph[i].outputs for i in node.inputs),
               node.flops, node.bytes_moved, node.is_view, node.is_causal, strategies)
        if key not in cache:
            cache[key] = tuple(strategy_cost(graph, node, s, cluster, mesh_shape, dtype, grads_at_update)
                               for s in strategies)
        if rows is not None:  # the list is kept beside its row: its id stays its own
            rows[(node.id, id(strategies))] = (strategies, cache[key])
        table.append(cache[key])
    return CostTable(mesh_shape=mesh_shape, links=links, nodes=tuple(table))


_UNPRICED = object()
"""A memo's miss (None is a price: the reshard cannot be done)."""


def reshard_collectives(meta: TensorMeta, src: Placements, dst: Placements, mesh_shape: tuple[int, ...], *,
                        gloo: bool) -> tuple[Collective, ...] | None:
    """The collectives DTensor runs to take `meta` from `src` to `dst` (None: it cannot),
    from its planner's steps (autopar/placement.py `redistribute_steps`, the steps of
    `redistribute_plan`): per step, the tensor's bytes as that axis holds it (divided by
    every other axis's shards at that step), an all-to-all's divided by its axis too."""
    if src == dst:
        return ()
    steps = _reshard_steps(tuple(src), tuple(dst), tuple(mesh_shape), gloo)
    if steps is None:
        return None
    total = math.prod(meta.shape) * DTYPE_BYTES.get(meta.dtype, 4)
    return tuple(Collective(kind=kind, axis=axis, bytes=int(total // others // split))
                 for kind, axis, others, split in steps)


@functools.lru_cache(maxsize=65536)
def _reshard_steps(src: Placements, dst: Placements, mesh_shape: tuple[int, ...], gloo: bool
                   ) -> tuple[tuple[str, int, int, int], ...] | None:
    """`reshard_collectives` without the tensor: (kind, axis, the other axes' shard count,
    the axis's own split of an all-to-all's bytes) per collective step; shape-free, so the
    search's pricing (about 450,000 reshards of a DeepSeek-V3-like model) plans each
    distinct (source, target, mesh) once."""
    if not redistribute_supported(src, dst):
        return None
    current = list(src)
    out = []
    for axis, a, b in redistribute_steps(src, dst, mesh_shape):
        kind = transfer_kind(a, b)
        others = math.prod(n for k, (p, n) in enumerate(zip(current, mesh_shape)) if k != axis and isinstance(p, Shard))
        current[axis] = b
        if kind == "local":
            continue
        split = 1
        if kind == "all_to_all":
            if gloo:  # DTensor on a CPU mesh: all-gather the whole axis, keep a chunk
                kind = "all_gather"
            else:
                split = mesh_shape[axis]
        out.append((kind, axis, others, split))
    return tuple(out)


def collective_time_s(c: Collective, links: tuple[AxisLink, ...]) -> float:
    link = links[c.axis]
    if c.kind == "all_reduce":
        return all_reduce_time_s(c.bytes, link)
    if c.kind == "all_gather":
        return all_gather_time_s(c.bytes, link)
    if c.kind == "reduce_scatter":
        return reduce_scatter_time_s(c.bytes, link)
    if c.kind == "all_to_all":
        return all_to_all_time_s(c.bytes, link)
    raise ValueError(f"unknown collective kind {c.kind!r}")


LOCAL_COPY = "local_copy"
"""The kind of a charged part that is no collective: a bucketed gradient copied into its
bucket's flat buffer, a grouped gather's shard packed into the group's buffer and the
gathered rows copied out (`bucket_copy_s_per_byte`); its axis is LOCAL_AXIS."""

LOCAL_AXIS = -1
"""The mesh axis of a LOCAL_COPY part: none (the copy runs on each device alone)."""

ChargePart = tuple[str, int, float]
"""(collective kind or LOCAL_COPY, mesh axis or LOCAL_AXIS, seconds): one part of what the
pricer charges an edge. The pricer's times are the sums of their parts, in order, so a
solution's charges can be split by kind with no second formula
(solver/intra_op/solution.py `extract_solution`, `IntraOpSolution.reshard_parts`)."""


def charged_s(parts: tuple[ChargePart, ...] | None) -> float | None:
    """The time of `parts`: their seconds summed in order from 0.0 (the pricer's methods
    return this, so a split adds up to the time bit for bit)."""
    return None if parts is None else sum((p[2] for p in parts), 0.0)


class ReshardPricer:
    """Resharding time (None where DTensor cannot reshard) with a per-solve memo: many
    edges share shapes and placements."""

    def __init__(self, links: tuple[AxisLink, ...], *, gloo: bool = False, copy_s_per_byte: float = 0.0,
                 memo: dict | None = None) -> None:
        """`memo`: the reshard memo of earlier pricers with the same `links` and `gloo` (a
        search's solves on one submesh share it): a reshard's collectives and time are
        pure in (tensor shape, strides, dtype, layouts) given those."""
        self.links = links
        self.mesh_shape = tuple(link.size for link in links)
        self.gloo = gloo
        self.copy_s_per_byte = copy_s_per_byte
        """Copying one byte (read + write; `bucket_copy_s_per_byte`): paid by every bucketed
        gradient sync (each raw gradient into its bucket's flat buffer) and every grouped
        parameter gather (each shard into the group's flat buffer, each gathered parameter
        out of the gathered rows: `gather_time`)."""
        self._memo: dict[tuple, tuple[float, tuple[Collective, ...]] | None] = {} if memo is None else memo

    def collectives(self, meta: TensorMeta, src: Placements, dst: Placements) -> tuple[Collective, ...] | None:
        found = self._lookup(meta, src, dst)
        return None if found is None else found[1]

    def __call__(self, meta: TensorMeta, src: Placements, dst: Placements) -> float | None:
        if src == dst:
            return 0.0
        found = self._lookup(meta, src, dst)
        return None if found is None else found[0]

    def gather_axis(self, meta: TensorMeta, src: Placements, dst: Placements) -> int | None:
        """The mesh axis of a parameter reshard that is one all-gather (Shard -> Replicate
        on that axis, every other axis unchanged): such gathers travel in groups
        (autopar/buckets.py gather_group); None for any other reshard."""
        axis = single_gather_axis(src, dst)
        if axis is None:
            return None
        steps = self.collectives(meta, src, dst)
        assert steps is not None and len(steps) == 1 and steps[0].kind == "all_gather" and steps[0].axis == axis, \
            (src, dst, steps)
        return axis

    def reshard_parts(self, meta: TensorMeta, src: Placements, dst: Placements) -> tuple[ChargePart, ...] | None:
        """`__call__`'s time split by collective: (kind, mesh axis, collective_time_s) per
        step DTensor's redistribute takes, in order (their sum is `__call__`'s, bit for bit)."""
        found = self._lookup(meta, src, dst) if src != dst else (0.0, ())
        return None if found is None else tuple((c.kind, c.axis, collective_time_s(c, self.links)) for c in found[1])

    def gather_time(self, meta: TensorMeta, src: Placements, dst: Placements, share: float) -> float | None:
        """A grouped parameter gather: its bandwidth term plus `share` of the collective's
        latency (the group pays one), plus the copies the group runs for it
        (codegen/apply.py `_Interpreter._gather`): its shard packed into the group's flat
        buffer (1/n of the gathered bytes) and the gathered parameter concatenated out of
        the n gathered rows (all of them). Any other reshard as __call__."""
        if self.gather_axis(meta, src, dst) is None:
            return self(meta, src, dst)
        return charged_s(self.gather_parts(meta, src, dst, share))

    def gather_parts(self, meta: TensorMeta, src: Placements, dst: Placements, share: float
                     ) -> tuple[ChargePart, ...] | None:
        """`gather_time` split into what it charges: the all-gather's part (bandwidth term
        and latency share) and the local copies (LOCAL_COPY)."""
        if self.gather_axis(meta, src, dst) is None:
            return self.reshard_parts(meta, src, dst)
        (step,) = self.collectives(meta, src, dst)
        link = self.links[step.axis]
        latency = collective_latency_s(step.kind, link)
        copies = self.copy_s_per_byte * step.bytes * (1 + 1 / link.size)
        return ((step.kind, step.axis, collective_time_s(step, self.links) - latency + latency * share),
                (LOCAL_COPY, LOCAL_AXIS, copies))

    def bucket_key(self, meta: TensorMeta, src: Placements, dst: Placements) -> tuple | None:
        """The bucket a gradient reduction `src -> dst` can share (autopar/buckets.py), or
        None: bucketable are all-reduces over one or more axes (data parallel over a 2-D
        mesh is two) and one reduce-scatter, with every other axis unchanged."""
        steps = self.collectives(meta, src, dst)
        if not steps:
            return None
        kinds = {c.kind for c in steps}
        if not (kinds == {"all_reduce"} or (kinds == {"reduce_scatter"} and len(steps) == 1)):
            return None
        axes = {c.axis for c in steps}
        if any(a != b for k, (a, b) in enumerate(zip(src, dst)) if k not in axes):
            return None  # a local chunk on another axis too: resharded on its own
        ops = tuple(getattr(src[c.axis], "reduce_op", None) for c in steps)
        if None in ops:
            return None
        return (tuple((c.kind, c.axis, op) for c, op in zip(steps, ops)), meta.dtype)

    def grad_sync_time(self, meta: TensorMeta, src: Placements, dst: Placements,
                       share: float | None = None, bucket_bytes: tuple[float, float] | None = None) -> float | None:
        """A gradient's sync: for a bucketable one, its bandwidth term, `share` of its
        bucket's latency (the bucket runs one collective, so its members' shares sum to
        one) and its copy into the bucket. Without `share` (the ILP's objective, before the
        buckets are known): its bytes over `bucket_bytes` (the expected bucket's bytes, for
        an all-reduce and for a reduce-scatter bucket), else over BUCKET_BYTES."""
        if src == dst:
            return 0.0
        if self.bucket_key(meta, src, dst) is None:
            return self(meta, src, dst)
        return charged_s(self.grad_sync_parts(meta, src, dst, share, bucket_bytes))

    def grad_sync_parts(self, meta: TensorMeta, src: Placements, dst: Placements, share: float | None = None,
                        bucket_bytes: tuple[float, float] | None = None) -> tuple[ChargePart, ...] | None:
        """`grad_sync_time` split into what it charges: the copy into the bucket
        (LOCAL_COPY) and each collective's part (bandwidth term and latency share)."""
        if self.bucket_key(meta, src, dst) is None:
            return self.reshard_parts(meta, src, dst)
        parts: list[ChargePart] = [(LOCAL_COPY, LOCAL_AXIS,
                                    self.copy_s_per_byte * meta.size_bytes / shard_factor(src, self.mesh_shape))]
        for step in self.collectives(meta, src, dst):
            latency = collective_latency_s(step.kind, self.links[step.axis])
            if share is not None:
                part = share
            elif bucket_bytes is not None:
                expected = bucket_bytes[1 if step.kind == "reduce_scatter" else 0]
                part = min(1.0, meta.size_bytes / expected) if expected > 0 else 1.0
            else:
                part = min(1.0, step.bytes / BUCKET_BYTES)
            parts.append((step.kind, step.axis, collective_time_s(step, self.links) - latency + latency * part))
        return tuple(parts)

    def _lookup(self, meta: TensorMeta, src: Placements, dst: Placements) -> tuple[float, tuple[Collective, ...]] | None:
        key = (meta, src, dst)
        found = self._memo.get(key, _UNPRICED)
        if found is _UNPRICED:
            steps = reshard_collectives(meta, src, dst, self.mesh_shape, gloo=self.gloo)
            found = self._memo[key] = None if steps is None else (
                sum(collective_time_s(c, self.links) for c in steps), steps)
        return found
