"""autopar: automatic parallelism for PyTorch training.

Flow (DESIGN.md): trace -> Graph -> strategies -> costs -> solve -> Plan -> emit -> run.
"""

from autopar.cluster import HARDWARE, Cluster, Hardware
from autopar.config import ParallelConfig
from autopar.ir import Graph, Node, NodeId, Role, Phase
from autopar.trace import TraceError, lower, trace, trace_model

__all__ = [
    "HARDWARE",
    "Cluster",
    "Graph",
    "Hardware",
    "Node",
    "NodeId",
    "ParallelConfig",
    "Phase",
    "Role",
    "TraceError",
    "lower",
    "trace",
    "trace_model",
]
