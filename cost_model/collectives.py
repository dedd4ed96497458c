"""Collective and resharding times on a device mesh: alpha-beta per mesh axis.

Where it sits: cost_model/, read by the strategy pricer, the intra-op ILP and the step
model. Torch-free.

Math (nccl-tests conventions, S = bytes of the full tensor, n = devices on the axis,
B = achievable bus bandwidth per device, alpha = per-step latency):

    all-reduce      t = 2 (n-1)/n * S / B + steps_ar * alpha + L0
    all-gather      t =   (n-1)/n * S / B + (n-1) * alpha_ring + L0  (S = gathered tensor)
    reduce-scatter  t =   (n-1)/n * S / B + (n-1) * alpha_ring + L0  (S = full input)
    all-to-all      t =   (n-1)/n * S / B_a2a + (n-1) * alpha + L0
    send/recv       t = S / B_p2p + alpha

L0 is the fixed launch latency of one collective (`base_latency_s`: NCCL's baseLatencies,
6.6 us for ring/Simple; gloo's measured one on the cpu profile). The per-step latencies
alpha are NCCL's own latency model (src/graph/tuning.cc: 3.4 us per NVLink ring step,
14 us per network step, Simple protocol), which is what makes data-parallel and ZeRO-3
collectives at large dp latency-bound: a ring all-gather over 512 ranks pays 511 steps.

On gloo (the cpu profiles) a reduce-scatter is an all-reduce of the whole input and a copy
of the rank's chunk (`GLOO_REDUCE_SCATTER`): it is priced with the all-reduce's steps and
volume, at its own measured bandwidth.

B is per collective kind where the hardware says so (`collective_bandwidth_scale`, the
calibrated gloo profiles); the GPU profiles use one B for all ring collectives.

steps_ar * alpha is 2 (n-1) alpha_ring (ring) inside a node and min(2 (n-1) alpha_ring,
2 ceil(log2 n) alpha) across nodes (NCCL switches to trees at scale). alpha_ring is the
mean ring step latency: alpha, except on a mixed axis where a ring laid out node by node
crosses a NIC on one hop in `inner` and NVLink on the others. All are 0 when n == 1.

Core sharing (the cpu profile's `cores_per_node`): with more ranks on a node than cores,
bandwidths shrink by share = ranks / cores (gloo's steps run on the same cores) and
latencies grow by share ** `collective_latency_share_exponent` (fitted; 1 = linear).
A collective inside one pipeline stage whose node's cores other stages' ranks share (a
stage's cluster keeps the node's `node_ranks`) also pays `stage_collective_wait_s` in
L0: while its members meet, the other stages' ranks run different work on the same cores,
and the members wait for each other's turn (benchmarks/fit/fit_cpu_constants.py). The groups of a
one-stage program are not charged: every group runs the same program and reaches the same
collective at the same time.

Mesh convention: axes outermost first, the LAST axis varies fastest over device ids;
axis k has stride prod(shape[k+1:]). With G devices per node, an axis whose span
(stride * n) fits in a node is "intra" (NVLink); one whose stride is >= G puts every
member on a different node, "inter" (one NIC per member); otherwise it is "mixed":
`inner` = G / stride members share a node, so a hierarchical collective drives `inner`
NICs per node and the bus bandwidth is min(NVLink, inner * NIC) (that is how 8x200G
DGX-A100 nodes reach 192 GB/s all-reduce busBW, NVIDIA/nccl#812).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.cluster import Cluster
from autopar.placement import Partial, Placements, Replicate, Shard
from cost_model.efficiency import Efficiency, efficiency_for, nvlink_bus_efficiency


@dataclass(frozen=True, slots=True, kw_only=True)
class AxisLink:
    size: int
    """Devices along the mesh axis."""
    bandwidth_bytes_per_s: float
    """Achievable bus bandwidth per device for ring collectives on this axis."""
    latency_s: float
    tier: str
    """"intra", "inter" or "mixed"."""
    p2p_bandwidth_bytes_per_s: float = 0.0
    """Point-to-point / all-to-all bandwidth per device (one link or one NIC); 0 = bandwidth."""
    ring_hop_latency_s: float = 0.0
    """Mean latency of one ring step; 0 = latency_s. A ring laid out node by node on a
    mixed axis crosses a NIC on 1 hop in `inner` and NVLink on the rest (NCCL's own
    latency model counts intra- and inter-node ring steps apart the same way)."""

    bandwidth_scale: tuple[tuple[str, float], ...] = ()
    """Per collective kind, its busBW relative to `bandwidth_bytes_per_s` (Hardware's
    `collective_bandwidth_scale`; missing kinds 1.0)."""

    base_latency_s: float = 0.0
    """Fixed launch latency of one collective (L0 in the module docstring)."""

    reduce_scatter_all_reduce: bool = False
    """The backend runs a reduce-scatter as an all-reduce of the whole input and keeps its
    chunk (gloo: `GLOO_REDUCE_SCATTER`): it pays the all-reduce's steps and volume."""

    scalar_hop_latency_s: float = 0.0
    """Latency per ring step of an all-reduce of one element (gloo: fewer than 2 n elements
    leave ring segments empty, `Efficiency.scalar_all_reduce_hop_s`); 0 = the ring's."""

    def kind_bandwidth(self, kind: str) -> float:
        return self.bandwidth_bytes_per_s * dict(self.bandwidth_scale).get(kind, 1.0)

    @property
    def ring_latency_s(self) -> float:
        return self.ring_hop_latency_s or self.latency_s

    @property
    def p2p_bandwidth(self) -> float:
        return self.p2p_bandwidth_bytes_per_s or self.bandwidth_bytes_per_s


