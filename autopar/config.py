"""One parallel configuration: the knobs `autopar price` and `autopar train` share.

Where it sits: shared data. The whole-plan search produces one of these (plus per-op
choices) inside a Plan; the CLI's configuration flags map 1:1 onto its fields.

Terms: dp/tp/pp are the data-, tensor- and pipeline-parallel degrees (dp * tp * pp =
devices); `micro_batch` is sequences per microbatch per data-parallel rank;
`num_microbatches` = global_batch / (dp * micro_batch) (gradient accumulation steps
without pipelining); `interleave` is the number of model chunks per pipeline rank for
the interleaved 1F1B schedule.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from autopar.precision import REDUCE_DTYPES, Precision, default_policy, policy

Schedule = Literal["gpipe", "1f1b", "interleaved", "zb"]
Recompute = Literal["none", "selective", "full"]
Attention = Literal["flash", "math"]

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb")
"""zb: torch's ScheduleInterleavedZeroBubble (backward split into input- and weight-gradient
parts that fill the bubbles; Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024)."""
RECOMPUTE: tuple[str, ...] = ("none", "selective", "full")
ATTENTION: tuple[str, ...] = ("flash", "math")


def default_stage_layers(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Layers per pipeline stage (or chunk) when a plan gives no `stage_layers`: as even as
    possible, the earlier stages taking the remainder, so the counts always sum to
    `num_layers` (10 layers on 4 stages: 3, 3, 2, 2). The one home of this split:
    the cost model prices it and codegen's pipeline chunks run it."""
    base, extra = divmod(num_layers, num_stages)
    return tuple(base + (1 if i < extra else 0) for i in range(num_stages))


