"""`autopar search --emit DIR`: a plan's per-rank program written as Python source, as it runs.

Where it sits: the per-rank build (autopar/build/), behind the wiring (autopar/commands/search.py).
A one-stage plan's per-op placements are applied to its traced step (`emit_per_op`), a
pipeline plan's chunks are built as every rank builds them (autopar/build/pipeline.py
`stage_sources`, handed in with the chunks' placements by the wiring), both on a `fake`
process group (codegen/emit.py `fake_world`): nothing runs and nothing is communicated. The
search records per-op placements in every one-stage plan (solver/spmd_search.py
`spmd_plan`); a one-stage plan without them has no program to show (the hand-written
template's source is a baseline, benchmarks/baselines/template/emit.py). The model is
resolved from the plan's model string here, so codegen/ neither resolves nor traces models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.cluster import Cluster
from autopar.models import resolve
from autopar.plan import Plan
from autopar.trace import trace_step
from codegen.apply import apply
from codegen.prefetch import prefetch_program
from codegen.emit import fake_world, write


def emit_plan(plan: Plan, directory: str | Path, *, max_parameters: float = 2e9,
              stage_sources: Callable[..., dict[str, str]] | None = None) -> list[Path]:
    """`autopar search --emit DIR`: write the per-rank program of a saved plan, as it runs.

    pp = 1: the plan's per-op placements applied to the traced step (`emit_per_op`).
    pp > 1: every chunk's per-rank forward/backward graphs, from
    `stage_sources(plan, model, example_inputs, mesh)` (autopar/build/pipeline.py
    `stage_sources` with the chunks' placements, handed in by the wiring,
    autopar/commands/search.py, which solves them for a plan that records none: the build
    never solves), on a `fake` (dp, tp) world. The model is rebuilt from the plan's model
    string with real weights (the pipeline cut runs one forward), so this is for models up
    to `max_parameters`; the source of a large model's stage has the same shape as that of
    a shallower spec."""
    if plan.config.pp == 1 and plan.placements:
        return write(emit_per_op(plan), directory)
    if plan.config.pp == 1:
        raise ValueError(f"this one-stage plan of {plan.model!r} records no per-op placements, so it names no "
                         "program to emit; search again (`autopar search ... --emit DIR`: the search records them "
                         "in every one-stage plan)")
    if stage_sources is None:
        raise ValueError("emitting a pipeline plan needs the per-rank build's stage builder: pass "
                         "stage_sources= as `autopar search --emit` does (autopar/commands/search.py `_emit`)")

    source = resolve(plan.model).with_overrides(seq=plan.seq if resolve(plan.model).config is not None else None)
    if source.config is None:
        model, example = source.factory()
    else:
        _check_size(plan.model, source, max_parameters, "autopar.build.emit.emit_plan")
        torch.manual_seed(0)
        model, example = source.build(), source.example_inputs(plan.global_batch)
    with fake_world((plan.config.dp, plan.config.tp), ("dp", "tp")) as mesh:
        sources = stage_sources(plan, model, example, mesh)
    return write(sources, directory)


def _check_size(name: str, source: Any, max_parameters: float, function: str) -> None:
    """Refuse to build `source` with real weights when it has more than `max_parameters`
    (counted on fake tensors, so nothing is allocated): `--emit` builds the model to trace it."""
    with FakeTensorMode():
        num_parameters = sum(p.numel() for p in source.build().parameters())
    if num_parameters > max_parameters:
        raise ValueError(
            f"--emit builds {name!r} with real weights ({num_parameters / 1e9:.1f}B parameters, "
            f"limit {max_parameters / 1e9:.0f}B); emit a spec with fewer layers and the same widths "
            f"to read the per-stage program, or call {function} from Python on a machine with the "
            "memory")


def emit_per_op(plan: Plan) -> dict[str, str]:
    """The per-rank program of a one-stage plan, as rank 0 runs it: the model traced on
    fake tensors at the plan's microbatch, the plan's per-op placements applied on a
    `fake` process group of the plan's world (nothing runs, nothing is communicated)."""
    source = resolve(plan.model).with_overrides(seq=plan.seq if resolve(plan.model).config is not None else None)
    rows = plan.config.dp * plan.config.micro_batch
    # traced in the plan's compute dtype (the search's): the node keys its placements are stored under hash it
    policy = plan.config.policy(Cluster.parse(plan.cluster).hardware.name)
    if source.config is None:
        model, example = source.factory()
        micro = [t[:rows] if isinstance(t, torch.Tensor) and t.dim() else t for t in example]
    else:
        with FakeTensorMode():  # built as the ranks build it; trace_step casts its parameters
            model = source.build(layers=min(source.config.layers, 2))
            micro = list(source.example_inputs(rows))
    traced, graph = trace_step(model, micro, recompute=plan.config.recompute, precision=policy)
    choices = plan.placements_for(graph)
    with fake_world((plan.config.dp, plan.config.tp), ("dp", "tp")) as mesh:
        graphs = apply(traced.gm, graph, choices, mesh)
        prefetch_program(graphs)
    note = ("" if source.config is None or source.config.layers <= 2 else
            f"# (the model's first 2 of {source.config.layers} layers: every further layer repeats the second's ops)\n")
    return {"rank0": note + graphs.source}
