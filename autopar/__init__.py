"""autopar: automatic parallelism for PyTorch training.

Flow (DESIGN.md): trace -> Graph -> strategies -> costs -> solve -> Plan -> emit -> run.

    import autopar
    compiled = autopar.compile(model, "cpu:4", example_inputs=(tokens, labels))
    loss = compiled.step((tokens, labels))
"""

from autopar.api import Compiled, compile, price, search_plan
from autopar.cluster import HARDWARE, Cluster, Hardware
from autopar.config import ParallelConfig
from autopar.estimate import Estimate
from autopar.ir import Graph, Node, NodeId, Phase, Role
from autopar.plan import Plan, PlanFileError, model_fingerprint
from autopar.sharding import InfeasiblePlanError, IntraOpSolution
from autopar.trace import TraceError, lower, trace, trace_model

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
