"""The precision policy (autopar/precision.py): its bytes per parameter, its names and
defaults, bad input, and the traced step in the compute dtype with the policy recorded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.config import ParallelConfig
from autopar.precision import cast_parameters, default_policy, of_model, policy
from autopar.trace import trace_step

N = 8

# (policy, zero) -> bytes per parameter element on one of N data-parallel ranks: the compute
# placement whole (zero 0-2) or split N ways (zero 3), the update placement whole (zero 0) or
# split; ZeRO-2 accumulates its gradient on the update shard
CLOSED_FORMS = {
    ("fp32", 0): 4 + 4 + 8, ("fp32", 1): 4 + 4 + 12 / N, ("fp32", 2): 4 + 16 / N, ("fp32", 3): 16 / N,
    ("bf16-mixed", 0): 2 + 4 + 4 + 8, ("bf16-mixed", 1): 6 + 12 / N, ("bf16-mixed", 2): 2 + 16 / N,
    ("bf16-mixed", 3): 18 / N,
    ("bf16", 0): 2 + 4 + 4, ("bf16", 1): 2 + 4 + 6 / N, ("bf16", 3): 10 / N,
}


@pytest.mark.parametrize("name, zero", sorted(CLOSED_FORMS))
def test_state_bytes_per_element_closed_forms(name, zero) -> None:
    computed = N if zero == 3 else 1
    updated = 1 if zero == 0 else N
    parts = policy(name).state_bytes(1.0, computed, updated, grads_at_update=zero == 2)
    assert sum(parts) == pytest.approx(CLOSED_FORMS[(name, zero)])


def test_megatron_distributed_optimizer_accounting() -> None:
    """Megatron-LM's distributed-optimizer table (bf16 parameters, fp32 gradients): 6 bytes
    per parameter whole plus 12 over the data-parallel degree d; 18 without sharding."""
    p = policy("bf16-mixed")
    for d in (1, 8, 64):
        assert sum(p.state_bytes(1.0, 1, d)) == pytest.approx(18 if d == 1 else 6 + 12 / d)


def test_reduce_dtype_halves_the_gradient_bytes() -> None:
    fp32_reduce, bf16_reduce = policy("bf16-mixed"), policy("bf16-mixed", "bfloat16")
    assert bf16_reduce.state_bytes(10, 1, 1)[1] * 2 == fp32_reduce.state_bytes(10, 1, 1)[1]
    assert bf16_reduce.name == "bf16-mixed (reduce bfloat16)" and fp32_reduce.name == "bf16-mixed"


def test_defaults_and_recorded_names() -> None:
    assert default_policy("cpu") == "fp32" and default_policy("h100") == "bf16-mixed"
    assert ParallelConfig().resolved("cpu").precision == "fp32"
    assert ParallelConfig().resolved("h100").precision == "bf16-mixed"
    assert ParallelConfig(precision="bf16").resolved("h100").precision == "bf16"  # a given one stays
    assert of_model("bfloat16") == policy("bf16-mixed")  # a graph without a record: float32 master and reduce
    assert of_model("float32") == policy("fp32")


@pytest.mark.parametrize("kwargs, phrase", [
    (dict(precision="fp16"), "--precision must be one of fp32, bf16-mixed, bf16, got 'fp16'"),
    (dict(precision="bf16-mixed", reduce_dtype="float16"), "--reduce-dtype must be one of float32, bfloat16"),
    (dict(reduce_dtype="int8"), "--reduce-dtype must be one of float32, bfloat16"),
])
def test_bad_policy_names_say_the_choices(kwargs, phrase) -> None:
    with pytest.raises(ValueError, match=phrase.replace("(", r"\(").replace(")", r"\)")):
        ParallelConfig(**kwargs)


def test_a_saved_config_without_a_policy_still_loads() -> None:
    data = ParallelConfig(dp=2).to_json()
    del data["precision"], data["reduce_dtype"]
    assert ParallelConfig.from_json(data).precision == ""


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("table", torch.arange(4, dtype=torch.float32))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.lin(x) + self.table.to(x.dtype)) - y).square().mean()


def test_the_step_is_traced_in_the_compute_dtype_and_records_the_policy() -> None:
    """Parameters and floating inputs cast (the buffer keeps float32, as FSDP2 leaves
    buffers), the graph's parameter nodes in bfloat16, gradients priced in float32."""
    model = _Net()
    master = model.lin.weight.detach()
    _, graph = trace_step(model, (torch.randn(4, 8), torch.randn(4, 4)), precision=policy("bf16-mixed"))
    assert model.lin.weight.dtype == torch.bfloat16 and model.table.dtype == torch.float32
    assert master.dtype == torch.float32  # the caller's reference to the old data keeps the master values
    assert graph.model.dtype == "bfloat16" and graph.model.precision == policy("bf16-mixed")
    params = [n for n in graph.nodes if n.param_name == "lin.weight"]
    assert params and all(n.output.dtype == "bfloat16" for n in params)
    for _, grad in graph.param_grads:
        assert graph.grad_meta(grad).dtype == "float32"


def test_cast_parameters_keeps_the_parameter_objects() -> None:
    model = _Net()
    before = [id(p) for p in model.parameters()]
    cast_parameters(model, "bfloat16")
    assert [id(p) for p in model.parameters()] == before
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
