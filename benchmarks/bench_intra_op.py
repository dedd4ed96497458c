"""Intra-op ILP solve time on large models (layer-group sharing keeps the ILP one layer big).

Run: .venv/bin/python benchmarks/bench_intra_op.py
Prints, per case, trace time, solve time (strategies + pricing + ILP; wall, and CPU time
of this process, which HiGHS with threads=1 runs in: the steadier figure on a shared
machine), ILP size and the predicted step time. Targets on the 2-core dev machine: llama3-8b on 8x8 < 10 s, llama3-70b < 20 s.
"""

from __future__ import annotations

import time

from autopar.cluster import Cluster
from autopar.models import resolve
from autopar.trace import trace_model
from solver.intra_op.ilp import solve_intra_op

CASES = (
    ("llama3-8b", 64, "h100:8x8", (8, 8)),
    ("llama3-70b", 64, "h100:8x8", (8, 8)),
)


def main() -> None:
    for name, batch, cluster_spec, mesh in CASES:
        start = time.perf_counter()
        graph = trace_model(resolve(name), batch=batch, dtype="bfloat16", layers_traced=2)
        traced = time.perf_counter()
        cpu_start = time.process_time()
        sol = solve_intra_op(graph, Cluster.parse(cluster_spec), mesh)
        cpu_s = time.process_time() - cpu_start
        print(f"{name:<12} layers={graph.model.num_layers:<3} mesh={mesh} nodes={len(graph)} "
              f"trace={traced - start:.2f}s solve={sol.solve_time_s:.2f}s solve_cpu={cpu_s:.2f}s vars={sol.num_variables} "
              f"rows={sol.num_constraints} status={sol.status} step={sol.cost.total_s * 1e3:.1f}ms "
              f"peak_mem={sol.cost.peak_memory_bytes / 2**30:.1f}GiB")


if __name__ == "__main__":
    main()
