"""Published training runs as pricing jobs: the loader the validation, fit and ranking scripts share.

Where it sits: benchmarks/lib/ (not part of the installed package). Reads
benchmarks/data/published_runs.csv (README beside it: sources, columns, options), turns
every row into (model spec, ParallelConfig, Cluster, RuntimeOptions, stage split) using
only the row's explicit columns, and caches traced graph profiles on disk so the fit
script can price hundreds of rows many times in seconds.

Row -> pricing job (no rule looks at the source's name):
- model: `gpt:` spec from layers/hidden/heads/vocab/seq (GPT, MPT, BLOOM rows: GPT blocks of
  those sizes), `llama:` spec for rows whose model names a Llama (GQA heads and SwiGLU size
  from the published Llama shapes below);
- degrees: tp, pp, dp columns (dp = gpus / (tp pp) when blank), micro_batch (1 when blank),
  zero stage = the leading digit of zero_stage, recompute = the leading word of recompute;
- price_options (`key=value;` pairs, the same names as `autopar price`'s flags):
  ParallelConfig fields (attention, sequence_parallel, recompute, interleave), runtime
  options (benchmarks/baselines/analytic/options.py: zero3, checkpoint_every, selective_policy,
  grad_reduce_bytes, compiled, async_tp, dp_bucket_bytes), the stage split
  (stage_layers=a/b/...), and the cluster's deviations from the named GPU profile
  (nic_gbps_per_gpu, hbm_tbps, memory_gb);
- flags: rows the cost model cannot express faithfully (float8 linears; GPUs whose peak is
  unknown, e.g. power-capped H100s) are priced but kept out of the fit and reported apart.
"""

from __future__ import annotations

import csv
import hashlib
import pickle
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DATA_CSV = ROOT / "benchmarks" / "data" / "published_runs.csv"
CACHE_DIR = ROOT / "benchmarks" / ".cache" / "profiles"

# Published Llama shapes (kv heads, SwiGLU inner size): Meta model cards / torchtitan configs.
LLAMA_SHAPES = {
    ("2", 5120): (40, 13824), ("2", 8192): (8, 28672), ("2", 4096): (32, 11008),
    ("3", 4096): (8, 14336), ("3", 8192): (8, 28672), ("3", 16384): (8, 53248),
}
CONFIG_OPTIONS = ("attention", "sequence_parallel", "recompute", "interleave")
CLUSTER_OPTIONS = ("nic_gbps_per_gpu", "hbm_tbps", "memory_gb")
TRACE_SOURCES = ("autopar/trace/__init__.py", "autopar/trace/capture.py", "autopar/trace/lowering.py", "autopar/ir.py",
                 "autopar/models/gpt.py", "autopar/models/llama.py", "autopar/models/zoo.py",
                 "benchmarks/baselines/analytic/profile.py")
