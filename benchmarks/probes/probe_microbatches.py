"""What one more microbatch costs, measured against its price (a probe, not a test).

The sweep (benchmarks/sweep_cpu.py) runs each configuration at one micro-batch size. This
probe runs configurations given as dp:pp:micro_batch, at the sweep's global batch, so one
(dp, pp) shape can be timed at several microbatch counts m = global batch / (dp x
micro_batch) side by side. It uses the sweep's protocol: the same spawned gloo ranks, random
round order, minimum and median over rounds, and the reference workload's load factor. Each
configuration is priced as the sweep prices it, by the calibrated profile given and the
built-in one. The step to step difference between two microbatch counts of one shape is the
marginal cost of the extra microbatches; measured over priced says whether the price of a
microbatch's work (its GEMMs at fewer rows, its ops, its pipeline sends) keeps up.

    .venv/bin/python benchmarks/probes/probe_microbatches.py --size M --world 8 \\
        --configs 2:4:1,2:4:2,4:2:1,4:2:2,4:2:4 [--profile benchmarks/results/cpu_profile.json] [--rounds 11]

What its runs found: a configuration's step time depends on what ran before it in the round,
which is why benchmarks/sweep_cpu.py runs its rounds in a random order.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import sweep_cpu  # noqa: E402


def parse_configs(ap: argparse.ArgumentParser, text: str, world: int) -> list[Any]:
    """dp:pp:micro_batch entries as sweep cases on `world` processes; a malformed entry, one
    that does not fill the world, or one whose micro-batch does not divide the global batch
    ends the probe with the parser's exit 2, before any rank starts."""
    from autopar.config import ParallelConfig

    out = []
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        parts = entry.split(":")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            ap.error(f"--configs: {entry!r} is not dp:pp:micro_batch with positive integers (e.g. 4:2:2)")
        dp, pp, mb = map(int, parts)
        if dp * pp != world:
            ap.error(f"--configs: {entry!r} uses dp x pp = {dp * pp} processes, the probe runs {world} (--world)")
        if sweep_cpu.GLOBAL_BATCH % (dp * mb):
            ap.error(f"--configs: {entry!r}: dp x micro_batch = {dp * mb} does not divide the global batch "
                     f"{sweep_cpu.GLOBAL_BATCH}")
        out.append(sweep_cpu.SweepCase(label=f"dp{dp} pp{pp} mb{mb}", world=world,
                                       config=ParallelConfig(dp=dp, pp=pp, micro_batch=mb)))
    if not out:
        ap.error("--configs: give at least one dp:pp:micro_batch entry")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(sweep_cpu.SIZES), default="M")
    ap.add_argument("--world", type=int, choices=(4, 8), default=8)
    ap.add_argument("--configs", required=True, help="comma-separated dp:pp:micro_batch entries")
    ap.add_argument("--profile", default=str(ROOT / "benchmarks" / "results" / "cpu_profile.json"),
                    help="calibrated profile to price with beside the built-in one")
    ap.add_argument("--rounds", type=int, default=sweep_cpu.TIMED_ROUNDS)
    ap.add_argument("--warmup", type=int, default=sweep_cpu.WARMUP_ROUNDS)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        ap.error(f"--rounds must be at least 1 and --warmup at least 0, got {args.rounds} and {args.warmup}")
    if not Path(args.profile).is_file():
        ap.error(f"--profile: no such file {args.profile}; make one with `autopar calibrate --devices 4 --out FILE`")
    cases = parse_configs(ap, args.configs, args.world)

    import autopar  # noqa: F401  (autopar before cost_model: import order)
    from autopar.cluster import HARDWARE, load_hardware

    spec = sweep_cpu.SIZES[args.size]
    got = sweep_cpu.measure(spec, cases, warmup=args.warmup, timed=args.rounds)
    profile, calibrated = sweep_cpu._profile(spec), load_hardware(args.profile)
    print(f"{args.size} x {args.world}, global batch {sweep_cpu.GLOBAL_BATCH}, {args.rounds} rounds in random order")
    print(f"{'configuration':<16} {'m':>3} {'min ms':>8} {'median':>8} {'priced':>8} {'built-in':>9} {'min / priced':>13}")
    for case in cases:
        priced = sweep_cpu.predictions(profile, spec, case, HARDWARE["cpu"], calibrated,
                                       reference_s=got["reference_s"], reference_ranks=got["reference_ranks"])
        times = got["times"][case.label]
        m = sweep_cpu.GLOBAL_BATCH // (case.config.dp * case.config.micro_batch)
        print(f"{case.label:<16} {m:>3} {min(times) * 1e3:8.1f} {statistics.median(times) * 1e3:8.1f} "
              f"{priced['predicted_calibrated_s'] * 1e3:8.1f} {priced['predicted_default_s'] * 1e3:9.1f} "
              f"{min(times) / priced['predicted_calibrated_s']:13.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
