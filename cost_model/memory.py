"""Model-state bytes per parameter: weights, gradients and optimizer state under ZeRO.

Where it sits: cost_model/, read by the ILP's memory rows (cost_model/table.py,
solver/intra_op/ilp.py) through `cost_model`; torch-free.

Math (psi = parameters held by one device before the dp split, N = dp degree;
mixed-precision AdamW, 16 bytes/param = 2 weight + 2 grad + 12 fp32
master/momentum/variance; ZeRO paper Sec 3.1 and 5):

    zero 0: 16 psi        zero 1: 4 psi + 12 psi/N
    zero 2: 2 psi + 14 psi/N        zero 3: 16 psi/N
"""

from __future__ import annotations

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


def parameter_state_bytes(numel: float, computed: float, updated: float, *,
                          grads_at_update: bool = False) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per device of one parameter of `numel`
    elements whose compute placement splits it `computed` ways and whose weight-update
    placement `updated` ways: the weights and their gradients in the compute placement
    (the gradients in the update placement under ZeRO-2, which accumulates them there),
    the optimizer state in the update placement. What the ILP's cost table charges a
    parameter (cost_model/table.py) and what a plan's memory breakdown reports."""
    grads = BYTES_GRAD * numel / (updated if grads_at_update else computed)
    return BYTES_WEIGHT * numel / computed, grads, BYTES_OPTIMIZER * numel / updated


def state_bytes_per_param(zero: int, dp: int) -> float:
    """Model-state bytes per parameter element on one device under ZeRO `zero` over `dp`
    ranks (16 | 4 + 12/dp | 2 + 14/dp | 16/dp): `model_state_bytes` of one parameter."""
    return sum(model_state_bytes(1.0, zero, dp))
