"""Gradient accumulation across a step's microbatches (autopar/runtime/spmd.py `accumulate`):
in place where that is safe, out of place where writing would corrupt another tensor."""

from __future__ import annotations

import torch

from autopar.runtime.spmd import accumulate


def test_first_microbatch_is_kept_and_later_ones_add_in_place() -> None:
    first = [torch.ones(4), torch.full((2, 3), 2.0)]
    kept = accumulate(None, first)
    assert all(a is b for a, b in zip(kept, first))
    out = accumulate(kept, [torch.ones(4), torch.ones(2, 3)])
    assert out[0] is first[0] and out[1] is first[1]  # written into, no new tensors
    assert torch.equal(out[0], torch.full((4,), 2.0)) and torch.equal(out[1], torch.full((2, 3), 3.0))


def test_gradients_sharing_storage_are_added_out_of_place() -> None:
    base = torch.zeros(8)
    a, b = base[:4], base[4:]  # two gradients viewing one buffer
    out = accumulate([a, b], [torch.ones(4), torch.full((4,), 2.0)])
    assert torch.equal(base, torch.zeros(8))  # the shared buffer is untouched
    assert torch.equal(out[0], torch.ones(4)) and torch.equal(out[1], torch.full((4,), 2.0))


def test_program_inputs_and_expanded_tensors_are_never_written() -> None:
    param = torch.ones(3)
    expanded = torch.zeros(()).expand(5)  # one element behind five: add_ would refuse or corrupt
    out = accumulate([param, expanded], [torch.ones(3), torch.ones(5)],
                     keep=frozenset({param.untyped_storage().data_ptr()}))
    assert torch.equal(param, torch.ones(3))
    assert torch.equal(out[0], torch.full((3,), 2.0)) and out[0] is not param
    assert torch.equal(out[1], torch.ones(5)) and out[1] is not expanded
