"""Shared test settings.

- One torch thread: a 2-core machine, and tests run beside each other.
- TRITON_INTERPRET=1 before anything imports triton (torch.distributed.tensor and
  torch._inductor do): on a machine without a GPU, Triton kernels run only in its
  interpreter, and triton reads the variable once, at import.
- `no_ranks_started`: a fixture that records and refuses every process start, for the
  bad-input tests that must fail before any rank starts.
- `fake_mesh(shape)`: a DeviceMesh over torch's fake process group (rank 0 of the mesh's
  size; no communication), for the single-process tests of DTensor dispatch.
- The repository root on sys.path, so `tests.factories:NAME` resolves as a model factory
  here and in spawned ranks (they inherit sys.path), whatever the working directory.
- No launcher's world: a suite started inside a torchrun or SLURM job step would see
  RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT and `autopar train --devices N` would join
  that world instead of spawning its own ranks (autopar.runtime.launch
  `launched_by_torchrun`); the tests that need a launcher's world set it themselves. Nor
  the test-only hooks (`AUTOPAR_TEST_*`) a shell may have left set: the tests that use one
  set it themselves.
"""

import contextlib
import math
import multiprocessing.process
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
for _name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID",
              *[n for n in os.environ if n.startswith("AUTOPAR_TEST_")]):
    os.environ.pop(_name, None)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def no_ranks_started(monkeypatch):
    """Records (and refuses) every process start: autopar.runtime.launch.spawn and
    torch.multiprocessing both start ranks through multiprocessing's Process.start."""
    started: list[str] = []

    def refuse(process: multiprocessing.process.BaseProcess) -> None:
        started.append(process.name)
        raise AssertionError(f"{process.name} was started: bad input must be refused before any rank starts")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    yield started
    assert started == [], started
    assert not dist.is_initialized()


@contextlib.contextmanager
def fake_mesh(shape: tuple[int, ...], names: tuple[str, ...] = ("dp", "tp")):
    """A (dp, tp) DeviceMesh of `shape` over torch's fake process group, as rank 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
    try:
        yield init_device_mesh("cpu", shape, mesh_dim_names=names)
    finally:
        dist.destroy_process_group()
