"""autopar: automatic parallelism for PyTorch training.

Flow (DESIGN.md): trace -> Graph -> strategies -> costs -> solve -> Plan -> emit -> run.

    import autopar
    compiled = autopar.compile(model, "cpu:4", example_inputs=(tokens, labels))
    loss = compiled.step((tokens, labels))
"""

from autopar.cluster import HARDWARE, Cluster, Hardware
from autopar.config import ParallelConfig
from autopar.ir import Graph, Node, NodeId, Phase, Role
from autopar.plan import Plan, PlanFileError, model_fingerprint
from autopar.sharding import InfeasiblePlanError, IntraOpSolution
from autopar.trace import TraceError, lower, trace, trace_model

# Loaded on first use: cost_model and the runtime import autopar's submodules, so importing
# them here would make `import cost_model` (before autopar) a cycle.
_LAZY = {
    "Compiled": "autopar.api", "compile": "autopar.api", "search_plan": "autopar.api",
    "Estimate": "autopar.estimate", "price": "cost_model",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")

__all__ = [
    "HARDWARE",
    "Cluster",
    "Compiled",
    "Estimate",
    "Graph",
    "Hardware",
    "InfeasiblePlanError",
    "IntraOpSolution",
    "Node",
    "NodeId",
    "ParallelConfig",
    "Phase",
    "Plan",
    "PlanFileError",
    "Role",
    "TraceError",
    "compile",
    "lower",
    "model_fingerprint",
    "price",
    "search_plan",
    "trace",
    "trace_model",
]
