"""What the planner is asked: the search's configuration, and a fixed configuration to price.

Where it sits: the input of solver/pipeline_search.py `search`, built by the wiring
(autopar/api.py `search_plans`, from `autopar search` and `autopar price` flags or
`autopar.compile` arguments). Plain data: the search reads it and never changes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.config import ParallelConfig
from solver.spmd_search import SpmdCandidate
from solver.stage_dp import Schedule


@dataclass(frozen=True, slots=True, kw_only=True)
class Fixed:
    """One configuration to price instead of a space to search (`autopar price`): the search
    restricted to it, so a configuration is priced exactly as the search prices it when it
    ranks it (same traces, ILP rules, stage costs and pipeline terms).

    What `config` leaves to the search stays the search's: per-op placements, and each
    parameter's ZeRO layout where `zero_given` is false (the one-stage ILP chooses per
    parameter; each pipeline stage's layout is the stage DP's pick among ZeRO 0, 1 and 3,
    and 2 where 3 won);
    the stage cuts where `stage_layers` is None."""

    config: ParallelConfig
    zero_given: bool = False
    stage_layers: tuple[int, ...] | None = None

    def spmd(self, c: SpmdCandidate) -> bool:
        k = self.config
        return k.pp == 1 and c.mesh == (k.dp, k.tp) and c.microbatch == k.micro_batch * k.dp

    def zeros(self) -> tuple[int, ...]:
        """A stage's ZeRO layout when given."""
        return (self.config.zero,)

    def schedule(self, sched: Schedule) -> bool:
        k = self.config
        name = {"zb": "zbv"}.get(k.schedule, k.schedule)
        return sched.name == name and sched.chunks == (k.interleave if name in ("interleaved", "zbv") else 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchConfig:
    """One search: the job (batch, model) and how far to search."""

    global_batch: int
    """Sequences per optimizer step, over the whole job."""
    model: str
    """The model's name as plans record it (a preset, spec or factory)."""
    fingerprint: str
    """The model's parameter fingerprint (autopar/plan.py `module_fingerprint`), recorded in
    each plan so that it is never applied to another model."""
    family: str = ""
    """The zoo's structure ("gpt", "llama": their pipelines take tp from the rule tables);
    "" for any other model, whose pipelines run data-parallel stages cut at its repeated
    layers (autopar/capabilities.py `runnable` says which)."""
    top: int = 5
    """How many plans to return, best first; the branch and bound stops once a candidate's
    lower bound reaches the top-th runnable step time."""
    time_limit_s: float | None = None
    """Wall-clock budget of the whole search (None: none): solving stops once it is spent and
    a plan was found, and the result says the space was not fully searched."""
    num_layers: int | None = None
    """The model's repeated layers (None: as traced)."""
    microbatch_choices: int | None = None
    """Per one-stage mesh and recompute policy, at most this many microbatches (largest
    first) that pass the memory bound are queued (a faster, incomplete search). None: all of
    them, the branch and bound deciding which are solved. A cap of 3 lost MPT-13b on 8
    A100s at 240 sequences of 4,096: its three largest microbatches per mesh passed the
    bound's margin but fitted only under heavier layouts, and the best plan (tp4 dp2 ZeRO-2,
    4 sequences a rank, 30 microbatches: 55.0 s) was the ninth microbatch of its mesh; the
    searches of llama3-70b and -405b solve the same candidates either way."""
    max_pp: int | None = None
    """Rank only plans with at most this many pipeline stages (1: one-stage plans only)."""
    min_pp: int = 1
    """Rank only plans with at least this many pipeline stages (2: pipelines only)."""
    fixed: Fixed | None = None
    """Price this one configuration instead of searching (`autopar price`): the result ranks
    what it allows."""

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.top < 1 or self.min_pp < 1 or (self.microbatch_choices is not None
                                                                    and self.microbatch_choices < 1):
            raise ValueError(f"a search needs global_batch, top, microbatch_choices and min_pp of at least 1; "
                             f"got {self.global_batch}, {self.top}, {self.microbatch_choices} and {self.min_pp}")
