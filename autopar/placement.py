"""Placements: how one tensor is laid out over a device mesh, torch-free.

Where it sits: shared data for strategies (solver/), costs (cost_model/), plans and
codegen. Mirrors DTensor: one entry per mesh axis, `Shard(dim)`, `Replicate()` or
`Partial(reduce_op)` (a pending reduction: "sum" or "avg"; a vocabulary-sharded
embedding lookup is a pending sum too, its rows outside a device's shard zeroed).
Text form, as in plan files and explain output: `S(0)`, `R`, `P` (sum), `P(avg)`; a
tuple of them for an N-D mesh, e.g. `(S(0), R)` = batch-sharded over axis 0, replicated
over axis 1.

Terms: an *axis* is a mesh axis, a *dim* a tensor dimension.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


PARTIAL_REDUCE_OPS = ("sum", "avg")
"""Pending reductions a placement may carry (DTensor also has max/min; autopar's strategy
space leaves those out: no op of a training step needs them across devices)."""


@dataclass(frozen=True, slots=True)
class Partial:
    """Each device holds a partial value; a reduction (`reduce_op`) over the axis makes it."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in PARTIAL_REDUCE_OPS:
            raise ValueError(f"Partial reduce_op must be one of {PARTIAL_REDUCE_OPS}, got {self.reduce_op!r}")

    def __str__(self) -> str:
        return "P" if self.reduce_op == "sum" else f"P({self.reduce_op})"


Placement = Shard | Replicate | Partial
Placements = tuple[Placement, ...]

_SHARD = re.compile(r"^S\((\d+)\)$")
_PARTIAL = re.compile(r"^P\((\w+)\)$")


def is_partial(p: Placement) -> bool:
    """A pending reduction of any kind."""
    return isinstance(p, Partial)


def parse_placement(text: str) -> Placement:
    text = text.strip()
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    match = _SHARD.match(text)
    if match:
        return Shard(int(match.group(1)))
    match = _PARTIAL.match(text)
    if match and match.group(1) in PARTIAL_REDUCE_OPS:
        return Partial(match.group(1))
    raise ValueError(f"unknown placement {text!r}; expected R, P, P(avg) or S(<dim>)")


def format_placements(placements: Placements) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"


def parse_placements(text: str) -> Placements:
    body = text.strip().removeprefix("(").removesuffix(")")
    return tuple(parse_placement(part) for part in re.split(r",\s*(?![^()]*\))", body) if part.strip())


