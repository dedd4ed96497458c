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


def test_a_backward_graph_adds_each_gradient_into_its_sum_where_it_is_computed() -> None:
    """autopar/build/pipeline.py `accumulate_in_graph`: a pipeline chunk's backward adds each
    raw gradient into an accumulator right after the node that computes it (so fx frees the
    microbatch gradient there), returns the accumulators themselves, and leaves the other
    outputs (input gradients) as they were."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar.build.pipeline import accumulate_in_graph

    def backward(saved: torch.Tensor, seed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        g_w = saved * seed  # a parameter's gradient
        g_b = seed.sum(0) * 2.0  # another's, computed later
        return g_w, (g_b * 0.5).half(), saved * 3.0  # the last one: an input's gradient

    gm = make_fx(backward)(torch.ones(2, 3), torch.ones(2, 3))
    specs = accumulate_in_graph(gm, 2, torch.float32)
    assert specs == [((2, 3), torch.float32, torch.device("cpu")), ((3,), torch.float32, torch.device("cpu"))]
    nodes = list(gm.graph.nodes)
    adds = [n for n in nodes if n.target is torch.ops.aten.add_.Tensor]
    assert len(adds) == 2
    for add in adds:  # right after the gradient it adds, so nothing holds the gradient past it
        assert nodes.index(add) == nodes.index(add.args[1]) + 1
    sums = [torch.zeros(2, 3), torch.zeros(3)]
    saved, seed = torch.full((2, 3), 2.0), torch.full((2, 3), 0.5)
    for microbatch in range(1, 4):
        out = gm(saved, seed, *sums)
        assert out[0] is sums[0] and out[1] is sums[1]  # the sums, written in place
        assert torch.equal(sums[0], torch.full((2, 3), 1.0 * microbatch))
        assert torch.equal(sums[1], torch.full((3,), 1.0 * microbatch))  # a half gradient summed in float32
        assert torch.equal(out[2], torch.full((2, 3), 6.0))


def test_a_gradient_that_is_a_graph_input_is_added_after_the_inputs() -> None:
    """A parameter gradient the backward receives as it is (a tangent returned as is) is
    added after the graph's inputs, the accumulators among them."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar.build.pipeline import accumulate_in_graph

    gm = make_fx(lambda seed, other: (seed, other * 2.0))(torch.ones(3), torch.ones(3))
    assert accumulate_in_graph(gm, 2, torch.float32) == [((3,), torch.float32, torch.device("cpu"))] * 2
    sums = [torch.zeros(3), torch.zeros(3)]
    for microbatch in (1, 2):
        out = gm(torch.full((3,), 0.5), torch.ones(3), *sums)
        assert out[0] is sums[0] and torch.equal(sums[0], torch.full((3,), 0.5 * microbatch))
        assert torch.equal(sums[1], torch.full((3,), 2.0 * microbatch))
