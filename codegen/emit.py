"""Writing per-rank programs as source: a fake process group to build them on, and the files.

Where it sits: codegen, behind `autopar search --emit DIR` (autopar/build/emit.py
`emit_plan`): the per-rank build constructs a plan's programs against the DeviceMesh of
`fake_world` (a `fake` process group: collectives are recorded in the graph, nothing runs
and nothing is communicated) and `write` puts each program's source in a file. The
template baseline's module-level source (benchmarks/baselines/template/emit.py) uses the
same fake world.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor


def _clear_dtensor_caches() -> None:
    # DTensor caches redistribution plans and sharding decisions keyed by value-equal
    # meshes; after the fake process group is re-created the cached entries name dead
    # process groups ("Could not resolve the process group"), so drop them per fake world.
    from torch.distributed.tensor import _redistribute

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
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ValueError("emitting a plan needs no process group; call it outside a job")
    _clear_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
    try:
        yield init_device_mesh("cpu", shape, mesh_dim_names=names)
    finally:
        dist.destroy_process_group()
        _clear_dtensor_caches()
