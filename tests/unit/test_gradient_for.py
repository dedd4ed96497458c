"""`gradient_for`: a rank's gradient shard as its DTensor parameter's `.grad`, the cheap way
where the shard matches the parameter's local tensor (a shard of the same shape and dtype
laid out otherwise, such as a transposed weight gradient, is first copied into the
parameter's layout), `from_local` otherwise; both give the DTensor `from_local` would."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from autopar.runtime.program import gradient_for
from tests.conftest import fake_mesh


@pytest.fixture
def mesh():
    with fake_mesh((2, 2)) as m:
        yield m


@pytest.mark.parametrize("placements", [(Replicate(), Replicate()), (Replicate(), Shard(0)), (Shard(1), Shard(0))])
def test_gradient_matches_from_local(mesh, placements) -> None:
    param = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 6), mesh, list(placements), src_data_rank=None))
    local = torch.randn(param._local_tensor.shape)
    got = gradient_for(param, local)
    want = DTensor.from_local(local, mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride())
    assert isinstance(got, DTensor) and got._local_tensor is local
    assert got.placements == want.placements and got.shape == want.shape and got.stride() == want.stride()
    assert got._spec == want._spec and not got.requires_grad
    param.grad = got  # accepted as the parameter's gradient
    assert param.grad is got


def test_a_shard_unlike_the_parameter_is_laid_out_as_the_parameter_or_goes_through_from_local(mesh) -> None:
    param = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 6), mesh, [Replicate(), Shard(0)], src_data_rank=None))
    wide = torch.randn(6, 4).t()  # the local shape, another stride (a transposed weight's gradient)
    assert wide.shape == param._local_tensor.shape and wide.stride() != param._local_tensor.stride()
    got = gradient_for(param, wide)
    assert torch.equal(got._local_tensor, wide) and got._local_tensor.stride() == param._local_tensor.stride()
    assert got._spec == param._spec
    half = torch.randn(param._local_tensor.shape, dtype=torch.float64)
    assert gradient_for(param, half).dtype == torch.float64


def test_a_plain_parameter_keeps_the_plain_gradient() -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    g = torch.ones(3)
    assert gradient_for(param, g) is g
