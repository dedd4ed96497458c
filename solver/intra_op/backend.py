"""Running the intra-op ILP's solver: HiGHS (default) or CBC through PuLP.

Where it sits: under solver/intra_op/ilp.py, which builds the problem and reads its
solution; this module only solves it. It owns what the solvers need to behave the same on
every run and every machine: one thread, a fixed seed, proven optimality (REL_GAP), the
objective's unit (OBJECTIVE_SCALE), and native solver output kept off stdout, where
`autopar search --json` writes its result. The LP relaxation is solved first (`solve`):
when it is integral, or proves the caller's cutoff, branch and bound is skipped.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import sys
import time
from typing import Any, Sequence

import pulp

def _release_import_frames(package: Any) -> int:
    """Drop the tracebacks of the exceptions `package`'s modules keep from their import.

    PuLP probes optional solvers when it is imported and keeps each failure as a class
    attribute (`COPT_DLL.err`, `CPLEX_PY.err`) to show when that solver is asked for. A
    traceback holds its frames, and every frame its caller (`f_back`): the whole stack of
    the first `import pulp` stays alive for the process's life. That import happens lazily
    inside the first solve, so a pipeline rank that solved its chunk kept its build's
    locals (the user's model, the split pipeline: about two copies of the weights) after
    the build returned. The messages stay; only the frames go. Returns how many were cut."""
    cut = 0
    prefix = package.__name__ + "."
    for name, module in list(sys.modules.items()):
        if module is None or not (name == package.__name__ or name.startswith(prefix)):
            continue
        for value in list(vars(module).values()):
            holders = [value] if isinstance(value, BaseException) else \
                [v for v in vars(value).values() if isinstance(v, BaseException)] if isinstance(value, type) else []
            for exc in holders:
                if exc.__traceback__ is not None:
                    exc.__traceback__ = None
                    cut += 1
    return cut


_release_import_frames(pulp)


log = logging.getLogger(__name__)

OBJECTIVE_SCALE = 1e6
"""The ILP objective is in microseconds: second-sized coefficients (1e-9..1) sit below
the solvers' default tolerances."""

LP_SIMPLEX_TIME_S = 3.0
"""The LP relaxation's simplex gets this long before the interior point takes over
(`solve`): every relaxation of the 70B / 405B searches that the simplex finishes takes
under 0.5 s here, the ones it struggles on run 30 s or more."""

SOLVER_SEED = 0
REL_GAP = 1e-9
"""Solve to proven optimality (default MIP gaps of 1e-4 would let the oracle tests drift)."""

SOLVERS = ("highs", "cbc")

INTEGRALITY_TOL = 1e-6
"""An LP-relaxation value this close to 0 or 1 counts as integral."""


class CutoffExceeded(Exception):
    """The LP relaxation proved the ILP's objective (per microbatch) at least the caller's
    `cutoff_s` (solve_intra_op): branch and bound was skipped. The whole-plan search prunes
    with it: a candidate whose bound already loses to the plans found so far is not solved
    exactly."""

    def __init__(self, lower_bound_s: float, cutoff_s: float) -> None:
        super().__init__(f"LP relaxation bound {lower_bound_s:.6g} s >= cutoff {cutoff_s:.6g} s")
        self.lower_bound_s = lower_bound_s
        self.cutoff_s = cutoff_s


def make_solver(solver: str, time_limit_s: float | None, *, msg: bool = False) -> pulp.LpSolver:
    if solver == "highs":
        return pulp.HiGHS(msg=msg, threads=1, timeLimit=time_limit_s, gapRel=REL_GAP, random_seed=SOLVER_SEED)
    if solver == "cbc":
        # COIN_CMD (PULP_CBC_CMD is deprecated in PuLP 3.3): a cbc on PATH, else PuLP's bundled one
        path = shutil.which("cbc") or pulp.apis.coin_api.pulp_cbc_path
        return pulp.COIN_CMD(path=path, msg=msg, threads=1, timeLimit=time_limit_s, gapRel=REL_GAP,
                             options=[f"randomSeed {SOLVER_SEED + 1}", f"randomCbcSeed {SOLVER_SEED + 1}"])
    raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")


_BANNER_SILENCED = False


def _silence_highs_banner() -> None:
    """HiGHS >= 1.16 prints a two-line banner on stdout from the first C++ `Highs` object a
    process makes, whatever `output_flag` says (PuLP sets it after construction), and
    never again. That first object is made here, once, with fd 1 on /dev/null, so the
    user sees only autopar's own lines."""
    global _BANNER_SILENCED
    if _BANNER_SILENCED:
        return
    _BANNER_SILENCED = True
    try:
        import highspy  # lazy: HiGHS (optional here), only when the ILP solves
    except ImportError:  # PuLP's HiGHS needs it; the solve reports that itself
        return
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    try:
        highspy.Highs()
    finally:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).fflush(None)
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


