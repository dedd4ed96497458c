"""Does the intra-op ILP price expert parallelism below sharding the experts FSDP-style?

    .venv/bin/python benchmarks/probes/probe_expert_placement.py [--spec moe:...] [--cluster h100:2x8]
        [--dp 16] [--zero 3] [--micro-batch 1] [--global-batch 64]

`autopar price` has no expert-parallel degree: the routed experts' weights [E, d, f] are
placed by the ILP like any tensor. This probe solves one one-stage configuration twice on
the same traced graph (solver/forced.py `solve_one_stage`, what `autopar price` solves):
free, and with every routed-expert weight (`*.moe.w1`, `w2`, `w3`) restricted to
strategies whose compute placement is Shard(0) over dp (expert parallelism over the
data-parallel ranks), and prints each solution's objective by term and the experts'
placement, the largest ops' shares of the priced compute, and the first MoE layer's
forward batched matmuls with the layouts their
inputs arrive in. Equal objectives mean the ILP sees no gain in expert parallelism: the
placement `benchmarks/validate_moe.py` reports is then a tie-break, and the expert matmuls
show what runs (experts gathered to Replicate and the token slots split, or the experts
split on E with the tokens moved to them). A third solve also restricts the expert matmuls
to operands split on E (expert parallelism as Megatron-Core and DeepEP run it over the
data-parallel ranks) and prints why no plan exists: moving the token slots from their
batch split to the expert dim is an all-to-all on the data-parallel axis, which
solver/intra_op/restrict.py `prune_gather_free` (and the ILP's edges) forbid there.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

DEFAULT_SPEC = ("moe:layers=4,hidden=2048,heads=16,vocab=32000,seq=2048,experts=128,top_k=8,expert_ffn=2048,"
                "shared_experts=0,group_tokens=512,capacity_factor=1.0")


def _is_routed_expert(name: str | None) -> bool:
    return bool(name) and ".moe.w" in name and ".shared." not in name


def solve_both(args: argparse.Namespace) -> None:
    from autopar.api import LAYERS_TRACED
    from autopar.cluster import Cluster
    from autopar.config import ParallelConfig
    from autopar.ir import Phase, Role
    from autopar.models import resolve
    from autopar.sharding import InfeasiblePlanError
    from autopar.trace import trace_model, with_precision
    from solver.forced import mesh_shape, solve_one_stage
    from solver.intra_op.space import enumerate_strategies

    config = ParallelConfig(tp=1, pp=1, dp=args.dp, zero=args.zero, micro_batch=args.micro_batch,
                            precision="bf16-mixed")
    cluster = Cluster.parse(args.cluster)
    policy = config.resolved(cluster.hardware.name).policy()
    batch = config.micro_batch * config.dp
    steps = args.global_batch // batch
    graph = with_precision(trace_model(resolve(args.spec), batch=batch, dtype=policy.compute,
                                       layers_traced=LAYERS_TRACED), policy)
    space = enumerate_strategies(graph, mesh_shape(config))
    strategies = list(space.strategies)
    for node in graph:
        if node.role is Role.PARAMETER and _is_routed_expert(node.param_name):
            strategies[node.id] = tuple(s for s in strategies[node.id] if str(s.outputs[0][0]) == "S(0)")
    forced_space = replace(space, strategies=tuple(strategies))
    num_experts = next(n.output.shape[0] for n in graph if n.role is Role.PARAMETER and _is_routed_expert(n.param_name))
    for node in graph:  # the expert matmuls: both operands [E, ., .], split on E
        if node.op == "aten.bmm.default" and all(graph[i].output.shape[0] == num_experts for i in node.inputs):
            strategies[node.id] = tuple(s for s in strategies[node.id] if all(str(p[0]) == "S(0)" for p in s.inputs))
    ep_space = replace(space, strategies=tuple(strategies))
    try:
        solve_one_stage(graph, config, cluster, num_microbatches=steps, space=ep_space)
        print("expert matmuls split on E over dp: a plan exists")
    except InfeasiblePlanError as exc:
        print(f"expert matmuls split on E over dp: no plan ({str(exc).split(': ', 1)[1][:240]}...)")
    for tag, chosen_space in (("free", None), ("experts Shard(0) over dp", forced_space)):
        solution = solve_one_stage(graph, config, cluster, num_microbatches=steps, space=chosen_space)
        placement = next(([str(p) for p in c.outputs[0]] for c in solution.choices
                          if graph[c.node].role is Role.PARAMETER and _is_routed_expert(graph[c.node].param_name)), None)
        cost = solution.cost
        print(f"{tag}: objective {cost.total_s:.4f} s (compute {cost.compute_s:.4f}, reshard {cost.reshard_s:.4f}); "
              f"routed experts {placement}; status {solution.status}")
        by_op: dict[str, float] = {}
        for c in solution.choices:
            if graph[c.node].role is not Role.PARAMETER:
                by_op[graph[c.node].op] = by_op.get(graph[c.node].op, 0.0) + c.weight * c.compute_s
        total = sum(by_op.values())
        print("  compute by op: " + ", ".join(f"{op.removeprefix('aten.')} {t / total:.0%}" for op, t in
                                              sorted(by_op.items(), key=lambda kv: -kv[1])[:6]))
        for c in solution.choices:  # the first MoE layer's forward batched matmuls: dispatch, experts, combine
            node = graph[c.node]
            if node.op == "aten.bmm.default" and node.phase is Phase.FORWARD and node.module_path.endswith("0.moe"):
                shapes = " x ".join(str(tuple(graph[i].output.shape)) for i in node.inputs)
                layouts = " x ".join("(" + ", ".join(map(str, p)) + ")" for p in c.inputs)
                print(f"  {node.name} {shapes}: inputs {layouts}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default=DEFAULT_SPEC)
    parser.add_argument("--cluster", default="h100:2x8")
    parser.add_argument("--dp", type=int, default=16)
    parser.add_argument("--zero", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=64)
    solve_both(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
