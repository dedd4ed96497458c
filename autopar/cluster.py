"""Hardware profiles and clusters: what the cost model prices against.

Where it sits: shared data (no torch). `Cluster.parse("h100:128x8")` is what the CLI's
`--cluster` and `autopar.compile(model, "cpu:4")` accept. Hardware numbers are public
facts (sources in ../shared/notes/cost-model-facts.md, section 2); the efficiency factors
that turn peaks into achievable rates live in cost_model/, not here.

Terms: a *node* is a host; *devices* are the accelerators of all nodes; the intra-node
link is NVLink/NVSwitch (per device, one direction), the inter-node link the NIC
bandwidth per device (InfiniBand/RoCE).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

GIB = 1024**3


COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter")
OPTIONAL_KEYS = ("default_gpus_per_node", "comm_overlap", "collective_bandwidth_scale", "sm_count",
                 "matmul_fraction", "attention_fraction", "efficiency", "cores_per_node", "reference_s")


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    name: str
    peak_flops_per_s: tuple[tuple[str, float], ...]
    """Dense peak per dtype (bf16/fp16 tensor cores; fp32 for the non-tensor rate)."""
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    intra_node_bandwidth_bytes_per_s: float
    """Line rate per device, one direction (NVLink)."""
    intra_node_latency_s: float
    inter_node_bandwidth_bytes_per_s: float
    """NIC line rate per device, one direction."""
    inter_node_latency_s: float
    default_gpus_per_node: int = 8
    comm_overlap: float = 1.0
    """Share of the cost model's compute/communication overlap this hardware achieves: 1 on
    GPUs (NCCL runs on its own streams beside the kernels); 0 on the cpu profile: 2 cores
    leave none spare to hide gloo's work. Measured with the gradient buckets' waits
    deferred to the end of the step (codegen/collectives.py `GradSync`): llama-small dp2
    zero 1, 5 reduce-scatter buckets, median step 92.0 ms deferred against 92.0 ms waited
    at once (6 runs each, alternated; docs/cost-model.md)."""
    collective_bandwidth_scale: tuple[tuple[str, float], ...] = ()
    """Per collective kind ("all_reduce", "all_gather", "reduce_scatter"), its achievable
    bus bandwidth relative to the link's (missing kinds: 1.0). Empty for the GPU profiles
    (NCCL's ring kinds run at the same busBW); `autopar calibrate` measures it on gloo,
    whose all-gather and reduce-scatter are markedly slower than its all-reduce."""
    sm_count: int = 0
    """Streaming multiprocessors (GEMM wave quantization); 0 = not modelled (CPU)."""
    matmul_fraction: float = 1.0
    """Maximum achievable matmul rate / dense peak (best-shape bf16 GEMM): a hardware fact,
    from Stas Bekman's MAMF table (github.com/stas00/ml-engineering, compute/accelerator,
    'Maximum Achievable Matmul FLOPS comparison table'); 1.0 where the peak itself was
    measured (`autopar calibrate`)."""
    attention_fraction: float = 1.0
    """Best fused-attention (FlashAttention-2) forward rate / dense peak on this GPU: 0.73 on
    A100 (FlashAttention-2 paper, arXiv:2307.08691: 50-73%), 0.35 on H100 (FlashAttention-3
    paper, arXiv:2407.08608: "FlashAttention-2 achieves only 35% utilization on H100"); the
    published runs priced here ran FlashAttention-2-class kernels."""
    cores_per_node: int = 0
    """CPU cores the devices of one node share (the cpu profile: ranks are processes on the
    same cores); 0 = every device has its own compute (GPUs). With more ranks than cores
    the cost model slows compute, per-op costs and collectives by ranks / cores."""
    reference_s: float = 0.0
    """A calibrated profile's time of autopar.calibrate_rank.reference_workload per dedicated core
    when it was measured (0 = not calibrated): runs on a shared machine compare their own
    reference time with it to know the load they ran under."""
    efficiency: tuple[tuple[str, float], ...] = ()
    """Overrides of cost_model.efficiency.Efficiency fields for this hardware (the calibrated
    cpu profile's measured kernel overheads and efficiencies); empty for the GPU profiles."""

    def bandwidth_scale(self, kind: str) -> float:
        return dict(self.collective_bandwidth_scale).get(kind, 1.0)

    def peak_flops(self, dtype: str) -> float:
        table = dict(self.peak_flops_per_s)
        if dtype in table:
            return table[dtype]
        if dtype in ("float16", "bfloat16"):
            return table["bfloat16"]
        return table["float32"]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["peak_flops_per_s"] = dict(self.peak_flops_per_s)
        data["collective_bandwidth_scale"] = dict(self.collective_bandwidth_scale)
        data["efficiency"] = dict(self.efficiency)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Hardware":
        known = {f.name for f in fields(cls)}
        unknown, missing = set(data) - known, {f.name for f in fields(cls) if f.name not in OPTIONAL_KEYS} - set(data)
        if unknown or missing:
            raise ValueError(f"hardware profile: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}; "
                             f"expected {sorted(known)} (as `autopar calibrate --out` writes them)")
        peaks = data["peak_flops_per_s"]
        peaks = peaks.items() if isinstance(peaks, dict) else peaks
        # profiles written before comm_overlap existed: CPU ones are gloo on a CPU (no overlap)
        overlap = data.get("comm_overlap", 0.0 if str(data["name"]).startswith("cpu") else 1.0)
        scale = data.get("collective_bandwidth_scale", {})
        scale = scale.items() if isinstance(scale, dict) else scale
        unknown_kinds = {str(k) for k, _ in scale} - set(COLLECTIVE_KINDS)
        if unknown_kinds:
            raise ValueError(f"hardware profile: unknown collective kinds {sorted(unknown_kinds)} in "
                             f"collective_bandwidth_scale; expected some of {list(COLLECTIVE_KINDS)}")
        eff = data.get("efficiency", {})
        eff = eff.items() if isinstance(eff, dict) else eff
        return cls(**{**data, "comm_overlap": float(overlap),
                      "efficiency": tuple(sorted((str(k), float(v)) for k, v in eff)),
                      "peak_flops_per_s": tuple(sorted((str(k), float(v)) for k, v in peaks)),
                      "collective_bandwidth_scale": tuple(sorted((str(k), float(v)) for k, v in scale))})


_TB = 1e12
_GB = 1e9

CPU_PROFILE_PATH = Path(__file__).with_name("cpu_profile.json")
"""The built-in `cpu` profile: `autopar calibrate --devices 4 --out autopar/cpu_profile.json`
as run on this project's 2-core development machine (its measurements are kept in the file,
beside the profile). Recalibrate for another machine and pass the file to the CLI or to
`Cluster.parse(..., hardware=load_hardware(path))`."""
CPU_PROFILE = Hardware.from_json(json.loads(CPU_PROFILE_PATH.read_text())["hardware"])

_NCCL_NVLINK_HOP_S = 3.4e-6
"""NCCL's per-step latency of a ring over NVLink, Simple protocol (src/graph/tuning.cc
hwLatencies[NVLINK][RING][SIMPLE] = 3.4 us)."""
_NCCL_NET_HOP_S = 14e-6
"""NCCL's per-step latency across the network, Simple protocol (hwLatencies[NET][RING or
TREE][SIMPLE] = 14 us)."""

HARDWARE: dict[str, Hardware] = {
    # A100 SXM4: 312 TFLOP/s bf16 dense, 19.5 fp32 (156 TF32); NVLink3 300 GB/s per
    # direction; one 200 Gb/s HDR NIC per GPU (DGX A100); 108 SMs; MAMF 271.2 TFLOP/s (86.9%).
    "a100-40gb": Hardware(
        name="a100-40gb", peak_flops_per_s=(("bfloat16", 312 * _TB), ("float32", 156 * _TB)),
        memory_bytes=40 * 10**9, memory_bandwidth_bytes_per_s=1.555 * _TB,
        intra_node_bandwidth_bytes_per_s=300 * _GB, intra_node_latency_s=_NCCL_NVLINK_HOP_S,
        inter_node_bandwidth_bytes_per_s=25 * _GB, inter_node_latency_s=_NCCL_NET_HOP_S,
        sm_count=108, matmul_fraction=0.869, attention_fraction=0.73,
    ),
    "a100-80gb": Hardware(
        name="a100-80gb", peak_flops_per_s=(("bfloat16", 312 * _TB), ("float32", 156 * _TB)),
        memory_bytes=80 * 10**9, memory_bandwidth_bytes_per_s=2.039 * _TB,
        intra_node_bandwidth_bytes_per_s=300 * _GB, intra_node_latency_s=_NCCL_NVLINK_HOP_S,
        inter_node_bandwidth_bytes_per_s=25 * _GB, inter_node_latency_s=_NCCL_NET_HOP_S,
        sm_count=108, matmul_fraction=0.869, attention_fraction=0.73,
    ),
    # H100 SXM5: 989 TFLOP/s bf16 dense; NVLink4 450 GB/s per direction; 400 Gb/s NDR per GPU;
    # 132 SMs; MAMF 794.5 TFLOP/s (80.3%, "H200 is the same").
    "h100": Hardware(
        name="h100", peak_flops_per_s=(("bfloat16", 989 * _TB), ("float32", 494.7 * _TB)),
        memory_bytes=80 * 10**9, memory_bandwidth_bytes_per_s=3.35 * _TB,
        intra_node_bandwidth_bytes_per_s=450 * _GB, intra_node_latency_s=_NCCL_NVLINK_HOP_S,
        inter_node_bandwidth_bytes_per_s=50 * _GB, inter_node_latency_s=_NCCL_NET_HOP_S,
        sm_count=132, matmul_fraction=0.803, attention_fraction=0.35,
    ),
    "h200": Hardware(
        name="h200", peak_flops_per_s=(("bfloat16", 989 * _TB), ("float32", 494.7 * _TB)),
        memory_bytes=141 * 10**9, memory_bandwidth_bytes_per_s=4.8 * _TB,
        intra_node_bandwidth_bytes_per_s=450 * _GB, intra_node_latency_s=_NCCL_NVLINK_HOP_S,
        inter_node_bandwidth_bytes_per_s=50 * _GB, inter_node_latency_s=_NCCL_NET_HOP_S,
        sm_count=132, matmul_fraction=0.803, attention_fraction=0.35,
    ),
    # B200 (HGX, 1000 W): 2250 TFLOP/s bf16 dense, ~180 GB usable, NVLink5 900 GB/s per
    # direction; 148 SMs; MAMF 1745 TFLOP/s (77.6%).
    "b200": Hardware(
        name="b200", peak_flops_per_s=(("bfloat16", 2250 * _TB), ("float32", 1100 * _TB)),
        memory_bytes=180 * 10**9, memory_bandwidth_bytes_per_s=8 * _TB,
        intra_node_bandwidth_bytes_per_s=900 * _GB, intra_node_latency_s=_NCCL_NVLINK_HOP_S,
        inter_node_bandwidth_bytes_per_s=50 * _GB, inter_node_latency_s=_NCCL_NET_HOP_S,
        sm_count=148, matmul_fraction=0.776, attention_fraction=0.35,
    ),
    "cpu": CPU_PROFILE,
}

_CLUSTER_RE = re.compile(r"^(?P<hw>[a-z0-9-]+):(?:(?P<nodes>\d+)x)?(?P<per>\d+)$")


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    hardware: Hardware
    num_nodes: int
    devices_per_node: int
    memory_limit_bytes: int | None = None
    """Per-device memory budget if the user set one (`--memory-gb`), else the hardware's."""
    node_ranks: int = 0
    """Ranks that share one node's cores, counting those outside this cluster: a pipeline
    stage's cluster (`stage`) keeps the whole node's, so that a collective inside the stage
    knows that the other stages' ranks work beside it (cost_model/collectives.py,
    `stage_collective_wait_s`). 0 = devices_per_node."""

    def __post_init__(self) -> None:
        if self.num_nodes <= 0 or self.devices_per_node <= 0:
            raise ValueError(
                f"cluster needs at least one node and one device per node, got "
                f"{self.num_nodes} x {self.devices_per_node}"
            )
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise ValueError(f"memory limit must be positive, got {self.memory_limit_bytes} bytes")

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def device_memory_bytes(self) -> int:
        return self.memory_limit_bytes if self.memory_limit_bytes is not None else self.hardware.memory_bytes

    @property
    def spec(self) -> str:
        return f"{self.hardware.name}:{self.num_nodes}x{self.devices_per_node}"

    def stage(self, devices: int) -> "Cluster":
        """The devices one pipeline stage runs on (`devices` of this cluster). Where ranks
        share a node's cores (the cpu profile), the other stages' ranks still share them:
        the cores are scaled with the devices, keeping the node's contention. (The pipeline
        search prices a stage on this: solver/pipeline_stages.py `_stage_cluster`.)"""
        per_node = min(self.devices_per_node, devices)
        hw = self.hardware
        if hw.cores_per_node and per_node < self.devices_per_node:
            hw = replace(hw, cores_per_node=hw.cores_per_node * per_node / self.devices_per_node)
        return replace(self, num_nodes=max(1, devices // per_node), devices_per_node=per_node, hardware=hw,
                       node_ranks=self.node_ranks or self.devices_per_node)

    def with_memory_gb(self, memory_gb: float | None) -> "Cluster":
        if memory_gb is None:
            return self
        if memory_gb <= 0:
            raise ValueError(f"--memory-gb must be positive, got {memory_gb}")
        return replace(self, memory_limit_bytes=int(memory_gb * GIB))

    @classmethod
    def parse(cls, spec: str, hardware: Hardware | None = None) -> "Cluster":
        """`h100:128x8` (nodes x devices per node), `cpu:4` (one node of 4), `a100-80gb:1x8`.

        `hardware` (e.g. `load_hardware("profile.json")` from `autopar calibrate`) replaces
        the built-in profile of the same name."""
        match = _CLUSTER_RE.match(spec.strip().lower()) if isinstance(spec, str) else None
        if match is None:
            raise ValueError(
                f"malformed cluster {spec!r}; expected HW:NODESxDEVICES such as 'h100:16x8' or "
                f"'cpu:4', with HW one of {', '.join(HARDWARE)}"
            )
        hw_name = match["hw"]
        if hardware is not None:
            if hardware.name != hw_name:
                raise ValueError(f"cluster {spec!r} names hardware {hw_name!r} but the given profile is "
                                 f"{hardware.name!r}; use '{hardware.name}:...' with this profile")
            nodes = int(match["nodes"]) if match["nodes"] else 1
            return cls(hardware=hardware, num_nodes=nodes, devices_per_node=int(match["per"]))
        if hw_name not in HARDWARE:
            raise ValueError(f"unknown hardware {hw_name!r} in cluster {spec!r}; known: {', '.join(HARDWARE)}")
        nodes = int(match["nodes"]) if match["nodes"] else 1
        return cls(hardware=HARDWARE[hw_name], num_nodes=nodes, devices_per_node=int(match["per"]))


def load_hardware(path: str | Path) -> Hardware:
    """A Hardware profile from JSON: a bare profile, or `autopar calibrate --out`'s file
    (whose "hardware" key holds it)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read hardware profile {str(path)!r}: {exc}; write one with "
                         "`autopar calibrate --out profile.json`") from exc
    return Hardware.from_json(data["hardware"] if isinstance(data, dict) and "hardware" in data else data)