@contextlib.contextmanager
def native_stdout_to_stderr() -> Any:
    """Native writes to stdout (fd 1) go to stderr meanwhile, HiGHS's banner nowhere
    (_silence_highs_banner): solver output would corrupt `autopar search --json` and plan
    files written to stdout. C stdio buffers stdout when it is a pipe, so it is flushed
    before fd 1 returns."""
    _silence_highs_banner()
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


def solve(prob: pulp.LpProblem, choices: Sequence[pulp.LpVariable], solver: str, time_limit_s: float | None,
          cutoff_s: float | None = None) -> int:
    """Solve `prob`, whose 0/1 `choices` say which strategy each node takes, returning PuLP's
    solution status.

    HiGHS first solves the LP relaxation: the Alpa-style edge rows make it tight, and on
    the zoo models its optimum is usually integral, which proves it optimal for the ILP
    without MIP presolve and heuristics (about half the time on llama3-8b). Otherwise
    (or with CBC) the ILP is solved with branch and bound, unless the relaxation's
    objective (a lower bound of the ILP's) already reaches `cutoff_s`: CutoffExceeded.
    The relaxation runs the dual simplex without HiGHS's presolve, for at most
    LP_SIMPLEX_TIME_S, then HiGHS's interior point (with crossover: a vertex, so an
    integral optimum is still recognised). Why: on memory-bound instances (a 70B step whose
    activations barely miss the budget) presolve ran 30 s and gave up ("not solved") and
    the simplex without it took 31 s on some, where the interior point proves
    infeasibility in about 1 s; on the other instances the simplex without presolve is
    the fastest (0.2-0.3 s on llama3-70b's vs 0.4-0.7 s with presolve, 1.1-1.4 s interior
    point). The relaxation's optimum is the same either way."""
    start = time.perf_counter()
    if solver == "highs":
        simplex_s = LP_SIMPLEX_TIME_S if time_limit_s is None else min(LP_SIMPLEX_TIME_S, time_limit_s)
        with native_stdout_to_stderr():
            prob.solve(pulp.HiGHS(mip=False, msg=False, threads=1, timeLimit=simplex_s,
                                        random_seed=SOLVER_SEED, presolve="off"))
        if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionInfeasible):
            log.info("LP relaxation: simplex stopped after %.2f s (%s); interior point",
                     time.perf_counter() - start, pulp.LpStatus[prob.status])
            left = None if time_limit_s is None else max(1.0, time_limit_s - (time.perf_counter() - start))
            with native_stdout_to_stderr():
                prob.solve(pulp.HiGHS(mip=False, msg=False, threads=1, timeLimit=left,
                                            random_seed=SOLVER_SEED, solver="ipm"))
        fractional = sum(1 for v in choices
                         if abs((v.varValue or 0.0) - round(v.varValue or 0.0)) > INTEGRALITY_TOL)
        log.info("LP relaxation: %s in %.2f s, %d fractional choice variables",
                 pulp.LpStatus[prob.status], time.perf_counter() - start, fractional)
        if prob.sol_status == pulp.LpSolutionOptimal and not fractional:
            return pulp.LpSolutionOptimal
        if prob.status == pulp.LpStatusInfeasible:
            return pulp.LpSolutionInfeasible  # no relaxed plan fits, so no integral one does
        if cutoff_s is not None and prob.sol_status == pulp.LpSolutionOptimal:
            # i14s: the tie-break terms (1e-10 s per collective) are far below this margin
            bound_s = (pulp.value(prob.objective) or 0.0) / OBJECTIVE_SCALE
            if bound_s >= cutoff_s * (1 + 1e-6):
                raise CutoffExceeded(bound_s, cutoff_s)
        if time_limit_s is not None:
            time_limit_s = max(1.0, time_limit_s - (time.perf_counter() - start))
    with native_stdout_to_stderr():
        prob.solve(make_solver(solver, time_limit_s))
    return prob.sol_status
