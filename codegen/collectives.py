"""The collectives of a per-rank program that are not one op's input edge: gradient
buckets, the gather of updated weights, and the count of a graph's collectives.

Where it sits: codegen, beside codegen/apply.py, which builds the per-rank graphs with
these. `GradSync` is the `grad_sync` graph's function (and, with one microbatch per
step, what the step calls where a bucket's last gradient is computed); `WeightGather`
is the `param_gather` graph's (weight-update sharding); `count_collectives` reads a
per-rank graph's collectives by kind, process group and bytes, as the cost model
defines them (the price = run tests and the build's check compare it with what the
plan priced). `dtensor_of` and `redistribute_to` are the two DTensor steps apply's
interpreter and these share: wrap a local shard, change a placement (pending sums
included).

Each grouping rule here is the one the cost model prices with: gradient buckets by
autopar/buckets.py `gradient_bucket_key` / `plan_buckets` (priced by cost_model/table.py
`ReshardPricer.bucket_key`), weight gathers by `gather_group` (priced by
solver/intra_op/solution.py `update_gathers`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch import fx
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._redistribute import redistribute_local_tensor

from autopar import dtensor_bridge as bridge
from autopar.buckets import UPDATE_PHASE, gather_group, gradient_bucket_key, plan_buckets
from autopar.placement import Placements, redistribute_plan, single_gather_axis, transfer_kind


def dtensor_of(local: torch.Tensor, mesh: DeviceMesh, placements: Placements, shape: Sequence[int],
               stride: Sequence[int]) -> DTensor:
    """The DTensor of this rank's `local` shard, laid out as `placements` over `mesh`, of
    global `shape` and `stride` (no check across ranks: the plan says what each holds)."""
    return DTensor.from_local(local, mesh, bridge.to_dtensor_placements(placements), run_check=False,
                              shape=torch.Size(shape), stride=tuple(stride))


def redistribute_to(t: DTensor, placements: Placements, contiguous: bool) -> DTensor:
    """`t` in `placements` (DTensor's own redistribute, which may also make pending sums:
    the public `.redistribute` refuses those)."""
    target = DTensorSpec(t.device_mesh, bridge.to_dtensor_placements(placements), tensor_meta=t._spec.tensor_meta)
    local = redistribute_local_tensor(t._local_tensor, t._spec, target)
    if contiguous and not local.is_contiguous():
        local = local.contiguous()  # a local chunk of a non-leading dim; views need contiguity
    return DTensor(local, target, requires_grad=False)


def bucket_key(meta: Any, src: Placements, dst: Placements, mesh_shape: tuple[int, ...]) -> tuple | None:
    """The key cost_model/table.py `ReshardPricer.bucket_key` gives `src -> dst` (same rule,
    from the same DTensor plan): all-reduces over one or more axes, or one reduce-scatter,
    every other axis unchanged; None for any other reshard."""
    steps = [(transfer_kind(a, b), axis, logical) for axis, a, b, logical in
             redistribute_plan(meta.shape, src, dst, mesh_shape) if transfer_kind(a, b) != "local"]
    kinds = {t[0] for t in steps}
    if not steps or not (kinds == {"all_reduce"} or (kinds == {"reduce_scatter"} and len(steps) == 1)):
        return None
    axes = {t[1] for t in steps}
    if any(a != b for k, (a, b) in enumerate(zip(src, dst)) if k not in axes):
        return None
    ops = tuple(getattr(src[t[1]], "reduce_op", None) for t in steps)
    if None in ops:
        return None
    return (tuple((t[0], t[1], op) for t, op in zip(steps, ops)), meta.dtype)


class WeightGather:
    """The updated weights from their update placements to their compute placements, once
    per step (weight-update sharding). Weights gathered on one mesh axis travel per layer
    in one flat all-gather (autopar/buckets.py gather_group, phase UPDATE_PHASE, as
    solver/intra_op/solution.py `update_gathers` prices them): the shards packed into one
    buffer, gathered, each weight concatenated out of the gathered rows. Any other change
    of placement through DTensor, one by one."""

    def __init__(self, items: list[tuple[Placements, Placements, Any, int | None]], mesh: DeviceMesh) -> None:
        self.items = items
        self.mesh = mesh
        self.groups: dict[tuple, list[int]] = {}
        self.alone: list[int] = []
        for i, (update, compute, slot, layer) in enumerate(items):
            axis = single_gather_axis(update, compute)
            if axis is None:
                self.alone.append(i)
            else:
                self.groups.setdefault(gather_group(layer, UPDATE_PHASE, axis, slot.dtype), []).append(i)

    def __call__(self, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out: dict[int, torch.Tensor] = {}
        for i in self.alone:
            update, compute, slot, _ = self.items[i]
            out[i] = redistribute_to(dtensor_of(shards[i], self.mesh, update, slot.shape,
                                            make_contiguous_strides_for(slot.shape)), compute, True)._local_tensor
        for key, members in self.groups.items():
            axis = key[2]
            n = self.mesh.shape[axis]
            flat = torch.cat([shards[i].reshape(-1) for i in members])
            rows = funcol.all_gather_single(flat, 0, (self.mesh, axis)).view(n, -1)
            offset = 0
            for i in members:
                update, _, _, _ = self.items[i]
                local, size = shards[i], shards[i].numel()
                out[i] = torch.cat([rows[r, offset:offset + size].view(local.shape) for r in range(n)],
                                   dim=update[axis].dim)
                offset += size
        return tuple(out[i] for i in range(len(self.items)))


class GradSync:
    """Bring raw gradients to their parameters' placements, bucketed: one flat all-reduce
    or reduce-scatter per bucket (autopar/buckets.py, in `order`: graph order of the
    gradients, as the pricing takes them; reduce-scatters per layer), other gradients
    through DTensor one by one.

    Called on all raw gradients, it is the `grad_sync` graph's function; `issue` starts one
    bucket's collective (what the step calls where the bucket's last gradient is computed)
    and `wait` ends it: an all-reduce where its result is first needed, the end of the step;
    a reduce-scatter as the next one starts, one in flight, as FSDP bounds it (codegen/apply.py
    `run`). Between the two, the collective runs beside the backward, on NCCL's
    communication stream or in gloo's own threads: the functional collectives return at
    once, and `_c10d_functional.wait_tensor` blocks until the work is done (the async
    semantics of torch.distributed._functional_collectives; in the recorded per-rank graph
    each bucket's wait node comes after backward ops issued after its collective, so the
    program overlaps what the cost model hides: cost_model/table.py `exposed_sync_s`). This
    is the overlap of
    PyTorch DDP's and FSDP's bucketed reductions (Zhao et al., "PyTorch FSDP", arXiv
    2304.11277, Sec. 3.3; Megatron-LM's `overlap_grad_reduce`). The grad_sync graph issues
    every bucket before it waits on any, so one bucket's collective runs while the next is
    packed.

    Each bucket is one flat buffer, filled piece by piece: a raw gradient is copied in and
    (fx frees a value after its last use; the grad_sync graph is called boxed) freed at
    once, and the buffer's pages are touched as they are filled, so a bucket's sync holds
    about one copy of its gradients, not raw + flat + the collective's output: the
    all-reduce runs in place on the buffer (the functional all_reduce clones its input).

    Buffers are in `dtype`, the precision policy's reduction dtype: a bf16-mixed step's
    bf16 gradients are cast as they are copied in and reduced in float32 (the bytes the
    ILP prices for the sync: cost_model/table.py `gradient_sync_scale`).

    `functional`: the functional all-reduce instead of the in-place one, for graphs that
    Inductor compiles (AOTAutograd cannot functionalise an in-place custom op; Inductor
    reinplaces the functional one: codegen/inductor.py)."""

    def __init__(self, grads: list[tuple[str, Placements, Placements, Any]], layers: list[int | None],
                 mesh: DeviceMesh, order: list[int], dtype: torch.dtype = torch.float32,
                 functional: bool = False) -> None:
        self.dtype = dtype
        self.functional = functional
        self.grads = grads
        self.mesh = mesh
        self.mesh_shape = tuple(mesh.shape)
        self.keys = {i: bucket_key(grads[i][3], grads[i][1], grads[i][2], self.mesh_shape)
                     if grads[i][1] != grads[i][2] else None for i in order}
        sizes = {i: grads[i][3].size_bytes for i in order}  # as the pricing sizes them
        items = [(gradient_bucket_key(self.keys[i], layers[i]), sizes[i]) for i in order]
        self.buckets = [[order[k] for k in bucket] for bucket in plan_buckets(items)]

    def __call__(self, *raw: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out: dict[int, torch.Tensor] = {}
        pending = [self.issue(bucket, {i: raw[i] for i in bucket}) for bucket in self.buckets]
        for issued in pending:
            out.update(self.wait(issued))
        return tuple(out[i] for i in range(len(raw)))

    def _pack(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """One flat buffer in the reduction dtype holding `pieces` in order. Eager: filled
        piece by piece (each piece freed once copied, the class docstring). Functional
        (Inductor): one `cat`, a single kernel; the copies into slices of one buffer would
        be functionalised into a scatter per piece, each rewriting the whole buffer."""
        if self.functional:
            return torch.cat([p.reshape(-1).to(self.dtype) for p in pieces])
        flat = pieces[0].new_empty(sum(p.numel() for p in pieces), dtype=self.dtype)
        offset = 0
        for p in pieces:
            flat[offset:offset + p.numel()].copy_(p.reshape(-1))
            offset += p.numel()
        return flat

    def reduce(self, bucket: list[int], raw: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """{gradient index: synced local gradient} of one bucket, from its raw local ones,
        waited at once (`issue` then `wait`)."""
        return self.wait(self.issue(bucket, raw))

    def scatters(self, bucket: list[int]) -> bool:
        """Whether `bucket` is one flat reduce-scatter (its input, the full-size gradients,
        is held until its wait; an all-reduce bucket reduces in place)."""
        key = self.keys[bucket[0]]
        return key is not None and key[0][0][0] == "reduce_scatter"

    def issue(self, bucket: list[int], raw: dict[int, torch.Tensor]) -> tuple[Any, dict[int, Any]]:
        """Start one bucket's sync: (its collective's output, not waited on, or None;
        {gradient index: shape in the output, or the synced gradient where the bucket is
        not one flat collective}). Pass it to `wait` where the gradients are needed."""
        mesh, grads, mesh_shape = self.mesh, self.grads, self.mesh_shape
        key = self.keys[bucket[0]]
        if key is None:  # DTensor's redistribute, one gradient at a time (it waits itself)
            out: dict[int, Any] = {}
            for i in bucket:
                _, src, dst, meta = grads[i]
                g = raw[i].to(self.dtype) if raw[i].is_floating_point() else raw[i]
                out[i] = g if src == dst else redistribute_to(
                    dtensor_of(g, mesh, src, meta.shape, meta.strides), dst, True)._local_tensor
            return None, out
        steps, _ = key
        if steps[0][0] == "all_reduce":
            shapes = {i: raw[i].shape for i in bucket}
            flat = self._pack([raw[i] for i in bucket])
            reduce = torch.ops._c10d_functional.all_reduce if self.functional \
                else torch.ops._c10d_functional.all_reduce_
            for k, (_, axis, reduce_op) in enumerate(steps):
                if k:  # a bucket over several axes: each all-reduce reads the one before
                    flat = torch.ops._c10d_functional.wait_tensor(flat)
                flat = reduce(flat, reduce_op.lower(), funcol._resolve_group_name((mesh, axis)))
            return flat, shapes
        ((_, axis, reduce_op),) = steps
        n = mesh_shape[axis]
        pieces = {i: raw[i].chunk(n, dim=grads[i][2][axis].dim) for i in bucket}
        local = {i: pieces[i][0].shape for i in bucket}
        # rank r's share of the bucket (its pieces, in bucket order) at r * (one share's numel)
        flat = self._pack([pieces[i][r] for r in range(n) for i in bucket])
        return torch.ops._c10d_functional.reduce_scatter_tensor(
            flat, reduce_op.lower(), n, funcol._resolve_group_name((mesh, axis))), local

    @staticmethod
    def wait(issued: tuple[Any, dict[int, Any]]) -> dict[int, torch.Tensor]:
        """{gradient index: synced local gradient} of a bucket `issue` started: waits on its
        collective, then views its gradients out of the flat output."""
        flat, shapes = issued
        if flat is None:
            return shapes
        return _unpack(torch.ops._c10d_functional.wait_tensor(flat), shapes)


class StepSync:
    """One step's gradient buckets as the step issues them (codegen/apply.py `run`, one
    microbatch per step): each bucket's collective starts where its last gradient is
    computed and is waited later, so it runs beside the backward. An all-reduce bucket
    (reduced in place: waiting holds nothing more) is waited at the end of the step, where
    its gradients are first needed. A reduce-scatter's input, a layer's full-size gradients,
    lives until its wait, so one is in flight at a time, as FSDP bounds it: each is waited
    as the next one starts, after the next layer's backward ran beside it, and the layer's
    full-size gradients are freed then, not held to the end of the backward."""

    def __init__(self, sync: GradSync) -> None:
        self.sync = sync
        self.pending: list[tuple] = []  # all-reduce buckets in flight
        self.scattering: list[tuple] = []  # the reduce-scatter bucket in flight
        self.synced: dict[int, torch.Tensor] = {}

    def reduce(self, bucket: list[int], raw: dict[int, torch.Tensor]) -> None:
        """Start `bucket`'s collective on its raw local gradients (`GradSync.issue`)."""
        issued = self.sync.issue(bucket, raw)
        if not self.sync.scatters(bucket):
            self.pending.append(issued)
            return
        for before in self.scattering:
            self.synced.update(self.sync.wait(before))
        self.scattering = [issued]

    def finish(self) -> dict[int, torch.Tensor]:
        """Wait every bucket still in flight: {gradient index: synced local gradient}."""
        for issued in self.pending + self.scattering:
            self.synced.update(self.sync.wait(issued))
        self.pending, self.scattering = [], []
        return self.synced


