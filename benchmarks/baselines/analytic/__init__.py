"""The closed-form step model: the baseline beside the product's one model.

Where it sits: benchmarks/baselines/analytic/ (not installed). autopar prices every plan
with one model, the search's (the intra-op ILP's op and collective costs, the stage DP;
`autopar price`, `autopar search`). This package is the whole-configuration formula that
preceded it:
`price_profile(profile_graph(graph), config, cluster, global_batch=...)` prices one
configuration in a few ms from a per-graph profile, with runtime options that describe
other training stacks (options.py: DeepSpeed's 2021 ZeRO-3, fp32 gradient reduction,
torch.compile, async TP, ...). The published-run scripts report it beside the one model
(validate_cost_model.py, validate_one_model.py), fit/fit_cost_model.py fits its constants,
and the template grid (benchmarks/baselines/template/search.py) ranks configurations with it where a benchmark
wires the two together (measure_cpu.py's template baseline, plots_results.py's plan
figure).

Modules: profile.py (per-graph precompute), step.py (`price_profile`: the terms and
their formulas), memory.py (per-stage memory), zero3.py (ZeRO-3 runtimes),
options.py (`RuntimeOptions`). The constants are cost_model/efficiency.py's.
"""

from __future__ import annotations

from typing import Any

from .options import RuntimeOptions
from .profile import GraphProfile, profile_graph
from .step import price_profile
from .zero3 import ZERO3_RUNTIMES, Zero3Runtime


def price(graph: Any, config: Any, cluster: Any, *, global_batch: int, stage_layers: tuple[int, ...] | None = None,
          zero3: str | None = None, checkpoint_every: int | None = None, selective_policy: str | None = None,
          options: RuntimeOptions | None = None, efficiency: Any = None) -> Any:
    """Price one configuration of `graph` on `cluster` (profiles the graph each call;
    for many calls build `profile_graph(graph)` once and use `price_profile`).

    `stage_layers` optionally gives layers per pipeline stage (sums to the model's
    layers; embedding on stage 0, head and loss on the last). The graph may be traced at
    any batch: per-microbatch costs scale by micro_batch / graph.model.batch. The other
    keyword options are `price_profile`'s (runtime options and their shorthands, and
    replacement efficiency constants)."""
    return price_profile(profile_graph(graph), config, cluster, global_batch=global_batch,
                         stage_layers=stage_layers, zero3=zero3, checkpoint_every=checkpoint_every,
                         selective_policy=selective_policy, options=options, efficiency=efficiency)


__all__ = ["GraphProfile", "RuntimeOptions", "ZERO3_RUNTIMES", "Zero3Runtime", "price", "price_profile",
           "profile_graph"]
