"""Published mixture-of-experts training runs as pricing jobs for the one model.

Where it sits: benchmarks/lib/ (not part of the installed package). Reads
benchmarks/data/published_moe_runs.csv (columns and sources: benchmarks/data/README.md) and
turns every row into (`moe:` model spec, ParallelConfig, Cluster, global batch) using only
the row's explicit columns; benchmarks/validate_moe.py prices each job with `autopar.price`,
the path `autopar price` takes.

Row -> pricing job (no rule looks at the source's name):
- model: a `moe:` spec (autopar/models/moe.py) with the row's layers, hidden, vocab, seq,
  experts, top_k, expert_ffn and shared_experts. Attention is the zoo's grouped-query
  attention with hidden = heads x head size: the row's heads where hidden splits into that
  many heads of even size, else hidden // head_dim heads (gpt-oss: 2880 // 64 = 45), and
  the largest divisor of those heads that is at most the row's kv heads. Every layer is a
  MoE layer (a row's `dense_layers` are priced as MoE layers; multi-head latent attention
  as GQA): `priced_as` in the report lists these departures per row.
- routing: a blank capacity factor means a dropless run; the measured systems force-balance
  their routers for benchmarks, so every expert gets exactly its even share, which is
  capacity_factor 1.0 of the GShard dispatch. Tokens route in groups of `group_tokens`
  (validate_moe.py's --group-tokens, one global value; the dispatch einsums' cost is
  2 g / (3 f) of the experts' FLOPs, module docstring of autopar/models/moe.py).
- degrees: tp, pp, dp columns; zero stage from `zero_stage` (FSDP runs 3, Megatron's
  distributed optimizer 1); micro_batch; recompute = the leading word of `recompute`
  (blank: none); a row's `vp` is priced as the interleaved schedule only where its layers
  cut evenly into pp x vp chunks, else as 1F1B (listed in `priced_as`).
- expert parallelism: `autopar price` has no expert-parallel degree. Experts are a
  placement: the weights [E, d, f] may be sharded on E over the (dp, tp) mesh axes the ILP
  chooses. The row's `ep` is reported beside the ways the plan stores them split on E
  (`experts_degree`; what the expert matmuls compute on is the probe
  benchmarks/probes/probe_expert_placement.py's question).
- flags: float8 runs, and GPUs without a profile (H800: H100 compute, NVLink cut to
  400 GB/s bidirectional) are priced as bf16 on the nearest profile and kept out of the headline figures.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autopar.plan import Plan

from benchmarks.lib.published_runs import ROOT, _hardware_name, _int

MOE_CSV = ROOT / "benchmarks" / "data" / "published_moe_runs.csv"
DEFAULT_GROUP_TOKENS = 512
"""Routing-group size of the priced GShard dispatch (the zoo's deepseek-v3-like preset's):
its dense dispatch and combine cost 2 g / (3 f) of the experts' FLOPs, 0.12-0.44 for these
rows' expert sizes f = 768-2880 (the share each row pays is reported)."""
BALANCED_CAPACITY_FACTOR = 1.0
"""A dropless run with a force-balanced router gives every expert exactly k s / E tokens."""
H800_NVLINK_BYTES_PER_S = 200e9
"""H800 SXM: the H100 SXM's compute and memory with NVLink cut from 900 to 400 GB/s
bidirectional, i.e. 200 GB/s per direction (the h100 profile's 450 GB/s is per direction)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MoERun:
    index: int
    row: dict[str, str]
    spec: str
    config: Any  # ParallelConfig
    cluster: Any  # Cluster
    global_batch: int
    reported_tokens_per_gpu: float
    priced_as: tuple[str, ...]
    """How the priced job departs from the published run (architecture, schedule)."""
    flags: tuple[str, ...]
    """Why the row is kept out of the headline figures (float8, no hardware profile)."""

    @property
    def label(self) -> str:
        c = self.config
        return (f"tp{c.tp} pp{c.pp} dp{c.dp} z{c.zero} mb{c.micro_batch} {c.recompute}"
                + (f" v{c.interleave}" if c.interleave > 1 else ""))


def attention_heads(hidden: int, heads: int, kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(heads, kv heads) of the zoo's attention (hidden = heads x an even head size) closest
    to the published ones (module docstring)."""
    if hidden % heads or (hidden // heads) % 2:
        if not head_dim or hidden % head_dim:
            raise ValueError(f"hidden={hidden} splits neither into heads={heads} nor into heads of "
                             f"head_dim={head_dim}")
        heads = hidden // head_dim
    kv = max(d for d in range(1, min(kv_heads or heads, heads) + 1) if heads % d == 0)
    return heads, kv


def moe_spec(row: dict[str, str], group_tokens: int = DEFAULT_GROUP_TOKENS) -> str:
    """The `moe:` spec the row is priced as (module docstring)."""
    hidden = _int(row["hidden"])
    heads, kv = attention_heads(hidden, _int(row["heads"]), _int(row["kv_heads"]), _int(row["head_dim"]))
    seq = _int(row["seq_len"])
    cf = float(row["capacity_factor"]) if row["capacity_factor"].strip() else BALANCED_CAPACITY_FACTOR
    group = min(group_tokens, seq)
    return (f"moe:layers={_int(row['layers'])},hidden={hidden},heads={heads},kv_heads={kv},"
            f"vocab={_int(row['vocab'])},seq={seq},experts={_int(row['experts'])},top_k={_int(row['top_k'])},"
            f"expert_ffn={_int(row['expert_ffn'])},shared_experts={_int(row['shared_experts'])},"
            f"group_tokens={group},capacity_factor={cf}")


def _departures(row: dict[str, str], spec: str, interleaved: bool) -> list[str]:
    from autopar.models.zoo import parse_spec

    cfg = parse_spec(spec)
    out = []
    if cfg.heads != _int(row["heads"]) or cfg.hidden // cfg.heads != _int(row["head_dim"]):
        out.append(f"attention {cfg.heads}x{cfg.hidden // cfg.heads} heads, {cfg.num_kv_heads} kv "
                   f"(published {row['heads']}x{row['head_dim']}, {row['kv_heads']} kv)")
    elif cfg.num_kv_heads != (_int(row["kv_heads"]) or cfg.heads):
        out.append(f"{cfg.num_kv_heads} kv heads (published {row['kv_heads']})")
    kind = row.get("attention", "gqa").strip()
    if kind == "mla":
        out.append("multi-head latent attention priced as multi-head attention")
    elif kind == "gqa-sliding-window":
        out.append("sliding-window layers priced as full causal attention")
    if _int(row["dense_layers"]):
        out.append(f"{row['dense_layers']} dense layers priced as MoE layers")
    ep, dp = _int(row["ep"], 1), _int(row["dp"])
    if ep > 1 and ep != dp:
        out.append(f"EP {ep} over a group other than dp {dp} priced without --ep (the (dp, tp) mesh has no axis "
                   "for it: the ILP places the experts)")
    vp = _int(row["vp"], 1)
    if vp > 1 and not interleaved:
        out.append(f"vp{vp} priced as 1F1B ({row['layers']} layers do not cut into pp x vp chunks)")
    return out


def _flags(row: dict[str, str]) -> tuple[str, ...]:
    flags = []
    if "fp8" in row["precision"].lower():
        flags.append("fp8 run priced in bf16")
    if "h800" in row["gpu_type"].lower():
        flags.append("H800 priced as H100 with NVLink at 200 GB/s per direction")
    return tuple(flags)


def to_moe_run(index: int, row: dict[str, str], group_tokens: int = DEFAULT_GROUP_TOKENS) -> MoERun:
    """The pricing job of one CSV row (module docstring); ValueError if it has none."""
    from dataclasses import replace

    from autopar.cluster import Cluster
    from autopar.config import ParallelConfig

    for key in ("url", "publication", "source_id"):
        if not row.get(key, "").strip():
            raise ValueError(f"row {index} ({row.get('model')!r}) has no {key}")
    gpus, tp, pp = _int(row["gpus"]), _int(row["tp"]), _int(row["pp"])
    if not (gpus and tp and pp):
        raise ValueError(f"row {index}: gpus/tp/pp not given")
    dp = _int(row["dp"]) or gpus // (tp * pp)
    if tp * pp * dp != gpus:
        raise ValueError(f"row {index}: tp {tp} x pp {pp} x dp {dp} != {gpus} GPUs")
    layers, vp = _int(row["layers"]), _int(row["vp"], 1)
    interleaved = vp > 1 and pp > 1 and layers % (pp * vp) == 0
    recompute = next((r for r in ("full", "selective") if row["recompute"].lower().startswith(r)), "none")
    ep = _int(row["ep"], 1)
    config = ParallelConfig(tp=tp, pp=pp, dp=dp, zero=_int(row["zero_stage"]), ep=dp if ep == dp > 1 else 1,
                            micro_batch=_int(row["micro_batch"], 1),
                            schedule="interleaved" if interleaved else "1f1b", interleave=vp if interleaved else 1,
                            recompute=recompute, precision="bf16-mixed")  # type: ignore[arg-type]
    gpu = row["gpu_type"]
    name = "h100" if "h800" in gpu.lower() else _hardware_name(gpu)
    cluster = Cluster.parse(f"{name}:{max(1, gpus // 8)}x{min(8, gpus)}")
    if "h800" in gpu.lower():
        cluster = replace(cluster, hardware=replace(cluster.hardware,
                                                    intra_node_bandwidth_bytes_per_s=H800_NVLINK_BYTES_PER_S))
    spec = moe_spec(row, group_tokens)
    return MoERun(index=index, row=row, spec=spec, config=config, cluster=cluster,
                  global_batch=_int(row["global_batch"]),
                  reported_tokens_per_gpu=float(row["reported_tokens_per_sec_per_gpu"]),
                  priced_as=tuple(_departures(row, spec, interleaved)), flags=_flags(row))


def load_moe_runs(path: Path | str = MOE_CSV, group_tokens: int = DEFAULT_GROUP_TOKENS) -> list[MoERun]:
    """Every row of the MoE CSV as a pricing job; a row without one raises ValueError."""
    with open(path, newline="") as f:
        return [to_moe_run(i, row, group_tokens) for i, row in enumerate(csv.DictReader(f))]


def experts_degree(plan: Plan) -> tuple[int, str]:
    """(ways split on E, the experts' placement) the plan stores them in: the product of the
    (dp, tp) mesh axes on which the first routed-expert weight `moe.w1` [E, d, f] is
    sharded on E (Shard(0)); from the plan's parameter placements (one stage) or its
    pipeline stages' (the largest degree where stages differ, every distinct placement
    listed)."""
    tables = [plan.intra_op_info.parameters] if plan.intra_op_info is not None else []
    tables += [stage.placements for stage in plan.stages]
    found = dict.fromkeys(p for table in tables for name, p in table if name.endswith("moe.w1"))
    if not found:
        return 0, "not found"
    return max(shard_degree(p, plan.mesh_shape) for p in found), "; ".join(found)


def shard_degree(placement: str, mesh_shape: tuple[int, ...]) -> int:
    """Ways a tensor is split on dim 0 by a placement text `(p_dp, p_tp)[ update ...]` on a
    mesh of `mesh_shape` (the trailing axes are the placement's): the product of the sizes
    of the axes placed Shard(0)."""
    text = placement.split("update")[0].strip().removeprefix("(").removesuffix(")")
    axes = [a.strip() for a in text.split(",")]
    degree = 1
    for axis, size in zip(axes, mesh_shape[-len(axes):]):
        if axis == "S(0)":
            degree *= size
    return degree

__all__ = ["DEFAULT_GROUP_TOKENS", "MOE_CSV", "MoERun", "attention_heads", "experts_degree", "load_moe_runs",
           "moe_spec", "shard_degree", "to_moe_run"]
