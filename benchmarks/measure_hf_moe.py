"""Hugging Face mixtures of experts on 4 gloo ranks: the search's plan beside expert parallelism.

    .venv/bin/python benchmarks/measure_hf_moe.py [--rounds 3] [--steps 4]
        [--out benchmarks/results/hf_moe]

For a Mixtral and a Qwen2-MoE built from configs (8 routed experts, top-2; Qwen2-MoE with
its gated shared expert), on `cpu:4`:
  S  the plan `autopar search` returns (`autopar.api.search_plans`, its first plan), and
  E  ep2 x dp2: mesh (dp 2, tp 2), micro-batch 4 (2 per step), every grouped matmul of the experts held to its
     expert-parallel strategy over tp (autopar/placing.py `place_experts_split`: each rank
     its 4 experts' rows of its tp pair's tokens, the partial outputs all-reduced over tp),
     the rest as the ILP places it, the batch split over dp.
Both train in the same 4 ranks, in rounds (S then E, the order reversed every other
round), --steps steps each per round; a program's step time is the median of its steps
after the first of each round, and the ratio E / S is the median over rounds of the
rounds' ratios (the machine has 2 shared cores: only side-by-side ratios are stable).
tokens/s = global batch x seq / step time. The first round's losses of S and E must
agree (same model, seed and data): both train like one process.

It answers whether the search's choice on this mesh (the experts whole) is faster in
fact, as `autopar explain` says the ILP priced it, and writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB, SEQ, BATCH = 1024, 64, 16
MODELS = {"mixtral": "benchmarks.measure_hf_moe:mixtral", "qwen2-moe": "benchmarks.measure_hf_moe:qwen2_moe"}


def _tokens() -> tuple[Any, Any]:
    import torch

    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return ids, ids


def mixtral() -> tuple[Any, tuple[Any, Any]]:
    """Mixtral, 2 layers, hidden 256, 8 experts of width 512, top-2."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from tests.hf_factories import LossOf

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                        num_local_experts=8, num_experts_per_tok=2, attention_dropout=0.0)
    return LossOf(MixtralForCausalLM(cfg)), _tokens()


def qwen2_moe() -> tuple[Any, tuple[Any, Any]]:
    """Qwen2-MoE, 2 layers, hidden 256, 8 routed experts of width 256, top-2, a shared expert of 512."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from tests.hf_factories import LossOf

    cfg = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                         shared_expert_intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=SEQ, num_experts=8, num_experts_per_tok=2,
                         attention_dropout=0.0, decoder_sparse_step=1, mlp_only_layers=[])
    return LossOf(Qwen2MoeForCausalLM(cfg)), _tokens()


def _worker(rank: int, jobs: tuple[Any, ...]) -> list[Any]:
    from autopar.build import train_worker

    return [train_worker(rank, job)[0] for job in jobs]


def _jobs(name: str, steps: int) -> tuple[dict[str, Any], dict[str, str]]:
    """The two placed jobs of one model ({"S": ..., "E": ...}) and their labels."""
    from autopar.api import search_plans
    from autopar.config import ParallelConfig
    from autopar.explain import describe_config
    from autopar.placing import place_experts_split, place_job
    from autopar.runtime.jobs import TrainJob

    result = search_plans(MODELS[name], "cpu:4")
    best = result.plan
    searched = place_job(TrainJob(model=MODELS[name], configs=(best.config,), steps=steps, global_batch=BATCH,
                                  plans=(best.dumps(),)))
    ep = place_experts_split(TrainJob(model=MODELS[name], configs=(ParallelConfig(dp=2, tp=2, micro_batch=4),),
                                      steps=steps, global_batch=BATCH))
    return {"S": searched, "E": ep}, {"S": f"search's #1: {describe_config(best.config, best.stage_layers, BATCH)}", "E": "ep2 x dp2 (experts over tp)"}


def measure(name: str, rounds: int, steps: int) -> dict[str, Any]:
    from autopar.runtime.launch import spawn

    jobs, labels = _jobs(name, steps)
    order = [("S", "E") if r % 2 == 0 else ("E", "S") for r in range(rounds)]
    flat = tuple(jobs[k] for pair in order for k in pair)
    start = time.perf_counter()
    results = spawn(_worker, 4, (flat,))[0]
    per_round: list[dict[str, Any]] = []
    for r, pair in enumerate(order):
        per_round.append({k: results[2 * r + i] for i, k in enumerate(pair)})
    step = {k: statistics.median(statistics.median(rr[k].step_times_s[1:]) for rr in per_round) for k in "SE"}
    ratio = statistics.median(statistics.median(rr["E"].step_times_s[1:]) / statistics.median(rr["S"].step_times_s[1:])
                              for rr in per_round)
    losses = {k: per_round[0][k].losses for k in "SE"}
    return {"model": name, "labels": labels, "step_s": step, "tokens_per_s": {k: BATCH * SEQ / v for k, v in step.items()},
            "ratio_e_over_s": ratio, "losses": losses, "losses_agree": _agree(losses["S"], losses["E"]),
            "wall_s": time.perf_counter() - start}


def _agree(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-4 * abs(y) for x, y in zip(a, b))


def _markdown(rows: list[dict[str, Any]], argv: list[str]) -> str:
    lines = ["# Hugging Face MoE on 4 gloo ranks: the search's plan beside expert parallelism", "",
             f"Generated by `{' '.join(['python benchmarks/measure_hf_moe.py', *argv])}` (see the script's docstring).", "",
             "| model | program | step ms | tokens/s | E / S step time (median of rounds) | losses agree |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        for k in "SE":
            lines.append(f"| {row['model']} | {k}: {row['labels'][k]} | {1e3 * row['step_s'][k]:.1f} | "
                         f"{row['tokens_per_s'][k]:,.0f} | {row['ratio_e_over_s']:.2f} | "
                         f"{'yes' if row['losses_agree'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hf_moe"))
    args = parser.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        row = measure(name, args.rounds, args.steps)
        print(f"{name}: S {row['labels']['S']} {row['tokens_per_s']['S']:,.0f} tokens/s, E {row['labels']['E']} "
              f"{row['tokens_per_s']['E']:,.0f} tokens/s, E/S step {row['ratio_e_over_s']:.2f}, "
              f"losses agree: {row['losses_agree']} ({row['wall_s']:.0f} s)", flush=True)
        rows.append(row)
    Path(args.out + ".json").write_text(json.dumps(rows, indent=2, default=str) + "\n")
    Path(args.out + ".md").write_text(_markdown(rows, sys.argv[1:] if argv is None else argv))
    return 0 if all(r["losses_agree"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
