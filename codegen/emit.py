"""Writing per-rank programs as source: a fake process group to build them on, the text, and the files.

Where it sits: codegen, behind `autopar search --emit DIR` (autopar/build/emit.py
`emit_plan`): the per-rank build constructs a plan's programs against the DeviceMesh of
`fake_world` (a `fake` process group: collectives are recorded in the graph, nothing runs
and nothing is communicated), `program_source` renders each (codegen/apply.py stores it as
`RankGraphs.source`) and `write` puts it in a file. The
template baseline's module-level source (benchmarks/baselines/template/emit.py) uses the
same fake world.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, _redistribute
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopar.ir import Role


def _clear_dtensor_caches() -> None:
    # DTensor caches redistribution plans and sharding decisions keyed by value-equal
    # meshes; after the fake process group is re-created the cached entries name dead
    # process groups ("Could not resolve the process group"), so drop them per fake world.
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()


def write(sources: dict[str, str], directory: str | Path) -> list[Path]:
    """Write each stage's source to `<directory>/<stage>.py`; returns the paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, source in sorted(sources.items()):
        path = out / f"{name}.py"
        path.write_text(source)
        paths.append(path)
    return paths


@contextlib.contextmanager
def fake_world(shape: tuple[int, ...], names: tuple[str, ...]) -> Iterator[DeviceMesh]:
    """A DeviceMesh of `shape` on a `fake` process group, as its rank 0: programs are
    built and traced against it, nothing runs and nothing is communicated."""
    if dist.is_initialized():
        raise ValueError("emitting a plan needs no process group; call it outside a job")
    _clear_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
    try:
        yield init_device_mesh("cpu", shape, mesh_dim_names=names)
    finally:
        dist.destroy_process_group()
        _clear_dtensor_caches()


def slot_name(slot: Any) -> str:
    """A program input's name in its source: p_<parameter>, b_<buffer>, or the input's own."""
    prefix = {Role.PARAMETER: "p_", Role.BUFFER: "b_"}.get(slot.role, "")
    return prefix + slot.name


def program_source(program: Any) -> str:
    """One rank's program (codegen/apply.py RankGraphs) as source: a header naming its mesh,
    inputs and outputs, the step graph, and the gradient sync and weight gather graphs."""
    header = [
        f"# autopar per-rank program on a mesh {list(program.mesh_shape)}: ATen ops on this rank's local shards",
        "# plus the _c10d_functional collectives the plan's placements imply (one per priced reshard).",
        "# inputs: " + ", ".join(f"{slot_name(s)}{s.placements and ' ' + '(' + ', '.join(map(str, s.placements)) + ')'}"
                                 for s in program.slots),
        f"# returns (loss {tuple(map(str, program.loss_placements))}, raw gradients); grad_sync below brings each "
        "gradient to its parameter's placement once per step." if program.grad_sync is not None else
        f"# returns (loss {tuple(map(str, program.loss_placements))}, gradients in their parameters' placements): "
        "each gradient bucket is reduced in the step, where its last gradient is computed.",
    ]
    sync = "" if program.grad_sync is None else "\n\n# grad_sync\n" + program.grad_sync.code
    if program.param_gather is not None:
        sync += ("\n\n# param_gather: the updated weights from their update placement to their compute placement, "
                 "once per step\n" + program.param_gather.code)
    return "\n".join(header) + "\n" + program.step.code + sync
