"""Model-state bytes per parameter: weights, gradients and optimizer state under ZeRO.

Where it sits: cost_model/, read by the ILP's memory rows (cost_model/table.py,
solver/intra_op/ilp.py) through `cost_model`; torch-free.

`parameter_state_bytes` is the product's: the bytes of one parameter under its compute
and update placements and the plan's precision policy (autopar/precision.py), what the
program holds. The uniform-ZeRO figures below (`model_state_bytes`, the ZeRO paper's
fixed mixed-precision accounting) serve the template grid and the analytic baseline
(benchmarks/).

Math (psi = parameters held by one device before the dp split, N = dp degree;
mixed-precision AdamW, 16 bytes/param = 2 weight + 2 grad + 12 fp32
master/momentum/variance; ZeRO paper Sec 3.1 and 5):

    zero 0: 16 psi        zero 1: 4 psi + 12 psi/N
    zero 2: 2 psi + 14 psi/N        zero 3: 16 psi/N
"""

from __future__ import annotations

from typing import Any

from autopar.precision import policy

BYTES_WEIGHT = 2
BYTES_GRAD = 2
BYTES_OPTIMIZER = 12  # fp32 master weight, momentum, variance
STATE_BYTES_PER_PARAM = BYTES_WEIGHT + BYTES_GRAD + BYTES_OPTIMIZER
"""16: the unsharded model state of one parameter element. The home of these numbers:
the solver reads them through `cost_model` (`state_bytes_per_param`)."""


def model_state_bytes(num_params: float, zero: int, dp: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per device for `num_params` parameters."""
    n = dp
    weights = BYTES_WEIGHT * num_params / (n if zero >= 3 else 1)
    grads = BYTES_GRAD * num_params / (n if zero >= 2 else 1)
    optimizer = BYTES_OPTIMIZER * num_params / (n if zero >= 1 else 1)
    return weights, grads, optimizer


def parameter_state_bytes(numel: float, computed: float, updated: float, *, grads_at_update: bool = False,
                          precision: Any = None) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per device of one parameter of `numel`
    elements whose compute placement splits it `computed` ways and whose weight-update
    placement `updated` ways, under the precision policy `precision`
    (autopar.precision.Precision; None: fp32): `Precision.state_bytes`, the one home of
    this accounting, which the per-op program's measured state is checked against. What
    the ILP's cost table charges a parameter (cost_model/table.py) and what a plan's
    memory breakdown reports."""
    p = precision if precision is not None else policy("fp32")
    return p.state_bytes(numel, computed, updated, grads_at_update=grads_at_update)


def raw_gradient_state_bytes(numel: float, split: float, precision: Any = None) -> float:
    """Bytes per device of one parameter's raw gradient, accumulated over a step's
    microbatches in the precision policy's reduction dtype (`precision`; None: fp32) in the
    placement the backward leaves it in, split `split` ways: the gradient node's own output
    placement, which is not the weight's compute placement where the ILP computes the
    gradient as a pending sum (a tensor-parallel weight's gradient from sequence-split
    activations is whole on every tp rank until the step's sync reduce-scatters it:
    codegen/apply.py accumulates `choices[g].outputs[0]`). The gradient part of
    `parameter_state_bytes` with that split, which the ILP charges to the gradient node
    (cost_model/table.py) unless the step syncs the gradients in its backward."""
    p = precision if precision is not None else policy("fp32")
    return p.raw_gradient_bytes(numel, split)


def state_bytes_per_param(zero: int, dp: int) -> float:
    """Model-state bytes per parameter element on one device under ZeRO `zero` over `dp`
    ranks (16 | 4 + 12/dp | 2 + 14/dp | 16/dp): `model_state_bytes` of one parameter."""
    return sum(model_state_bytes(1.0, zero, dp))