GLOO_REDUCE_SCATTER = ("torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, "
                       "ProcessGroupGloo::reduce_scatter_tensor_coalesced")
"""Where gloo's reduce-scatter is defined: `_reduce_scatter_base` (what
`reduce_scatter_tensor` and the functional collective call) all-reduces a copy of the whole
input and copies the rank's chunk out. Measured here the same way (the built-in profile's
calibration, 4 ranks on 2 cores): a 4 KiB reduce-scatter over 4 ranks 4.1 ms, an all-reduce
3.7 ms, an all-gather 2.8 ms."""


def runs_gloo(hardware: object) -> bool:
    """The profile's collectives run on gloo (the `cpu` profiles, built-in or calibrated)."""
    return getattr(hardware, "name", "") == "cpu"


def mesh_axis_links(cluster: Cluster, mesh_shape: tuple[int, ...],
                    efficiency: Efficiency | None = None) -> tuple[AxisLink, ...]:
    """One AxisLink per mesh axis (outermost first, last axis fastest over device ids).
    `efficiency` defaults to the cost model's constants with the hardware's overrides."""
    total = math.prod(mesh_shape)
    if total != cluster.num_devices:
        raise ValueError(
            f"mesh {mesh_shape} has {total} devices but cluster {cluster.spec} has "
            f"{cluster.num_devices}; choose axis sizes whose product is {cluster.num_devices}"
        )
    hw = cluster.hardware
    eff = efficiency_for(hw, efficiency)
    per_node = cluster.devices_per_node
    nvlink = hw.intra_node_bandwidth_bytes_per_s * nvlink_bus_efficiency(hw.name, eff)
    nic = hw.inter_node_bandwidth_bytes_per_s * eff.nic_bus_efficiency
    scale = hw.collective_bandwidth_scale
    # core sharing (the cpu profile): ranks time-slice the cores, gloo's steps wait their turn
    share = max(1.0, per_node / hw.cores_per_node) if hw.cores_per_node else 1.0
    nvlink, nic = nvlink / share, nic / share
    lat_share = share ** eff.collective_latency_share_exponent
    base = eff.collective_base_latency_s * lat_share
    intra_lat, inter_lat = hw.intra_node_latency_s * lat_share, hw.inter_node_latency_s * lat_share
    scalar_hop = eff.scalar_all_reduce_hop_s * lat_share
    node_ranks = cluster.node_ranks or per_node
    rs_ar = runs_gloo(hw)
    links = []
    for k, n in enumerate(mesh_shape):
        stride = math.prod(mesh_shape[k + 1:])
        wait = eff.stage_collective_wait_s if share > 1.0 and n > 1 and node_ranks > per_node else 0.0
        if n == 1 or stride * n <= per_node:
            links.append(AxisLink(size=n, bandwidth_bytes_per_s=nvlink, latency_s=intra_lat,
                                  tier="intra", p2p_bandwidth_bytes_per_s=nvlink, bandwidth_scale=scale,
                                  base_latency_s=base + wait, reduce_scatter_all_reduce=rs_ar,
                                  scalar_hop_latency_s=scalar_hop))
        elif stride >= per_node:
            links.append(AxisLink(size=n, bandwidth_bytes_per_s=nic, latency_s=inter_lat,
                                  tier="inter", p2p_bandwidth_bytes_per_s=nic, bandwidth_scale=scale,
                                  base_latency_s=base + wait, reduce_scatter_all_reduce=rs_ar,
                                  scalar_hop_latency_s=scalar_hop))
        else:
            inner = per_node // stride
            hop = (inter_lat + (inner - 1) * intra_lat) / inner
            links.append(AxisLink(size=n, bandwidth_bytes_per_s=min(nvlink, inner * nic),
                                  latency_s=inter_lat, tier="mixed",
                                  p2p_bandwidth_bytes_per_s=nic, ring_hop_latency_s=hop,
                                  bandwidth_scale=scale, base_latency_s=base + wait, reduce_scatter_all_reduce=rs_ar,
                                  scalar_hop_latency_s=scalar_hop))
    return tuple(links)


