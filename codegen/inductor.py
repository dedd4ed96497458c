"""Inductor on the per-rank graphs: what `--compile` (`ParallelConfig.compiled`) runs.

Where it sits: codegen, after `apply` (codegen/apply.py) has made a rank's graphs and
before the runtime calls them. Every graph the runtime calls (the one-stage `step`,
`grad_sync` and `param_gather`; a pipeline chunk's forward and backward) is an FX graph
of ATen ops and `_c10d_functional` collectives with static shapes, which is what
Inductor compiles: `compile_graph(gm, label)` makes `gm(*args)` run Inductor's code for
the graph (`torch._inductor.compile_fx.compile_fx`: AOTAutograd's functionalisation and
decompositions, then Inductor's fusion and its C++ (CPU) or Triton (GPU) kernels).
Collectives stay functional collectives in the compiled code, so Inductor schedules
them and reuses their buffers (its reinplacing pass turns the functional all-reduce
into the in-place one; codegen/collectives.py `GradSync(functional=True)` emits the functional form, since
AOTAutograd cannot functionalise the in-place custom op the eager program uses).

The graph is compiled at its first call, on that call's tensors (their strides and
dtypes, which a compile from the slots' metadata could only guess), inside
`torch.no_grad()` (the program's graphs compute gradients themselves: autograd never
sees them). The same graph and tensors give the same code on every call: the shapes
are the plan's, fixed.

Compile cache: Inductor's FX-graph and kernel caches live under
`TORCHINDUCTOR_CACHE_DIR`; where the user has not set it, `cache_dir()` puts it in
`$XDG_CACHE_HOME/autopar/inductor` (default `~/.cache/autopar/inductor`), which outlives
`/tmp` (Inductor's own default) so a rerun of the same plan compiles from the cache.

Priced: a compiled program's memory-bound ops and view calls are charged
`Efficiency.compiled_memory_factor` of their eager time (cost_model/table.py,
`Graph.compiled`): Inductor fuses chains of pointwise and reduction ops into one kernel
(one read and one write instead of one per op), and views become pointer arithmetic in
its generated code. GEMMs and attention run the same library kernels either way.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import fx


def cache_dir() -> str:
    """Where Inductor's persistent caches live (module docstring); sets
    TORCHINDUCTOR_CACHE_DIR where it is unset, before the first compile reads it."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current:
        return current
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = base / "autopar" / "inductor"
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return str(path)


class CompileError(ValueError):
    """Inductor failed on one of the program's graphs: what failed, and that the eager
    program runs the same plan (a ValueError: a setting to change, exit 2 on the CLI)."""


class CompileTimes:
    """Seconds spent compiling each graph of one program ({label: seconds}), filled as the
    graphs are first called (the first step, and `param_gather` at the build)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


def _boxed(gm: fx.GraphModule) -> bool:
    return type(gm.graph._codegen).__name__ == "_BoxedCodeGen"


def compile_graph(gm: fx.GraphModule, label: str, times: CompileTimes) -> None:
    """Make calls of `gm` run Inductor's code for it, compiled at the first call (module
    docstring); `gm.graph` and `gm.code` stay the eager graph (what `.code` prints and the
    collective counts read). A boxed graph (called with one list, which it empties) keeps
    its calling convention: the list is cleared at the call, its tensors then held until
    the compiled graph returns (the eager boxed graph frees each as it goes)."""
    from torch._inductor.compile_fx import compile_fx  # lazy: torch._inductor, only with --compile

    cache_dir()
    boxed = _boxed(gm)
    if boxed:  # compile the plain graph; the wrapper below keeps the boxed call
        gm.graph.set_codegen(fx.graph.CodeGen())
        gm.recompile()
    compiled: list[Callable[..., Any]] = []

    def run(*args: Any) -> Any:
        if boxed:
            (given,) = args
            args = tuple(given)
            given.clear()
        with torch.no_grad():
            if not compiled:
                start = time.perf_counter()
                del gm.forward  # Inductor traces the graph's own forward
                try:
                    compiled.append(compile_fx(gm, list(args)))
                except Exception as exc:  # no C++ compiler, an unsupported op, ...
                    raise CompileError(
                        f"Inductor could not compile this rank's {label} graph ({type(exc).__name__}: "
                        f"{str(exc).strip().splitlines()[0][:300] if str(exc).strip() else 'no message'}); "
                        "run without --compile (compiled=False): the eager program runs the same plan") from exc
                finally:
                    gm.forward = run
                times.seconds[label] = times.seconds.get(label, 0.0) + time.perf_counter() - start
            return compiled[0](*args)

    gm.forward = run  # instance attribute: nn.Module.__call__ finds it before the class's


def compile_graphs(graphs: dict[str, fx.GraphModule | None], times: CompileTimes) -> None:
    """`compile_graph` on each of `graphs` ({label: graph}; None entries skipped)."""
    for label, gm in graphs.items():
        if gm is not None:
            compile_graph(gm, label, times)


__all__ = ["CompileError", "CompileTimes", "cache_dir", "compile_graph", "compile_graphs"]
