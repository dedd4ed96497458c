"""Cost model: predicted time and memory of a traced training step on a cluster.

Where it sits: after tracing (DESIGN.md flow). Modules, one idea each:
- efficiency.py  every achievable-efficiency factor (one place; fitted ones in
                 fitted_constants.json, written by benchmarks/fit_cost_model.py)
- options.py     RuntimeOptions: what the training stack does beyond ParallelConfig
- compute.py     per-op roofline `compute_time_s`
- collectives.py mesh axes -> link tiers, alpha-beta collectives, `reshard_time_s`
- profile.py     `profile_graph`: one-time per-graph precompute (liveness, op items)
- memory.py      ZeRO model state, activations from liveness, in-flight microbatches
- zero3.py       ZeRO-3 / FSDP runtimes: collective granularity, prefetch, overlap
- step.py        `price_profile`: step time, throughput, MFU, peak memory of a config
  returning an `Estimate` (autopar/estimate.py: shared, a Plan embeds it)
- table.py       the solver's cost table: `cost_table` (per node and strategy: compute,
                 communication, memory), `ReshardPricer` (resharding and gradient-sync
                 time of an edge), `collective_time_s`, `core_share`

This package's namespace is the cost model's public surface: the solver (solver/) imports
only `cost_model` itself, never a submodule (tests/unit/test_layering.py fails otherwise).

The graph may be traced at any batch (with the job's seq): per-microbatch quantities are
scaled by micro_batch / graph.model.batch, exact for these models (linear in batch).
"""

from __future__ import annotations

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.ir import Graph
from cost_model.collectives import (
    AxisLink,
    all_gather_time_s,
    all_reduce_time_s,
    all_to_all_time_s,
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
from cost_model.memory import STATE_BYTES_PER_PARAM, model_state_bytes, state_bytes_per_param
from cost_model.options import RuntimeOptions
from cost_model.profile import GraphProfile, profile_graph
from cost_model.step import default_stage_layers, price_profile
from cost_model.table import (
    Collective,
    CostTable,
    ReshardPricer,
    StrategyCost,
    bucket_copy_s_per_byte,
    collective_time_s,
    core_share,
    cost_table,
    pipeline_call_time_s,
    reshard_collectives,
)
from cost_model.zero3 import ZERO3_RUNTIMES, Zero3Runtime


def price(graph: Graph, config: ParallelConfig, cluster: Cluster, *, global_batch: int,
          stage_layers: tuple[int, ...] | None = None, zero3: str | None = None,
          checkpoint_every: int | None = None, selective_policy: str | None = None,
          options: RuntimeOptions | None = None, efficiency: Efficiency | None = None) -> Estimate:
    """Price one configuration of `graph` on `cluster` (profiles the graph each call;
    for many calls build `profile_graph(graph)` once and use `price_profile`).

    `stage_layers` optionally gives layers per pipeline stage (sums to the model's
    layers; embedding on stage 0, head and loss on the last). The graph may be traced at
    any batch: per-microbatch costs scale by micro_batch / graph.model.batch. The other
    keyword options are `price_profile`'s (runtime options and their shorthands, and
    replacement efficiency constants).
    """
    return price_profile(profile_graph(graph), config, cluster, global_batch=global_batch,
                         stage_layers=stage_layers, zero3=zero3, checkpoint_every=checkpoint_every,
                         selective_policy=selective_policy, options=options, efficiency=efficiency)


__all__ = [
    "AxisLink", "Collective", "CostTable", "DEFAULT_EFFICIENCY", "Efficiency", "Estimate", "GraphProfile",
    "ReshardPricer", "RuntimeOptions", "StrategyCost",
    "all_gather_time_s", "all_reduce_time_s", "all_to_all_time_s", "bucket_copy_s_per_byte", "collective_time_s",
    "compute_time_s", "core_share", "cost_table", "default_stage_layers", "grad_accumulation_time_s",
    "loss_report_time_s",
    "optimizer_time_s", "mesh_axis_links", "model_state_bytes", "pipeline_call_time_s", "price",
    "price_profile", "profile_graph", "reduce_scatter_time_s", "reshard_collectives", "reshard_time_s",
    "runs_gloo",
    "send_recv_time_s", "STATE_BYTES_PER_PARAM", "state_bytes_per_param", "ZERO3_RUNTIMES", "Zero3Runtime",
]