SCALAR_ELEMENT_BYTES = 4
"""Bytes per element when an all-reduce's size is read as a count of elements (float32,
the reported loss and its weight): only the few-element all-reduces below depend on it."""


def ring_hop_latency_s(size_bytes: float, link: AxisLink) -> float:
    """The latency of one ring step of an all-reduce of `size_bytes`: the link's ring step,
    or on gloo (`scalar_hop_latency_s`) for an input of e < 2 n elements, the measured
    one-element step plus (e - 1) / (2 n - 1) of the difference: gloo's ring
    (gloo/allreduce.cc) cuts its input into at least 2 n segments of at least one element
    and skips the empty ones. Measured (20 back to back, 8 ranks on 2 cores):
    1 / 2 / 4 / 8 / 16 float32 elements 2.2 / 3.0 / 7.1 / 10.4 / 19.1 ms."""
    n = link.size
    full = link.ring_latency_s
    if not link.scalar_hop_latency_s:
        return full
    elements = max(1.0, math.ceil(size_bytes / SCALAR_ELEMENT_BYTES))
    if elements >= 2 * n:
        return full
    scalar = min(link.scalar_hop_latency_s, full)
    return scalar + (full - scalar) * (elements - 1) / (2 * n - 1)


def all_reduce_time_s(size_bytes: float, link: AxisLink) -> float:
    n = link.size
    if n <= 1 or size_bytes <= 0:
        return 0.0
    hop = ring_hop_latency_s(size_bytes, link)
    if link.tier == "intra":
        latency = 2 * (n - 1) * hop
    else:
        latency = min(2 * (n - 1) * hop, 2 * math.ceil(math.log2(n)) * link.latency_s)
    return 2 * (n - 1) / n * size_bytes / link.kind_bandwidth("all_reduce") + latency + link.base_latency_s


def _ring_half_time_s(size_bytes: float, link: AxisLink, kind: str) -> float:
    n = link.size
    if n <= 1 or size_bytes <= 0:
        return 0.0
    return (n - 1) / n * size_bytes / link.kind_bandwidth(kind) + (n - 1) * link.ring_latency_s + link.base_latency_s


def all_gather_time_s(size_bytes: float, link: AxisLink) -> float:
    """`size_bytes` is the gathered (full) tensor."""
    return _ring_half_time_s(size_bytes, link, "all_gather")


def reduce_scatter_time_s(size_bytes: float, link: AxisLink) -> float:
    """`size_bytes` is the full input tensor (each device keeps 1/n of the sum). On gloo
    (`reduce_scatter_all_reduce`): an all-reduce of the whole input at the reduce-scatter's
    own measured bandwidth."""
    if link.reduce_scatter_all_reduce:
        n = link.size
        if n <= 1 or size_bytes <= 0:
            return 0.0
        return 2 * (n - 1) / n * size_bytes / link.kind_bandwidth("reduce_scatter") \
            + collective_latency_s("reduce_scatter", link)
    return _ring_half_time_s(size_bytes, link, "reduce_scatter")


