"""Cost model: predicted time and memory of a traced training step on a cluster.

Where it sits: after tracing (DESIGN.md flow). Modules, one idea each:
- efficiency.py  every achievable-efficiency factor (one place; fitted ones in
                 fitted_constants.json, written by a script in benchmarks/)
- compute.py     per-op roofline `compute_time_s`
- collectives.py mesh axes -> link tiers, alpha-beta collectives, `reshard_time_s`
- memory.py      model-state bytes per parameter under ZeRO
- table.py       the solver's cost table: `cost_table` (per node and strategy: compute,
                 communication, memory), `ReshardPricer` (resharding and gradient-sync
                 time of an edge, and the same split by collective kind:
                 `ChargePart`), `collective_time_s`, `core_share`
One model prices every plan: these costs, assembled by the solver (solver/spmd_search.py
for one stage, solver/stage_costs.py and solver/stage_dp.py for pipelines) into an
`Estimate` (autopar/estimate.py). The closed-form whole-configuration formula that
preceded it is a baseline under benchmarks/baselines/analytic/, outside the product.

This package's namespace is the cost model's public surface: the solver (solver/) imports
only `cost_model` itself, never a submodule (tests/unit/test_layering.py fails otherwise).

The graph may be traced at any batch (with the job's seq): per-microbatch quantities are
scaled by micro_batch / graph.model.batch, exact for these models (linear in batch).
"""

from __future__ import annotations

from cost_model.collectives import (
    AxisLink,
    all_gather_time_s,
    all_reduce_time_s,
    all_to_all_time_s,
    collective_latency_s,
    loss_report_time_s,
    mesh_axis_links,
    reduce_scatter_time_s,
    reshard_time_s,
    runs_gloo,
    send_recv_time_s,
)
from cost_model.compute import compute_time_s, grad_accumulation_time_s, optimizer_time_s
from cost_model.efficiency import DEFAULT_EFFICIENCY, Efficiency
from autopar.estimate import Estimate
from cost_model.memory import (
    STATE_BYTES_PER_PARAM, model_state_bytes, parameter_state_bytes, raw_gradient_state_bytes, state_bytes_per_param)
from cost_model.table import (
    LOCAL_AXIS,
    LOCAL_COPY,
    ChargePart,
    Collective,
    CostTable,
    ReshardPricer,
    StrategyCost,
    bucket_copy_s_per_byte,
    charged_s,
    collective_time_s,
    compiled_scale,
    core_share,
    cost_table,
    exposed_sync_s,
    grad_sync_overlap,
    hidden_comm_s,
    pipeline_call_time_s,
    reshard_collectives,
)


__all__ = [
    "AxisLink", "ChargePart", "Collective", "LOCAL_AXIS", "LOCAL_COPY", "CostTable", "DEFAULT_EFFICIENCY",
    "Efficiency", "Estimate",
    "ReshardPricer", "StrategyCost",
    "all_gather_time_s", "all_reduce_time_s", "all_to_all_time_s", "bucket_copy_s_per_byte", "charged_s",
    "collective_latency_s", "collective_time_s",
    "compiled_scale", "compute_time_s", "core_share", "cost_table", "exposed_sync_s", "grad_accumulation_time_s",
    "grad_sync_overlap", "hidden_comm_s",
    "loss_report_time_s",
    "optimizer_time_s", "mesh_axis_links", "model_state_bytes", "parameter_state_bytes", "raw_gradient_state_bytes",
    "pipeline_call_time_s",
    "reduce_scatter_time_s", "reshard_collectives", "reshard_time_s",
    "runs_gloo",
    "send_recv_time_s", "STATE_BYTES_PER_PARAM", "state_bytes_per_param",
]