def local_shape(shape: tuple[int, ...], placements: Placements, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Per-device shape (ceil division, as DTensor pads the last shard)."""
    if len(placements) != len(mesh_shape):
        raise ValueError(f"{len(placements)} placements for a {len(mesh_shape)}-axis mesh {mesh_shape}")
    out = list(shape)
    for p, size in zip(placements, mesh_shape):
        if isinstance(p, Shard):
            out[p.dim] = -(-out[p.dim] // size)
    return tuple(out)


def shard_factor(placements: Placements, mesh_shape: tuple[int, ...]) -> int:
    """How many ways the tensor's elements are split (product of sharded axis sizes)."""
    factor = 1
    for p, size in zip(placements, mesh_shape):
        if isinstance(p, Shard):
            factor *= size
    return factor


def evenly_divisible(shape: tuple[int, ...], placements: Placements, mesh_shape: tuple[int, ...]) -> bool:
    """True when every sharded dim divides evenly (strategies only emit those)."""
    sizes = list(shape)
    for p, size in zip(placements, mesh_shape):
        if isinstance(p, Shard):
            if p.dim >= len(sizes) or sizes[p.dim] % size:
                return False
            sizes[p.dim] //= size
    return True


def redistribute_plan(shape: tuple[int, ...], src: Placements, dst: Placements, mesh_shape: tuple[int, ...]
                      ) -> list[tuple[int, Placement, Placement, tuple[int, ...]]]:
    """The steps DTensor's redistribute takes from `src` to `dst` (its greedy planner for
    default shard order: torch 2.13 `DTensorRedistributePlanner.generate_greedy_transform_infos`,
    restated torch-free so pricing needs no DTensor objects; tests check it step for step
    against DTensor's own). Each step is (mesh axis, from, to, logical shape on that axis:
    the tensor as the axis sees it, divided by the shards of the axes before it)."""
    logical = [list(shape)]
    for i, p in enumerate(src):
        current = logical[i]
        if isinstance(p, Shard) and i < len(mesh_shape) - 1:
            nxt = list(current)
            nxt[p.dim] = -(-current[p.dim] // mesh_shape[i])
            logical.append(nxt)
        else:
            logical.append(current)
    return [(axis, a, b, tuple(logical[axis])) for axis, a, b in redistribute_steps(tuple(src), tuple(dst),
                                                                                     tuple(mesh_shape))]


@functools.lru_cache(maxsize=65536)
def redistribute_steps(src: Placements, dst: Placements, mesh_shape: tuple[int, ...]
                       ) -> tuple[tuple[int, Placement, Placement], ...]:
    """`redistribute_plan`'s (mesh axis, from, to) steps: they depend on the placements and
    the mesh only, not on the tensor's shape, so the search's pricing (about 300,000
    reshards of a DeepSeek-V3-like model) plans each distinct pair once."""
    if len(mesh_shape) == 1:
        return ((0, src[0], dst[0]),) if src[0] != dst[0] else ()
    current_pl, target_pl = list(src), list(dst)
    steps: list[tuple[int, Placement, Placement]] = []
    if any(isinstance(p, Shard) and n > 1 for p, n in zip(src, mesh_shape)):
        for axis in reversed(range(len(current_pl))):
            current, target = current_pl[axis], target_pl[axis]
            if isinstance(target, Shard):
                before_now = [i for i in range(axis) if current_pl[i] == Shard(target.dim)]
                before_target = [i for i in range(axis) if target_pl[i] == Shard(target.dim)]
                if before_now != before_target:
                    target = Replicate()  # clear a nested shard before resharding
            if current != target:
                steps.append((axis, current, target))
                current_pl[axis] = target
    for axis, (current, target) in enumerate(zip(current_pl, target_pl)):
        if current != target:
            steps.append((axis, current, target))
            current_pl[axis] = target
    return tuple(steps)


def transfer_kind(src: Placement, dst: Placement) -> str:
    """The collective one redistribute step runs: all_reduce, reduce_scatter, all_gather,
    all_to_all, or local (chunking or partitioning: no communication)."""
    if isinstance(src, Partial) and isinstance(dst, Replicate):
        return "all_reduce"
    if isinstance(src, Partial) and isinstance(dst, Shard):
        return "reduce_scatter"
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return "all_gather"
    if isinstance(src, Shard) and isinstance(dst, Shard):
        return "all_to_all"
    return "local"


def communicates(src: Placements, dst: Placements) -> bool:
    """Whether `src -> dst` runs a collective on some axis (turning a replica into a shard
    or a pending sum is local). An activation's communicating reshard runs once per phase
    and target for all its readers (solver/intra_op/shared_rows.py); a local one per reader."""
    return any(transfer_kind(a, b) != "local" for a, b in zip(src, dst) if a != b)


def redistribute_supported(src: Placements, dst: Placements) -> bool:
    """Whether DTensor can redistribute `src` to `dst` at all: it cannot turn a shard into
    a pending sum, nor one kind of pending reduction into another."""
    for a, b in zip(src, dst):
        if a != b and isinstance(b, Partial) and not isinstance(a, Replicate):
            return False
    return True


def single_gather_axis(src: Placements, dst: Placements) -> int | None:
    """The mesh axis k where `src -> dst` is one all-gather: src[k] = Shard(d), dst[k] =
    Replicate, every other axis unchanged and none of them sharding dim d too (nested
    shards of one dim reorder chunks); None otherwise. Parameter gathers of this kind travel
    in groups (autopar/buckets.py gather_group)."""
    differ = [k for k, (a, b) in enumerate(zip(src, dst)) if a != b]
    if len(differ) != 1:
        return None
    k = differ[0]
    a, b = src[k], dst[k]
    if not isinstance(a, Shard) or not isinstance(b, Replicate):
        return None
    if any(isinstance(p, Shard) and p.dim == a.dim for i, p in enumerate(src) if i != k):
        return None
    return k


def boundary_placements(shape: Sequence[int], rows: int, dp: int) -> Placements:
    """The layout a boundary value travels in between two chunks on a (dp, tp) submesh:
    split over dp by its first dim where that dim is the microbatch's rows, else whole."""
    split = dp > 1 and len(shape) > 0 and shape[0] == rows and rows % dp == 0
    return (Shard(0) if split else Replicate(), Replicate())