def microbatches_in_flight(schedule: str, num_stages: int, chunks: int, stage: int, num_microbatches: int) -> float:
    """Microbatches whose activations pipeline stage `stage` holds at its peak: 1 without a
    pipeline; m under GPipe; min(m, p - stage) under 1F1B (and zero bubble); the 1F1B
    count times 1 + (p - 1) / (p v) interleaved over v chunks (Korthikanti et al. 2022,
    Sec 4.2.3), at most m. The one home of this count: the cost model's stage
    memory and the stage DP's memory rows read it."""
    p, m = num_stages, num_microbatches
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    count = float(min(m, p - stage))
    if schedule == "interleaved":
        count = min(float(m), count * (1 + (p - 1) / (p * chunks)))
    return count


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    """ZeRO stage over dp, as each parameter's compute and weight-update placements
    (solver/forced.py): 0 both replicated (gradients all-reduced); 1 and 2 weights replicated,
    update sharded (gradients reduce-scattered once per step, optimizer state and step on the
    shard, updated weights all-gathered once per step; the per-op program runs 2 as 1, the
    gradient accumulated whole); 3 both sharded (FSDP: weights gathered for each use)."""
    ep: int = 1
    """Expert parallelism over dp: 1, or dp (the routed experts' stacked weights [E, ...]
    stored split on E over the data-parallel ranks, each rank holding and computing its own
    experts, tokens sent to them by all-to-all; solver/forced.py). With 1 the ILP may still
    split them where that is faster. A group smaller than dp would need a mesh axis of its
    own, which the (dp, tp) mesh does not have."""
    micro_batch: int = 1
    schedule: Schedule = "1f1b"
    interleave: int = 1
    recompute: Recompute = "none"
    attention: Attention = "flash"
    sequence_parallel: bool = True
    """With tp > 1, shard norms/dropout activations over the sequence (Korthikanti et al.)."""
    precision: str = ""
    """The precision policy (autopar/precision.py): `fp32`, `bf16-mixed` or `bf16`; "" is the
    hardware's default (`fp32` on the cpu profile, else `bf16-mixed`), what a plan records
    once the cluster is known (`resolved`)."""
    reduce_dtype: str = ""
    """The dtype gradients are accumulated and reduced in (float32 / bfloat16); "" is the
    policy's (float32)."""
    compiled: bool = False
    """The per-rank graphs run through Inductor (`--compile`, codegen/inductor.py) and are
    priced so: memory-bound ops and views at Efficiency.compiled_memory_factor of their
    eager time (cost_model/table.py)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep", "micro_batch", "interleave"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"--zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.ep not in (1, self.dp):
            raise ValueError(f"--ep {self.ep}: expert parallelism runs over the whole data-parallel axis, so --ep must "
                             f"be 1 or equal --dp ({self.dp}); use --ep {self.dp}, or --dp {self.ep} with the "
                             "other degrees adjusted")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"--attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}")
        if self.precision:
            policy(self.precision, self.reduce_dtype)  # raises naming the choices
        elif self.reduce_dtype and self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"--reduce-dtype must be one of {', '.join(REDUCE_DTYPES)}, got {self.reduce_dtype!r}")
        if self.schedule not in ("interleaved", "zb") and self.interleave != 1:
            raise ValueError(f"--interleave {self.interleave} needs --schedule interleaved (or zb)")
        if self.schedule in ("interleaved", "zb") and self.pp == 1:
            raise ValueError(f"--schedule {self.schedule} needs --pp > 1 (it interleaves pipeline stages); "
                             "add --pp 2 or more, or use --schedule 1f1b")

    def resolved(self, hardware: str) -> "ParallelConfig":
        """This configuration with its precision policy named: the given one, else the
        default of `hardware` (a hardware profile name: "cpu", "h100", ...)."""
        return self if self.precision else replace(self, precision=default_policy(hardware))

    def policy(self, hardware: str = "cpu") -> Precision:
        """The dtypes this configuration computes, keeps and reduces in (`hardware` names the
        profile whose default applies where no policy is given)."""
        return policy(self.precision or default_policy(hardware), self.reduce_dtype)

    @property
    def syncs_each_microbatch(self) -> bool:
        """Whether this configuration's programs sync every microbatch's gradients to their
        update shards (zero 2 over a dp axis): the rule the solver applies
        (solver/forced.py `zero_2_syncs`, ILP `grads_each_microbatch`) and the build reads
        for pipeline stages, where no solver runs (autopar/placing.py)."""
        return self.zero == 2 and self.dp > 1

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp * self.pp

    def num_microbatches(self, global_batch: int) -> int:
        per_step = self.dp * self.micro_batch
        if global_batch <= 0:
            raise ValueError(f"--global-batch must be a positive integer, got {global_batch}")
        if global_batch % per_step:
            raise ValueError(
                f"global batch {global_batch} is not divisible by dp * micro-batch = "
                f"{self.dp} * {self.micro_batch} = {per_step}; pick a global batch that is a multiple "
                f"of {per_step} or change --dp / --micro-batch"
            )
        return global_batch // per_step

    def check(self, *, global_batch: int, num_devices: int, heads: int = 0, kv_heads: int = 0,
              num_layers: int = 0) -> int:
        """Validate against a job; returns num_microbatches. ValueError says what to change."""
        if self.num_devices != num_devices:
            raise ValueError(
                f"dp * tp * pp = {self.dp} * {self.tp} * {self.pp} = {self.num_devices} but the cluster "
                f"has {num_devices} devices; choose degrees whose product is {num_devices}"
            )
        if heads and heads % self.tp:
            divisors = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
            raise ValueError(f"--tp {self.tp} does not divide the model's {heads} attention heads (each tp rank "
                             f"takes whole heads); pick --tp from {divisors}")
        if kv_heads and kv_heads % self.tp:  # the runtime splits key/value heads, it does not replicate them
            raise ValueError(f"--tp {self.tp} does not divide the model's {kv_heads} key/value heads; "
                             f"pick a --tp that divides {kv_heads}")
        chunks = self.pp * self.interleave
        if num_layers and num_layers < chunks:
            raise ValueError(
                f"pp * interleave = {chunks} pipeline chunks but the model has only {num_layers} layers; "
                f"lower --pp / --interleave so that pp * interleave <= {num_layers}"
            )
        m = self.num_microbatches(global_batch)
        if self.schedule in ("interleaved", "zb") and m % self.pp:
            name = "interleaved 1F1B" if self.schedule == "interleaved" else "zero bubble (zb)"
            raise ValueError(
                f"{name} needs the number of microbatches ({m}) to be a multiple of pp ({self.pp}); "
                f"change --global-batch or --micro-batch, or use --schedule 1f1b"
            )
        return m

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ParallelConfig":
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data)
