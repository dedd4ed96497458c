"""Plans: what the whole-plan search decided, saved as versioned JSON and explained.

Where it sits: output of solver/pipeline_search.py, input of codegen/ and the runtime. A plan is
searched once and replayed many times (`autopar train --plan plan.json`), so it carries
everything the runtime needs (`config`, `stage_layers`, the mesh) and everything a person
needs to see why it was chosen (`explain()`, rendered by autopar/explain.py): predicted
metrics, per-stage work, the per-op placements per chunk and the runner-up plans with
their costs.

One record per pipeline stage (`Plan.stages`, StageInfo): what the stage holds, its
submesh, recompute and ZeRO, and what the search priced for it. One placement record
(`Plan.placements`, StagePlacements): the per-op placements per *chunk*, a one-stage plan
being the one chunk 0. They are kept per chunk, not inside the stage records: under the
interleaved schedule stage k runs chunks k, k + pp, ... (chunk c on stage c % pp,
autopar/build/pipeline.py), each its own traced graph with its own placements, and the
build and the ranks' `ProgramPlacements` look them up by chunk.

Terms: a *stage* is one pipeline rank's contiguous run of layers (stage 0 also holds the
embedding, the last stage the final norm, output head and loss); `stage_layers[i]` is the
number of layers of stage i. A model without a repeated layer stack (num_layers 0) is one
stage holding everything: stage_layers [0], pp 1. The logical mesh is (pp, dp, tp), tp
innermost so tensor parallelism stays on a node's NVLink.

Plans are JSON only (never pickled): sorted keys, validated on load, and byte-identical
for identical inputs (no timings or dates are stored).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Iterable, Mapping, Sequence

from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.sharding import InfeasiblePlanError, NodeStrategy
from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.estimate import Estimate
from autopar.json_codec import JsonData, JsonFormatError, decode
from autopar.placement import parse_placements
from autopar.explain import explain_plan
from autopar.plan_migrations import MIGRATIONS

PLAN_VERSION = 6
"""The version `Plan.dumps` writes; older files are brought forward on load, one version at a
time (what each version changed, and how: autopar/plan_migrations.py)."""
MESH_AXIS_NAMES: tuple[str, ...] = ("pp", "dp", "tp")


class PlanFileError(ValueError):
    """A plan file that cannot be used: wrong version, bad keys or inconsistent numbers."""


def model_fingerprint(named_param_shapes: Iterable[tuple[str, Sequence[int]]]) -> str:
    """sha256 over the sorted (parameter name, shape) pairs of a model.

    `module_fingerprint(module)` takes it from a torch module. Names and
    shapes (not values) identify the architecture, so a plan is never applied to a
    different model, while retrained weights keep their plan.
    """
    pairs = sorted((str(name), [int(d) for d in shape]) for name, shape in named_param_shapes)
    return hashlib.sha256(json.dumps(pairs, separators=(",", ":")).encode()).hexdigest()


def module_fingerprint(module: Any) -> str:
    """`model_fingerprint` of a torch module (anything with `named_parameters()`): the one
    place that reads a module's (name, shape) pairs, for plans, jobs and checkpoints."""
    return model_fingerprint((n, tuple(p.shape)) for n, p in module.named_parameters())


