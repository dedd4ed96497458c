"""codegen/apply.py: tensor outputs an op's DTensor rule leaves unplaced (CUDA flash attention's
philox offset) are wrapped where the plan chose them replicated, and only there."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate as DReplicate, Shard as DShard

from autopar.placement import Replicate, Shard
from autopar.sharding import NodeStrategy
from codegen.apply import _wrap_replicated_plain_outputs
from tests.conftest import fake_mesh


@pytest.fixture
def mesh():
    with fake_mesh((1, 1)) as m:
        yield m


def _dt(t: torch.Tensor, mesh, placements) -> DTensor:
    return DTensor.from_local(t, mesh, placements, run_check=False)


def test_plain_output_chosen_replicated_becomes_a_replicated_dtensor(mesh) -> None:
    out = (_dt(torch.randn(2, 3), mesh, (DShard(0), DReplicate())), None, torch.tensor(7), torch.zeros(0))
    choice = NodeStrategy(outputs=((Shard(0), Replicate()), (Replicate(), Replicate()), (Replicate(), Replicate())),
                          inputs=())
    wrapped = _wrap_replicated_plain_outputs(out, choice, mesh)
    assert isinstance(wrapped, tuple) and wrapped[0] is out[0] and wrapped[1] is None
    assert all(isinstance(wrapped[i], DTensor) for i in (2, 3))
    assert wrapped[2].placements == (DReplicate(), DReplicate()) and int(wrapped[2].to_local()) == 7
    assert wrapped[3].shape == (0,)


def test_plain_output_chosen_sharded_or_miscounted_is_left_for_the_check(mesh) -> None:
    first = _dt(torch.randn(2, 3), mesh, (DReplicate(), DReplicate()))
    out = (first, torch.tensor(7))
    sharded = NodeStrategy(outputs=((Replicate(), Replicate()), (Shard(0), Replicate())), inputs=())
    assert _wrap_replicated_plain_outputs(out, sharded, mesh) is out
    miscounted = NodeStrategy(outputs=((Replicate(), Replicate()),), inputs=())
    assert _wrap_replicated_plain_outputs(out, miscounted, mesh) is out
    assert _wrap_replicated_plain_outputs(first, sharded, mesh) is first
