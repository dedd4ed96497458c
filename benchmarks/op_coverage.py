"""Op coverage of the per-op compiler: how much of each model the ILP can shard.

For the zoo models and Hugging Face architectures built from small configs (no
downloads), trace one training step, enumerate every op's strategies on a 2x2 mesh
(solver/intra_op/space.py: DTensor's registry, the project's rules, decompositions) and
report the share of the step's FLOPs done by ops with a sharded strategy, the number of
distinct ops, and the ops that fell back to replicated (named). Writes
`benchmarks/results/op_coverage.md` and prints the table.

    python benchmarks/op_coverage.py
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tests/hf_factories.py: HF models from configs

MESH = (2, 2)
MODELS = {
    "zoo GPT (gpt-tiny)": "gpt-tiny",
    "zoo Llama (llama-tiny)": "llama-tiny",
    "HF GPT-2": "hf_factories:gpt2",
    "HF Llama": "hf_factories:llama",
    "HF DistilBERT (encoder)": "hf_factories:distilbert",
}


def measure(spec: str) -> dict:
    from autopar.models import resolve
    from autopar.trace import trace_step
    from solver.intra_op.space import coverage, enumerate_strategies

    source = resolve(spec)
    torch.manual_seed(0)
    if source.config is None:
        model, example = source.factory()
    else:
        model = source.build()
        example = source.example_inputs(8)
    start = time.perf_counter()
    _, graph = trace_step(model, example)
    space = enumerate_strategies(graph, MESH)
    ops = {n.op for n in graph.nodes if n.op not in ("placeholder", "getitem", "constant")}
    replicated_only = sorted({n.op for n in graph.nodes if n.op in ops and len(space[n.id]) == 1})
    return {"coverage": coverage(graph, space), "nodes": len(graph), "ops": len(ops),
            "fallback": space.fallback_ops, "replicated_only": replicated_only,
            "seconds": time.perf_counter() - start}


def main() -> int:
    logging.basicConfig(level=logging.ERROR)
    rows = []
    for name, spec in MODELS.items():
        r = measure(spec)
        rows.append((name, r))
        print(f"{name:26s} coverage {r['coverage']:.1%}  {r['ops']} ops  fallback {list(r['fallback'])}  "
              f"({r['seconds']:.1f} s)", flush=True)
    lines = [
        "# Op coverage of the per-op compiler",
        "",
        f"One training step traced per model; strategies enumerated on a {MESH[0]}x{MESH[1]} mesh "
        "(`python benchmarks/op_coverage.py`). Coverage: share of the step's FLOPs in ops with a "
        "sharded strategy. Fallback: ops with no strategy in DTensor's registry, no project rule and "
        "no decomposition (replicated on every device, named in a warning).",
        "",
        "| model | coverage (FLOPs) | distinct ops | graph nodes | fallback to replicate | ops with only the replicated strategy here |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        lines.append(f"| {name} | {r['coverage']:.1%} | {r['ops']} | {r['nodes']} | "
                     f"{', '.join(r['fallback']) or 'none'} | {', '.join(r['replicated_only']) or 'none'} |")
    out = ROOT / "benchmarks" / "results" / "op_coverage.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