def fingerprint_source(source: Any) -> str:
    """`model_fingerprint` of a zoo model (`autopar.models.ModelSource`), built on fake tensors.

    The full-depth model is built under FakeTensorMode, so even llama3-405b costs ~2 s
    and no memory.
    """
    if source.config is None:
        model, _ = source.factory()
    else:
        with FakeTensorMode():
            model = source.build()
    return module_fingerprint(model)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageInfo(JsonData):
    """One pipeline stage as the search chose and priced it: what it holds, where it runs,
    what it costs (for explain, `autopar price` and the timeline plot). The inter-op DP
    (solver/pipeline_plans.py, and solver/pipeline_search.py for a one-stage plan) prices
    each stage's time, microbatches in flight, placements and collectives; the template
    search (benchmarks/baselines/template/search.py) counts its FLOPs and parameters. A
    field its search does not price keeps its default (0 or empty)."""

    index: int
    first_layer: int
    num_layers: int
    has_embedding: bool
    has_head: bool
    submesh: tuple[int, int]
    """(dp, tp) of the stage's devices."""
    recompute: str
    zero: int
    memory_bytes: int
    """Per-device memory the search priced for this stage: the inter-op DP's peak (state +
    in-flight activations + workspace), the template's model state."""
    time_per_microbatch_s: float = 0.0
    """Forward + backward of one microbatch on this stage (sync and optimizer amortised)."""
    inflight_microbatches: float = 0.0
    flops_per_microbatch: float = 0.0
    """Forward+backward FLOPs of this stage for one microbatch, whole stage (before tp)."""
    num_parameters: int = 0
    placements: tuple[tuple[str, str], ...] = ()
    """(parameter, placement on the stage's (dp, tp) submesh) from the stage's ILP, layers
    once per layer group as `layers.*`."""
    collectives: tuple[tuple[str, str, int, int], ...] = ()
    """(kind, mesh axis, calls per microbatch, bytes per microbatch) the stage's ILP priced
    for this stage's pieces: its layers, and the embedding or head where it holds them
    (solver/pipeline_plans.py; a gradient sync's once per step over m)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OpPlacement(JsonData):
    """The ILP's choice for one op of the traced step: the layout of each output and the
    layout each input must arrive in (one placement per mesh axis, autopar/placement.py
    text). `key` names the op independently of the traced depth (Graph.node_keys). Written
    as a row [key, op, outputs, inputs(, update)]: a plan holds one per op of the traced step."""

    JSON_ROW: ClassVar[bool] = True
    key: str
    op: str
    outputs: tuple[str, ...]
    inputs: tuple[str, ...]
    update: str = ""
    """Parameters only: the weight update's placement where it differs from the compute
    placement `outputs[0]` (autopar.sharding.NodeStrategy.update); "" where the same."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePlacements(JsonData):
    """One chunk's per-op placements: the intra-op ILP's solution on the chunk's (dp, tp)
    submesh. A one-stage plan is one chunk, 0: its whole traced step (solver/spmd_search.py).
    A pipeline chunk's graph is its joint graph as every rank traces it
    (autopar/runtime/pipe_spmd.py). Keys name the chunk's ops as `OpPlacement.key` does
    (Graph.node_keys). Keyed by chunk, not held in StageInfo: a stage runs several chunks
    under the interleaved schedule, and a pipeline's are recorded after the search
    (autopar/api.py `record_stage_placements`), or not at all for a large model."""

    chunk: int
    """Chunk index (0 .. pp * interleave - 1; the stage is chunk % pp); 0 for one stage."""
    placements: tuple[OpPlacement, ...]
    collectives: tuple[tuple[str, str, int, int], ...] = ()
    """Pipelines: (kind, mesh axis name, calls per step, bytes per step) the chunk's ILP
    priced. Empty for a one-stage plan, whose priced collectives are in `Plan.intra_op_info`
    with the rest of how its ILP was solved."""