def _unpack(flat: torch.Tensor, shapes: dict[int, torch.Size]) -> dict[int, torch.Tensor]:
    """{index: view of `flat`}: the pieces of a bucket's flat buffer, packed in `shapes`' order."""
    out, offset = {}, 0
    for i, shape in shapes.items():
        out[i] = flat[offset:offset + shape.numel()].view(shape)
        offset += shape.numel()
    return out


_SHARD_DIM_ALLTOALL = torch.ops._dtensor.shard_dim_alltoall.default
"""The op DTensor's redistribute records for an all-to-all on a non-CPU mesh."""


def count_collectives(gm: fx.GraphModule, where: Any = None) -> dict[tuple[str, str], list[int]]:
    """{(kind, process group name): [bytes per call, ...]} over a per-rank graph, bytes as
    cost_model/table.py `Collective` defines them (all_gather: gathered output); `where(node)`,
    if given, picks the collective nodes counted."""
    out: dict[tuple[str, str], list[int]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is _SHARD_DIM_ALLTOALL:
            # DTensor's Shard(i) -> Shard(j) on a non-CPU mesh: one all-to-all of the local
            # shard (a CPU mesh all-gathers instead, a _c10d_functional node)
            if where is None or where(node):
                source = node.args[0].meta.get("val")
                out.setdefault(("all_to_all", str(node.args[-1])), []).append(
                    int(source.numel() * source.element_size()))
            continue
        if not str(node.target).startswith("_c10d_functional."):
            continue
        if where is not None and not where(node):
            continue
        kind = str(node.target).split(".")[1]
        if kind == "wait_tensor":
            continue
        value = node.meta.get("val")
        source = node.args[0].meta.get("val")
        if kind.startswith("all_gather"):
            kind, nbytes = "all_gather", value.numel() * value.element_size()
        elif kind.startswith("reduce_scatter"):
            kind, nbytes = "reduce_scatter", source.numel() * source.element_size()
        elif kind.startswith("all_reduce"):
            kind, nbytes = "all_reduce", source.numel() * source.element_size()
        else:
            nbytes = source.numel() * source.element_size()
        group = node.args[-1]
        out.setdefault((kind, str(group)), []).append(int(nbytes))
    return out
