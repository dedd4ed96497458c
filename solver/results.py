"""What the search returns: ranked priced plans, the best as a Plan, and the phases' times.

Where it sits: solver/, the output types of the product's planner (solver/pipeline_search.py
`search`, its one-stage candidates from solver/spmd_search.py), read by the wiring
(autopar/api.py `search_plans`, autopar/commands/search.py) to print tables, JSON and the
`autopar price` flags that reproduce a ranked plan. The template grid baseline
(benchmarks/baselines/template/search.py) returns the same types.

Terms: a *ranked* entry is one priced configuration that fits the memory budget; its
`estimate` is the cost model's Estimate for it (`autopar price` reports the same figures,
DESIGN: one cost model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from autopar.config import ParallelConfig
from autopar.estimate import CommunicationTime
from autopar.explain import describe_config
from autopar.plan import Plan
from cost_model import Estimate

ProgressFn = Callable[[str, int, int], None]
"""progress(phase, done, total)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Ranked:
    """One priced candidate."""

    config: ParallelConfig
    stage_layers: tuple[int, ...]
    estimate: Estimate
    bubble_fraction: float
    repeated_axes: tuple[str, ...] = ()
    """Mesh axes (of size > 1) on which the plan shards nothing: every rank of such an axis
    runs the same whole step (a tiny model, where any split costs more than it saves). The
    step time and throughput are right; the degrees name devices, not parallelism."""
    zero_mixed: bool = False
    """The ILP (or the stage DP) chose different ZeRO layouts for different parameters (or
    stages): `config.zero` names the one most parameter bytes use, and the configuration
    is priced as searched without `--zero` (`price_flags`)."""

    def price_flags(self) -> tuple[str, ...]:
        """The `autopar price` flags that price this candidate as the search did."""
        c = self.config
        flags = ["--tp", str(c.tp), "--pp", str(c.pp), "--dp", str(c.dp), "--micro-batch", str(c.micro_batch),
                 "--recompute", c.recompute]
        if c.pp > 1:
            flags += ["--schedule", c.schedule] + (["--interleave", str(c.interleave)] if c.interleave > 1 else [])
        if not self.zero_mixed:
            flags += ["--zero", str(c.zero)]
        if c.precision:
            flags += ["--precision", c.precision] + (["--reduce-dtype", c.reduce_dtype] if c.reduce_dtype else [])
        return tuple(flags)

    def label(self, global_batch: int) -> str:
        """describe_config's label, saying where ranks only repeat the work."""
        text = describe_config(self.config, self.stage_layers, global_batch)
        if self.repeated_axes:
            text += f" ({' and '.join(self.repeated_axes)} only repeat the step: nothing is split over them)"
        return text

    def to_json(self, global_batch: int) -> dict[str, Any]:
        data = dict(self.estimate.to_json())
        config = self.config.to_json()
        config["num_microbatches"] = self.config.num_microbatches(global_batch)
        data["config"] = config
        data["stage_layers"] = list(self.stage_layers)
        data["bubble_fraction"] = self.bubble_fraction
        data["repeated_axes"] = list(self.repeated_axes)
        data["price_flags"] = list(self.price_flags())
        return data


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchResult:
    ranked: tuple[Ranked, ...]
    """Fitting candidates, best first (at most `top`)."""
    plan: Plan
    phases: tuple[tuple[str, float], ...]
    search_time_s: float
    plans: tuple[Plan, ...] = ()
    """Where the search builds them (the per-op search): a runnable plan for each of
    `ranked`, in the same order (plans[0] is `plan`)."""
    communication: tuple[CommunicationTime, ...] = ()
    """`plan`'s communication per step by collective kind and mesh axis, split out of its
    `time_breakdown` (solver/comm_time.py): what `autopar price` reports. Not in the plan
    file (a plan records its prediction's rows, not this split)."""


__all__ = ["ProgressFn", "Ranked", "SearchResult"]