@dataclass(frozen=True, slots=True, kw_only=True)
class IntraOpInfo(JsonData):
    """How a one-stage plan's per-op placements were found, for `explain` (from the plan
    alone), and the collectives they were priced at, which a run's counted collectives are
    compared with (`ProgramPlacements.collectives`). Plan-level, not per chunk: only the
    one-stage search writes it; a pipeline's chunks record their priced collectives in their
    own placement records."""

    status: str
    """"optimal", or "time_limit" when the solver stopped with a feasible, unproven plan."""
    coverage: float
    """Share of the step's FLOPs whose op had a sharded strategy (not only replicated)."""
    fallback_ops: tuple[str, ...]
    """Ops with no strategy in DTensor's registry nor from their decomposition (replicated)."""
    num_variables: int
    collectives: tuple[tuple[str, str, int, int], ...]
    """(kind, mesh axis name, calls per step, bytes per step) of the priced program."""
    time_s: tuple[tuple[str, float], ...]
    """The ILP's per-step seconds by term (compute, reshard, gradient sync)."""
    parameters: tuple[tuple[str, str], ...] = ()
    """(parameter, its placement on the (dp, tp) mesh), layers as `layers.*` (one per
    layer group: layer sharing gives every layer of a group the same choice)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Alternative(JsonData):
    """A runner-up plan, kept so `explain` can say what the choice beat and by how much."""

    config: ParallelConfig
    stage_layers: tuple[int, ...]
    step_time_s: float
    peak_memory_bytes: int
    fits: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineInfo(JsonData):
    """The inter-op decision beyond its stages (those are `Plan.stages`): the schedule and
    its terms, and why the runners-up lost (from the plan alone: `autopar explain`)."""

    schedule: str
    """gpipe, 1f1b, interleaved or zbv (solver/stage_dp.py prices each); "none": one stage."""
    chunks: int
    microbatch: int
    """Sequences per microbatch over the whole pipeline."""
    num_microbatches: int
    bubble_s: float
    """Step time above m x the slowest stage (the schedule's bubble)."""
    p2p_s: float
    """Per step: the slowest stage's boundary sends, m microbatches."""
    runners_up: tuple[tuple[str, float, str], ...] = ()
    """(candidate, its step seconds, why it lost), best first: slower terms named, or the
    reason the runtime cannot run it (autopar/capabilities.py)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchInfo(JsonData):
    """How the plan was found: the cost model, the space and what was pruned (no timings)."""

    cost_model: str
    num_candidates: int
    """Configurations in the search space (mesh x cuts x zero x microbatch x schedule x recompute)."""
    num_priced: int
    num_pruned_memory: int
    """Skipped before pricing: their memory lower bound exceeds the budget."""
    num_pruned_dominated: int
    """Skipped: a cheaper-or-equal option with the same knobs already fits (e.g. less recompute)."""
    num_not_fitting: int
    complete: bool = True
    """False when --time-limit stopped pricing early (the plan is the best seen so far)."""
    alternatives: tuple[Alternative, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan(JsonData):
    """One whole training plan: mesh, stage cuts, ZeRO, microbatching, schedule, recompute."""

    version: int = PLAN_VERSION
    model: str
    """Preset name, spec string or factory path, as given to `autopar search`."""
    model_fingerprint: str
    num_layers: int
    seq: int
    global_batch: int
    cluster: str
    memory_limit_bytes: int
    config: ParallelConfig
    stage_layers: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    mesh_axis_names: tuple[str, ...] = MESH_AXIS_NAMES
    stages: tuple[StageInfo, ...] = ()
    """One per pipeline stage, in order (their layers are `stage_layers`); empty where the
    search recorded none. Made by the inter-op DP where `pipeline` is set, else by the
    template search."""
    predicted: Estimate
    """The cost model's forecast of the chosen plan, as the search priced it."""
    bubble_fraction: float = 0.0
    """Share of the step the pipeline idles, as the search priced it ((p - 1) / (v m) in the
    template search, bubble / step in the inter-op DP); 0 for one stage."""
    search: SearchInfo
    placements: tuple[StagePlacements, ...] = ()
    """The per-op placements, the program that runs: one record per chunk in chunk order
    (0 .. pp * interleave - 1), a one-stage plan's being the one chunk 0. Empty where the
    plan lacks them (a pipeline file before version 4, a zoo model the search did not trace
    by chunks, a configuration given by flags): each build then solves them."""
    intra_op_info: IntraOpInfo | None = None
    pipeline: PipelineInfo | None = None
    """The inter-op decision (schedule, bubble, runners-up; its stages are `stages`); written
    null for plans the inter-op search did not make (a configuration given by flags)."""

    def __post_init__(self) -> None:
        # the file holds the prediction's breakdowns and config as JSON objects (read back
        # sorted by name): sorted here too, so a plan equals itself read back
        p = self.predicted
        object.__setattr__(self, "predicted", replace(
            p, time_breakdown=tuple(sorted(p.time_breakdown)), memory_breakdown=tuple(sorted(p.memory_breakdown)),
            config=tuple(sorted(p.config))))
        self.validate()

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.config.dp * self.config.micro_batch)

    def validate(self) -> None:
        """Consistency of the numbers; raises PlanFileError saying what disagrees."""
        c = self.config
        if self.version != PLAN_VERSION:
            raise _unsupported_version(self.version)
        try:
            cluster = Cluster.parse(self.cluster)
        except ValueError as exc:
            raise PlanFileError(f"plan cluster: {exc}") from None
        if c.num_devices != cluster.num_devices:
            raise PlanFileError(f"plan config has dp*tp*pp = {c.dp}*{c.tp}*{c.pp} = {c.num_devices} devices "
                                f"but its cluster {self.cluster} has {cluster.num_devices}")
        if tuple(self.mesh_axis_names) != MESH_AXIS_NAMES:
            raise PlanFileError(f"plan mesh_axis_names {list(self.mesh_axis_names)} must be {list(MESH_AXIS_NAMES)}")
        if tuple(self.mesh_shape) != (c.pp, c.dp, c.tp):
            raise PlanFileError(f"plan mesh_shape {list(self.mesh_shape)} disagrees with its config "
                                f"(pp, dp, tp) = ({c.pp}, {c.dp}, {c.tp})")
        # A model without a repeated layer stack (num_layers 0) is one stage holding everything: [0].
        layerless = self.num_layers == 0 and c.pp == 1 and tuple(self.stage_layers) == (0,)
        if not layerless and (len(self.stage_layers) != c.pp or any(n < 1 for n in self.stage_layers)):
            raise PlanFileError(f"plan stage_layers {list(self.stage_layers)} must be {c.pp} positive counts "
                                f"(one per pipeline stage, pp={c.pp}), or [0] with pp=1 for a model without "
                                "a repeated layer stack")
        if sum(self.stage_layers) != self.num_layers:
            raise PlanFileError(f"plan stage_layers {list(self.stage_layers)} sum to {sum(self.stage_layers)} "
                                f"but the model has {self.num_layers} layers")
        firsts = [sum(self.stage_layers[:k]) for k in range(len(self.stage_layers))]
        if self.stages and ([(s.index, s.first_layer, s.num_layers) for s in self.stages]
                            != list(zip(range(len(firsts)), firsts, self.stage_layers))):
            raise PlanFileError(f"plan stages (index, first_layer, num_layers) "
                                f"{[(s.index, s.first_layer, s.num_layers) for s in self.stages]} disagree with "
                                f"stage_layers {list(self.stage_layers)}; the file was edited. Re-run `autopar search`")
        if self.global_batch <= 0 or self.global_batch % (c.dp * c.micro_batch):
            raise PlanFileError(f"plan global_batch {self.global_batch} is not a multiple of dp * micro_batch "
                                f"= {c.dp} * {c.micro_batch}")
        if self.memory_limit_bytes <= 0 or self.seq <= 0:
            raise PlanFileError("plan memory_limit_bytes and seq must be positive")
        if self.placements:
            _check_chunks(self.placements, c, "plan has", "; the file was edited. Re-run `autopar search`")

    # -- JSON ------------------------------------------------------------------------------

    def dumps(self) -> str:
        """The canonical file text: sorted keys, 2-space indent, trailing newline."""
        return json.dumps(self.to_json(), sort_keys=True, indent=2, ensure_ascii=True) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.dumps(), encoding="ascii")

    @classmethod
    def from_json(cls, data: Any, where: str = "plan") -> "Plan":
        """A Plan from parsed JSON, by the generic codec (autopar/json_codec.py) after two
        checks that speak of plan files: the version (an older one in MIGRATIONS is brought
        forward one version at a time), and a fingerprint that is a digest."""
        if not isinstance(data, Mapping):
            raise PlanFileError(f"a plan must be a JSON object, got {type(data).__name__}")
        while isinstance(data.get("version"), int) and data["version"] in MIGRATIONS:
            data = MIGRATIONS[data["version"]](data)
        if "version" in data and data["version"] != PLAN_VERSION:
            raise _unsupported_version(data["version"])
        if "model_fingerprint" in data and not re.fullmatch(r"[0-9a-f]{1,64}", str(data["model_fingerprint"])):
            raise PlanFileError(f"plan model_fingerprint {str(data['model_fingerprint'])[:80]!r} is not a (sha256) hex "
                                "digest; the file was edited or truncated. Re-run `autopar search` to write a new plan")
        try:
            return decode(data, cls, where)
        except PlanFileError:
            raise
        except JsonFormatError as exc:
            raise PlanFileError(f"{exc}. Re-run `autopar search` to write a new plan") from None
        except (TypeError, ValueError) as exc:
            raise PlanFileError(f"plan has a malformed value: {exc}") from None

    @classmethod
    def loads(cls, text: str) -> "Plan":
        try:
            data = json.loads(text, parse_constant=_refuse_constant)
        except json.JSONDecodeError as exc:
            raise PlanFileError(f"plan is not valid JSON: {exc}") from None
        return cls.from_json(data)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        p = Path(path)
        if not p.is_file():
            raise PlanFileError(f"plan file {str(p)!r} does not exist; write one with `autopar search ... --out {p}`")
        try:
            text = p.read_text(encoding="ascii")
        except UnicodeDecodeError as exc:  # e.g. a pickle: plans are never unpickled
            raise PlanFileError(f"{p} is not a plan: byte {exc.start} is not ASCII text. Plans are the JSON "
                                "files `autopar search --out` writes (never pickles); write one with it") from None
        try:
            return cls.loads(text)
        except PlanFileError as exc:
            raise PlanFileError(f"{p}: {exc}") from None

    def chunk_placements(self, chunk: int = 0) -> tuple[OpPlacement, ...]:
        """Chunk `chunk`'s per-op placements (a one-stage plan's: chunk 0); () where the plan
        records none."""
        return _chunk(self.placements, chunk)

    def records_program_for(self, config: ParallelConfig) -> bool:
        """Whether a program under `config` reads this plan's per-op placements
        (`ProgramPlacements.of_plan`) rather than solving its own: the plan records them,
        and for the same kind of program (one stage, or a pipeline) as `config`'s."""
        return bool(self.placements) and (config.pp == 1) == (self.config.pp == 1)

    def placements_for(self, graph: Any, chunk: int = 0) -> tuple[Any, ...]:
        """Chunk `chunk`'s per-op placements as one NodeStrategy per node of `graph`: a
        one-stage plan's traced step at the plan's microbatch (any traced depth), or a
        pipeline chunk's joint graph as autopar/runtime/pipe_spmd.py traces it (exactly).
        Raises PlanFileError where the plan has none for it or they do not match."""
        if not self.placements:
            raise PlanFileError(f"plan {self.model!r} has no per-op placements for chunk {chunk}; "
                                "re-run `autopar search` to write them")
        return _chunk_choices(self.placements, self.config, chunk, graph, f"plan {self.model!r} does not match "
                              "this model's")

    def check_model(self, fingerprint: str) -> None:
        """Refuse to apply this plan to a different model: the one check of a plan against
        a model (`module_fingerprint(model)`), for `autopar train --plan` and
        `autopar.compile(plan=...)`. A plan built in code without a fingerprint ("") is
        not checked."""
        if self.model_fingerprint and fingerprint != self.model_fingerprint:
            raise PlanFileError(
                f"plan was made for another model: searched for {self.model!r} (fingerprint "
                f"{self.model_fingerprint[:12]}) but the model given has fingerprint {fingerprint[:12]}: its "
                "parameter names or shapes differ. Re-run `autopar search` for this model (or, in "
                "autopar.compile, drop plan= to search one or pass config=)")

    def explain(self) -> str:
        """Per stage and layer group: what was chosen and why (costs), from the plan alone
        (autopar/explain.py renders it)."""
        return explain_plan(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProgramPlacements(JsonData):
    """What every rank builds its program from: one configuration's per-op placements,
    decided once before any rank builds (autopar/placing.py: a plan's own, or the intra-op
    ILP's for a configuration given by flags or `config=`), so a rank traces its step (or
    its pipeline chunks) and applies them, and never solves. Plain data: it travels to
    spawned ranks as JSON text (autopar/runtime/jobs.py TrainJob.placements).

    `placements` is one record per chunk, as in a plan (pp = 1: chunk 0, with `collectives`,
    `grads_each_microbatch` and `fused_kernels`; pp > 1: every chunk, with `stage_layers`)."""

    model: str
    """The model's name as the plan or job gives it (for messages)."""
    config: ParallelConfig
    origin: str
    """"plan": a saved or searched plan's placements; "solved": the ILP's for `config`."""
    placements: tuple[StagePlacements, ...] = ()
    """Every chunk's per-op placements, in chunk order (pp = 1: the one chunk 0, the traced
    step at the microbatch that runs)."""
    collectives: tuple[tuple[str, str, int, int], ...] | None = None
    """pp = 1: (kind, mesh axis name, calls per step, bytes per step) the placements were
    priced at; None where unknown (a plan without `intra_op_info`)."""
    grads_each_microbatch: bool = False
    """pp = 1: the solution syncs every microbatch's gradients to their update shards
    (ZeRO-2 as solver/forced.py solves it), so the step graph syncs them itself."""
    fused_kernels: bool = False
    """pp = 1: the placements were solved on the step traced with the fused-kernel modules
    swapped in (codegen/kernels/modules.py), so the build swaps them in before it traces."""
    stage_layers: tuple[int, ...] = ()
    """pp > 1: the plan's layers per stage or chunk (empty: an even split)."""

    def __post_init__(self) -> None:
        if self.origin not in ("plan", "solved"):
            raise PlanFileError(f"program placements origin {self.origin!r} must be 'plan' or 'solved'")
        _check_chunks(self.placements, self.config, f"the program of {self.model!r} was given", "")

    def dumps(self) -> str:
        """As JSON text (sorted keys): how a job sends it to its ranks."""
        return json.dumps(self.to_json(), sort_keys=True)

    @classmethod
    def loads(cls, text: str) -> "ProgramPlacements":
        return decode(json.loads(text, parse_constant=_refuse_constant), cls, "placements")

    @classmethod
    def of_plan(cls, plan: "Plan", *, config: ParallelConfig | None = None,
                grads_each_microbatch: bool = False) -> "ProgramPlacements":
        """The program `plan` records, run under `config` (default the plan's own);
        `grads_each_microbatch` as the field says (the wiring knows the solver's rule for
        it, autopar/placing.py). PlanFileError where the plan
        records none (its `placements` empty): such a plan is solved for its configuration
        first (autopar/placing.py `program_placements`)."""
        if not plan.placements:
            raise PlanFileError(f"plan {plan.model!r} records no per-op placements for its program; solve its "
                                "configuration first (autopar.placing.program_placements)")
        info, one_stage = plan.intra_op_info, plan.config.pp == 1
        return cls(model=plan.model, config=config or plan.config, origin="plan", placements=plan.placements,
                   collectives=info.collectives if info is not None and one_stage else None,
                   grads_each_microbatch=grads_each_microbatch,
                   stage_layers=() if one_stage else tuple(plan.stage_layers))

    def choices_for(self, graph: Any, chunk: int = 0) -> tuple[Any, ...]:
        """Chunk `chunk`'s per-op placements as one NodeStrategy per node of `graph`: the
        traced step at the program's microbatch (pp = 1, any traced depth), or that pipeline
        chunk's joint graph (autopar/build/pipeline.py `trace_stage`, exactly); PlanFileError
        where they do not match."""
        return _chunk_choices(self.placements, self.config, chunk, graph,
                              f"plan {self.model!r} does not match this model's" if self.origin == "plan" else
                              f"the placements solved for {self.model!r} do not match this rank's")

    def stage_collectives(self, chunk: int) -> dict[tuple[str, str], tuple[int, int]]:
        """{(kind, mesh axis name): (calls, bytes)} per step that chunk `chunk`'s placements priced."""
        found = next(s for s in self.placements if s.chunk == chunk)
        return {(kind, axis): (calls, nbytes) for kind, axis, calls, nbytes in found.collectives}


def _check_chunks(records: Sequence[StagePlacements], config: ParallelConfig, what: str, advice: str) -> None:
    """One placement record per chunk of `config`, in chunk order (pp = 1: chunk 0), each a
    valid set of op rows; else PlanFileError `what` the chunks found, then `advice`."""
    chunks = [s.chunk for s in records]
    want = list(range(config.pp * config.interleave)) if config.pp > 1 else [0]
    if chunks != want:
        raise PlanFileError(f"{what} per-op placements for chunks {chunks}, but its config (pp {config.pp}, "
                            f"interleave {config.interleave}) has chunks {want}{advice}")
    for s in records:
        _check_op_placements(s.placements, f"placements[{s.chunk}]")


def _chunk(records: Sequence[StagePlacements], chunk: int) -> tuple[OpPlacement, ...]:
    """Chunk `chunk`'s op rows among `records`; () where none is for it."""
    return next((s.placements for s in records if s.chunk == chunk), ())


def _chunk_choices(records: Sequence[StagePlacements], config: ParallelConfig, chunk: int, graph: Any,
                   what: str) -> tuple[Any, ...]:
    """Chunk `chunk`'s placements as one NodeStrategy per node of `graph` (`_match_placements`):
    a one-stage program's traced step (any depth), or a pipeline chunk's graph exactly;
    PlanFileError starting `what` (then "traced step" or "pipeline chunk k")."""
    if config.pp == 1:
        return _match_placements(_chunk(records, 0), graph, f"{what} traced step")
    return _match_placements(_chunk(records, chunk), graph, f"{what} pipeline chunk {chunk}", exact=True)


def _check_op_placements(placements: Sequence[OpPlacement], where: str) -> None:
    """Each op named once, each placement text one placement per (dp, tp) mesh axis."""
    keys = [p.key for p in placements]
    if len(set(keys)) != len(keys):
        raise PlanFileError(f"plan {where} name an op twice; the file was edited. Re-run `autopar search`")
    mesh_axes = 2
    for p in placements:
        for text in p.outputs + p.inputs + ((p.update,) if p.update else ()):
            try:
                axes = len(parse_placements(text))
            except ValueError as exc:
                raise PlanFileError(f"plan {where}[{p.key!r}]: {exc}") from None
            if axes != mesh_axes:
                raise PlanFileError(f"plan {where}[{p.key!r}] {text} do not match the (dp, tp) mesh")


def _match_placements(placements: Sequence[OpPlacement], graph: Any, what: str, *, exact: bool = False
                      ) -> tuple[Any, ...]:
    """`placements` as one NodeStrategy per node of `graph`, matched by node key and op;
    PlanFileError (starting with `what`) naming the first op that does not match, or with
    `exact` an op the plan places that the graph lacks (a chunk is traced as it was solved)."""
    by_key = {p.key: p for p in placements}
    keys = graph.node_keys()
    out = []
    for node, key in zip(graph.nodes, keys):
        p = by_key.get(key)
        if p is None or p.op != node.op:
            raise PlanFileError(
                f"{what}: op {node.op} ({node.name}, {node.module_path or 'top level'}) "
                + ("is not in the plan" if p is None else f"is {p.op} in the plan")
                + "; the model or its input shapes differ from the search's. Re-run `autopar search` for "
                  "this model and batch")
        out.append(NodeStrategy(outputs=tuple(parse_placements(t) for t in p.outputs),
                                inputs=tuple(parse_placements(t) for t in p.inputs),
                                update=parse_placements(p.update) if p.update else None))
    if exact and len(set(keys)) != len(by_key):
        extra = sorted(set(by_key) - set(keys))
        raise PlanFileError(f"{what}: the plan places {len(extra)} ops this trace does not have (e.g. "
                            f"{extra[0]} {by_key[extra[0]].op}); the model or its input shapes differ from the "
                            "search's. Re-run `autopar search` for this model and batch")
    return tuple(out)


def _unsupported_version(version: Any) -> PlanFileError:
    older = sorted(MIGRATIONS)
    return PlanFileError(f"plan version {version!r} is not supported; this autopar reads version {PLAN_VERSION} "
                         f"(and versions {', '.join(map(str, older[:-1]))} and {older[-1]}). Re-run `autopar search` "
                         "to write a new plan")


def _refuse_constant(name: str) -> float:
    raise PlanFileError(f"plan contains {name}, which is not a number a plan can hold (its numbers are finite); "
                        "the file was edited or corrupted. Re-run `autopar search` to write a new plan")