def all_to_all_time_s(size_bytes: float, link: AxisLink) -> float:
    """`size_bytes` is each device's local tensor; (n-1)/n of it leaves the device.
    Across nodes all-to-all cannot aggregate NICs (nccl-tests#267), hence p2p bandwidth."""
    n = link.size
    if n <= 1 or size_bytes <= 0:
        return 0.0
    return (n - 1) / n * size_bytes / link.p2p_bandwidth + (n - 1) * link.latency_s + link.base_latency_s


def send_recv_time_s(size_bytes: float, link: AxisLink) -> float:
    if size_bytes <= 0:
        return 0.0
    return size_bytes / link.p2p_bandwidth + link.latency_s


def reshard_time_s(shape: tuple[int, ...], dtype_bytes: int, src: Placements, dst: Placements,
                   links: tuple[AxisLink, ...]) -> float:
    """Time to redistribute a tensor from `src` to `dst` placements, axis by axis.

    Per axis (DTensor's redistribute): P->R all-reduce, P->S reduce-scatter, S->R
    all-gather, S(i)->S(j) all-to-all, R->S / R->P / S->P local (0). The bytes an axis
    moves are the tensor's bytes divided by the sharding of the other axes at that point.
    """
    if len(src) != len(links) or len(dst) != len(links):
        raise ValueError(f"placements {src} -> {dst} do not match a {len(links)}-axis mesh")
    if src == dst:
        return 0.0
    numel = math.prod(shape)
    current = list(src)
    total = 0.0
    for axis, (a, b) in enumerate(zip(src, dst)):
        if a == b:
            continue
        others = math.prod(links[k].size for k, p in enumerate(current) if k != axis and isinstance(p, Shard))
        size = numel * dtype_bytes / others  # this axis's full tensor (unsharded along it)
        link = links[axis]
        if isinstance(a, Partial) and isinstance(b, Replicate):
            total += all_reduce_time_s(size, link)
        elif isinstance(a, Partial) and isinstance(b, Shard):
            total += reduce_scatter_time_s(size, link)
        elif isinstance(a, Shard) and isinstance(b, Replicate):
            total += all_gather_time_s(size, link)
        elif isinstance(a, Shard) and isinstance(b, Shard):
            total += all_to_all_time_s(size / link.size, link)
        current[axis] = b
    return total


def collective_latency_s(kind: str, link: AxisLink) -> float:
    """The size-independent part of one collective of `kind` on `link` (the alpha terms of
    the functions above, launch latency L0 included): what a bucketed collective pays once
    for all tensors in it."""
    n = link.size
    if n <= 1:
        return 0.0
    if kind == "all_reduce" or (kind == "reduce_scatter" and link.reduce_scatter_all_reduce):
        if link.tier == "intra":
            return 2 * (n - 1) * link.ring_latency_s + link.base_latency_s
        return min(2 * (n - 1) * link.ring_latency_s, 2 * math.ceil(math.log2(n)) * link.latency_s) \
            + link.base_latency_s
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) * link.ring_latency_s + link.base_latency_s
    if kind == "all_to_all":
        return (n - 1) * link.latency_s + link.base_latency_s
    raise ValueError(f"unknown collective kind {kind!r}")


LOSS_BYTES = 4
"""The reported loss: one float32 scalar."""


def loss_report_time_s(loss_placements: Placements, links: tuple[AxisLink, ...],
                       world_link: AxisLink | None = None) -> float:
    """What the runtime spends making a step's loss known (the value `compiled.step`
    returns): a scalar all-reduce on every mesh axis where the loss is Partial
    (autopar/runtime/spmd.py `_global_loss`, on the axis's process group, one axis at a
    time), and for a pipeline (`world_link`: one flat axis over every rank) one more over
    every rank, which hands the last stage's loss to all (autopar/runtime/pipe_spmd.py).
    Latency only. On gloo a one-element all-reduce runs far fewer ring messages than the
    4 KiB ones the ring's latency is measured on (`ring_hop_latency_s`): measured in place
    (S model, dp8 on 2 cores, the report skipped or issued once more in alternate rounds)
    the report cost 0.8-3 ms per step, where the ring's latency priced
    it at 10.2 ms (benchmarks/probes/probe_loss_report.py measures it)."""
    total = sum(all_reduce_time_s(LOSS_BYTES, link) for p, link in zip(loss_placements, links)
                if isinstance(p, Partial))
    if world_link is not None:
        total += all_reduce_time_s(LOSS_BYTES, world_link)
    return total