"""Files whose paths and content key the on-disk profile cache (a moved file changes the
pickled classes' module names, so it keys a new entry)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    index: int
    row: dict[str, str]
    source_id: str
    spec: str
    config: Any  # ParallelConfig
    cluster: Any  # Cluster
    options: Any  # RuntimeOptions
    stage_layers: tuple[int, ...] | None
    global_batch: int
    reported_tokens_per_gpu: float
    flags: tuple[str, ...]

    @property
    def group(self) -> tuple[str, str, int, int]:
        """One model on one cluster at one sequence length: the ranking unit."""
        return (self.source_id, self.spec, self.cluster.num_devices, _int(self.row["seq_len"]))

    @property
    def label(self) -> str:
        c = self.config
        extra = ",".join(f"{k}={v}" for k, v in sorted(self.options.changed().items()))
        return (f"tp{c.tp} pp{c.pp} dp{c.dp} z{c.zero} mb{c.micro_batch} {c.recompute}"
                + (f" v{c.interleave}" if c.interleave > 1 else "") + (f" [{extra}]" if extra else ""))


def _int(text: str, default: int = 0) -> int:
    match = re.match(r"\s*(\d+)", text or "")
    return int(match.group(1)) if match else default


def _hardware_name(gpu_type: str) -> str:
    text = gpu_type.lower()
    for name in ("h200", "h100", "b200"):
        if name in text:
            return name
    if "a100" in text:
        return "a100-40gb" if "40" in text.split("a100")[1][:8] else "a100-80gb"
    raise ValueError(f"unknown GPU type {gpu_type!r}")


def model_spec(row: dict[str, str]) -> str:
    layers, hidden, heads = _int(row["layers"]), _int(row["hidden"]), _int(row["heads"])
    vocab, seq = _int(row["vocab"]), _int(row["seq_len"])
    name = row["model"]
    if "llama" in name.lower():
        gen = "3" if re.search(r"llama\s*3", name, re.I) else "2"
        kv, ffn = LLAMA_SHAPES.get((gen, hidden), (heads, 0))
        extra = f",ffn={ffn}" if ffn else ""
        return f"llama:layers={layers},hidden={hidden},heads={heads},kv_heads={kv}{extra},vocab={vocab},seq={seq}"
    return f"gpt:layers={layers},hidden={hidden},heads={heads},vocab={vocab},seq={seq}"


def parse_options(text: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for part in (text or "").split(";"):
        if part.strip():
            key, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"price_options entry {part!r} is not key=value")
            pairs[key.strip()] = value.strip()
    return pairs


def _flags(row: dict[str, str]) -> tuple[str, ...]:
    notes, gpu = row["notes"].lower(), row["gpu_type"].lower()
    flags = []
    if ("float8" in notes or "fp8" in notes) and "no float8" not in notes:
        flags.append("fp8 run priced in bf16")
    if "lower-tdp" in gpu or "500 w" in gpu:
        flags.append("power-capped H100 (peak unknown) priced as SXM")
    return tuple(flags)


def to_run(index: int, row: dict[str, str]) -> Run:
    """The pricing job of one CSV row (module docstring); ValueError if it cannot be priced."""
    from autopar.cluster import GIB, Cluster
    from autopar.config import ParallelConfig
    from benchmarks.baselines.analytic.options import RuntimeOptions

    opts = parse_options(row.get("price_options", ""))
    unknown = set(opts) - set(CONFIG_OPTIONS) - set(CLUSTER_OPTIONS) - {"stage_layers"} - set(
        RuntimeOptions.__dataclass_fields__)
    if unknown:
        raise ValueError(f"row {index}: unknown price_options {sorted(unknown)}")
    gpus = _int(row["gpus"])
    tp, pp = _int(row["tp"]), _int(row["pp"])
    if not tp or not pp:
        raise ValueError(f"row {index}: tp/pp not given")
    dp = _int(row["dp"]) or gpus // (tp * pp)
    mb = _int(row["micro_batch"], 1)
    recompute = opts.get("recompute") or next(
        (r for r in ("full", "selective", "none") if row["recompute"].lower().startswith(r)), "none")
    interleave = int(opts.get("interleave", 1))
    config = ParallelConfig(
        tp=tp, pp=pp, dp=dp, zero=_int(row["zero_stage"]), micro_batch=mb,
        schedule="interleaved" if interleave > 1 else "1f1b", interleave=interleave,
        recompute=recompute,  # type: ignore[arg-type]
        attention=opts.get("attention", "flash"),  # type: ignore[arg-type]
        sequence_parallel=opts.get("sequence_parallel", "1") not in ("0", "false", "no"))
    cluster = Cluster.parse(f"{_hardware_name(row['gpu_type'])}:{max(1, gpus // 8)}x{min(8, gpus)}")
    hw = cluster.hardware
    if "nic_gbps_per_gpu" in opts:
        hw = replace(hw, inter_node_bandwidth_bytes_per_s=float(opts["nic_gbps_per_gpu"]) * 1e9 / 8)
    if "hbm_tbps" in opts:
        hw = replace(hw, memory_bandwidth_bytes_per_s=float(opts["hbm_tbps"]) * 1e12)
    if "memory_gb" in opts:
        hw = replace(hw, memory_bytes=int(float(opts["memory_gb"]) * GIB))
    cluster = replace(cluster, hardware=hw)
    runtime = RuntimeOptions.from_pairs({k: v for k, v in opts.items() if k in RuntimeOptions.__dataclass_fields__})
    stages = tuple(int(x) for x in opts["stage_layers"].split("/")) if "stage_layers" in opts else None
    reported = float(row["reported_tokens_per_sec_per_gpu"]) if row["reported_tokens_per_sec_per_gpu"] else \
        _sc21_tokens(row)
    return Run(index=index, row=row, source_id=row["source_id"], spec=model_spec(row), config=config,
               cluster=cluster, options=runtime, stage_layers=stages, global_batch=_int(row["global_batch"]),
               reported_tokens_per_gpu=reported, flags=_flags(row))


def _sc21_tokens(row: dict[str, str]) -> float:
    """Tokens/s per GPU from reported TFLOP/s with the SC'21 (hardware-FLOP) formula, eq. 3:
    96 B s l h^2 (1 + s/6h + V/16lh) per iteration of B sequences of s tokens."""
    l, h, s, v = (_int(row[k]) for k in ("layers", "hidden", "seq_len", "vocab"))
    per_token = 96 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return float(row["reported_tflops_per_gpu"]) * 1e12 / per_token


def load_runs(path: Path | str = DATA_CSV, rows: str | None = None) -> tuple[list[Run], list[str]]:
    """(runs, skipped-row messages); `rows` ("10-15,22", a script's `--rows`) keeps only
    those row indices."""
    from benchmarks.lib.bench_stats import row_filter

    keep = row_filter(rows)
    runs, skipped = [], []
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if keep is not None and i not in keep:
                continue
            try:
                runs.append(to_run(i, row))
            except ValueError as exc:
                skipped.append(f"row {i}: {exc}")
    return runs, skipped


def _trace_key(spec: str) -> str:
    digest = hashlib.sha256(spec.encode())
    for rel in TRACE_SOURCES:
        digest.update(rel.encode())
        digest.update((ROOT / rel).read_bytes())
    return digest.hexdigest()[:24]


def profiles_for(runs: list[Run], *, log: Any = None) -> dict[str, Any]:
    """GraphProfile per distinct model spec (2 traced layers, scaled to the real depth),
    from the on-disk cache when the tracer and profiler sources are unchanged."""
    from autopar.models import resolve
    from autopar.trace import trace_model
    from benchmarks.baselines.analytic import profile_graph

    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    for spec in dict.fromkeys(r.spec for r in runs):
        path = CACHE_DIR / f"{_trace_key(spec)}.pkl"
        if path.exists():
            out[spec] = pickle.loads(path.read_bytes())
            continue
        if log:
            log(f"tracing {spec}")
        graph = trace_model(resolve(spec), batch=1, dtype="bfloat16", layers_traced=2)
        out[spec] = profile_graph(graph)
        path.write_bytes(pickle.dumps(out[spec]))
    return out


def price_run(run: Run, profiles: dict[str, Any], efficiency: Any = None) -> Any:
    from benchmarks.baselines.analytic import price_profile

    return price_profile(profiles[run.spec], run.config, run.cluster, global_batch=run.global_batch,
                         stage_layers=run.stage_layers, options=run.options, efficiency=efficiency)


__all__ = ["DATA_CSV", "Run", "load_runs", "model_spec", "parse_options", "price_run", "profiles_for", "to_run"]
