"""The `autopar` command line: trace, price, search, explain, train (DESIGN.md, "CLI").

Where it sits: with autopar/api.py, the only place that wires stages together. This file
owns the flags (so the surface is in one place and a test can freeze it); each command's
body lives in autopar/commands/<name>.py as `run(args) -> exit code`. Bad flags exit 2
(argparse), and so does any ValueError a command raises: the message is printed, no
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Sequence

from autopar.config import SCHEDULES
from autopar.precision import POLICIES, REDUCE_DTYPES

COMMANDS = ("trace", "price", "search", "explain", "train", "calibrate")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def add_config_flags(p: argparse.ArgumentParser, *, required: bool) -> None:
    """The configuration flags shared by `price` and `train` (ParallelConfig fields)."""
    p.add_argument("--tp", type=_positive_int, default=None, required=required, help="tensor-parallel degree")
    p.add_argument("--pp", type=_positive_int, default=None, required=required, help="pipeline-parallel degree")
    p.add_argument("--dp", type=_positive_int, default=None, help="data-parallel degree (default devices/(tp*pp))")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None, required=required,
                   help="ZeRO stage: 0 data parallel; 1/2 weights whole, update sharded over dp; 3 FSDP")
    p.add_argument("--ep", type=_positive_int, default=None,
                   help="expert parallelism: 1, or --dp to store the routed experts split over the data-parallel "
                        "ranks (each computes its own; tokens travel by all-to-all)")
    p.add_argument("--micro-batch", type=_positive_int, default=None, required=required,
                   help="sequences per microbatch per data-parallel rank")
    p.add_argument("--schedule", choices=SCHEDULES, default=None)
    p.add_argument("--interleave", type=_positive_int, default=None, help="model chunks per pipeline rank")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default=None)
    p.add_argument("--attention", choices=("flash", "math"), default=None)
    add_precision_flags(p)


def add_precision_flags(p: argparse.ArgumentParser) -> None:
    """The precision policy flags (autopar/precision.py) and `--compile` (codegen/inductor.py),
    shared by `search`, `price` and `train`: what the program runs, so what it is priced as."""
    p.add_argument("--precision", choices=POLICIES, default=None,
                   help="precision policy: fp32; bf16-mixed (bf16 compute, fp32 master weights, optimizer state "
                        "and gradient reduction); bf16 (all bf16). Default: fp32 on the cpu profile, else bf16-mixed")
    p.add_argument("--reduce-dtype", choices=REDUCE_DTYPES, default=None,
                   help="dtype gradients are accumulated and reduced in (default float32)")
    p.add_argument("--compile", action="store_true",
                   help="the per-rank graphs run through Inductor (torch.compile's compiler: fused kernels), priced "
                        "so; compiled in the first step, cached under ~/.cache/autopar/inductor")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar", description="Automatic parallelism for PyTorch training: trace, price, search, train."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log one line per phase")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("trace", help="trace a model's training step and summarise its graph")
    p.add_argument("model", metavar="MODEL", help="preset, spec string or package.module:function")
    p.add_argument("--seq", type=_positive_int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--global-batch", type=_positive_int, default=1, help="sequences per step (default 1)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                   help="parameter/activation dtype of the trace (default bfloat16)")
    p.add_argument("--json", action="store_true", help="print JSON for programs")

    p = sub.add_parser("price", help="predict step time and memory of one parallel configuration, as the search "
                                     "prices it")
    p.add_argument("model", metavar="MODEL", nargs="?", default=None)
    p.add_argument("--plan", default=None, metavar="PLAN_JSON",
                   help="price a saved plan (its model, cluster, configuration and stage cuts) instead")
    p.add_argument("--cluster", default=None, help="HW:NODESxDEVICES, e.g. h100:16x8 (required without --plan)")
    p.add_argument("--global-batch", type=_positive_int, default=None, help="required without --plan")
    p.add_argument("--seq", type=_positive_int, default=None)
    p.add_argument("--memory-gb", type=_positive_float, default=None, help="per-device memory budget")
    add_config_flags(p, required=False)
    p.add_argument("--hardware", default=None, help="a hardware profile JSON (autopar calibrate --out) to price "
                   "against instead of the built-in profile of the cluster's name")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("search", help="search the best parallel plan for a model on a cluster")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--cluster", required=True)
    p.add_argument("--global-batch", type=_positive_int, required=True)
    p.add_argument("--seq", type=_positive_int, default=None)
    p.add_argument("--memory-gb", type=_positive_float, default=None)
    p.add_argument("--top", type=_positive_int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None, help="write the best plan to this JSON file")
    p.add_argument("--emit", default=None, help="write the per-stage sharded program source here")
    p.add_argument("--time-limit", type=_positive_float, default=None, help="solver time limit, seconds")
    p.add_argument("--min-pp", type=_positive_int, default=1,
                   help="rank only plans with at least this many pipeline stages (2: pipelines only)")
    p.add_argument("--max-pp", type=_positive_int, default=None,
                   help="rank only plans with at most this many pipeline stages (1: one-stage plans only)")
    add_precision_flags(p)

    p = sub.add_parser("explain", help="explain a saved plan")
    p.add_argument("plan", metavar="PLAN_JSON")
    p.add_argument("--plot", default=None, help="write a schedule/memory plot (PNG) here")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("train", help="train a model with a plan on local gloo processes or under torchrun")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--devices", type=_positive_int, required=True)
    p.add_argument("--steps", type=_positive_int, default=3)
    p.add_argument("--global-batch", type=_positive_int, default=None)
    p.add_argument("--seq", type=_positive_int, default=None)
    p.add_argument("--plan", default=None, help="a plan.json from `autopar search --out`")
    add_config_flags(p, required=False)
    p.add_argument("--check", action="store_true", help="also run the single-process reference")
    p.add_argument("--json", action="store_true")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--save-every", type=_positive_int, default=None)
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir (exit 2 if there is none)")
    p.add_argument("--resume-if-exists", action="store_true",
                   help="as --resume when a checkpoint exists, else train from step 1 (a job that may be restarted)")
    p.add_argument("--lr", type=_positive_float, default=1e-3)

    p = sub.add_parser("calibrate", help="measure this machine's GEMM and gloo rates for the cpu profile")
    p.add_argument("--devices", type=_positive_int, default=2)
    p.add_argument("--repeats", type=_positive_int, default=1,
                   help="run the measurement R times and keep each figure's median (a shared machine)")
    p.add_argument("--out", default=None, help="write the calibrated profile (JSON) here")
    p.add_argument("--json", action="store_true")
    p.add_argument("--refit", default=None, metavar="PROFILE",
                   help="measure nothing: derive the profile again from the measurements kept in PROFILE "
                        "(an earlier --out file), with this version's fits")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    try:
        module = importlib.import_module(f"autopar.commands.{args.command}")
    except ModuleNotFoundError as exc:
        if exc.name != f"autopar.commands.{args.command}":
            raise
        print(f"autopar {args.command}: not available in this version", file=sys.stderr)
        return 2
    try:
        return int(module.run(args) or 0)
    except ValueError as exc:  # user errors: say what, given, what to try; no traceback
        print(f"autopar {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
