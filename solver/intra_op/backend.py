"""Running the intra-op ILP's solver: HiGHS (default, through highspy) or CBC (through PuLP).

Where it sits: under solver/intra_op/ilp.py, which builds the problem (a `Milp`: columns
and sparse rows, no solver objects) and reads its solution; this module only solves it.
HiGHS gets the whole problem in one `passModel` call, as column-wise arrays: building it
as PuLP variables and expressions, which PuLP then hands to HiGHS a column and a row at
a time (twice: the LP relaxation and the ILP), cost the deepseek-v3-like search on 2,048
H100s 76-79 s here against 66-69 s without (side by side, same plans). CBC, the cross-check, still goes through PuLP. This module owns what the solvers
need to behave the same on every run and every machine: one thread, a fixed seed, proven
optimality (REL_GAP), the objective's unit (OBJECTIVE_SCALE), and native solver output
kept off stdout, where `autopar search --json` writes its result. The LP relaxation is
solved first (`solve`): when it is integral, or proves the caller's cutoff, branch and
bound is skipped.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import highspy
import numpy as np
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


def _cbc_solver(time_limit_s: float | None) -> pulp.LpSolver:
    """CBC through PuLP: a cbc on PATH, else PuLP's bundled one (COIN_CMD: PULP_CBC_CMD is
    deprecated in PuLP 3.3)."""
    path = shutil.which("cbc") or pulp.apis.coin_api.pulp_cbc_path
    return pulp.COIN_CMD(path=path, msg=False, threads=1, timeLimit=time_limit_s, gapRel=REL_GAP,
                         options=[f"randomSeed {SOLVER_SEED + 1}", f"randomCbcSeed {SOLVER_SEED + 1}"])


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


_PULP_NAME = str.maketrans("-+[] ->/", "________")
"""PuLP's renaming of a variable's name (`LpElement.trans`): the columns' order (`_highs_lp`)."""


@dataclass
class Milp:
    """A minimisation problem as the solvers take it: columns (variables) with bounds and
    integrality, the objective's coefficient per column, and rows `lower <= a.x <= upper`.
    None is an infinite bound. Columns are indices; ilp.py keeps which column is which
    strategy."""

    names: list[str] = field(default_factory=list)
    lower: list[float | None] = field(default_factory=list)
    upper: list[float | None] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    cost: dict[int, float] = field(default_factory=dict)
    row_names: list[str] = field(default_factory=list)
    row_lower: list[float | None] = field(default_factory=list)
    row_upper: list[float | None] = field(default_factory=list)
    row_start: list[int] = field(default_factory=lambda: [0])
    """Row r's nonzeros are entries row_start[r]:row_start[r+1] of row_cols / row_coefs."""
    row_cols: list[int] = field(default_factory=list)
    row_coefs: list[float] = field(default_factory=list)

    def add_col(self, name: str, lower: float | None = 0.0, upper: float | None = None, *,
                integer: bool = False) -> int:
        self.names.append(name)
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(integer)
        return len(self.names) - 1

    def add_binary(self, name: str) -> int:
        return self.add_col(name, 0.0, 1.0, integer=True)

    def add_row(self, terms: Iterable[tuple[int, float]], lower: float | None, upper: float | None,
                name: str) -> None:
        """A row over (column, coefficient) terms; a repeated column's coefficients add up,
        zero coefficients are dropped."""
        coefs: dict[int, float] = {}
        for col, c in terms:
            coefs[col] = coefs.get(col, 0.0) + c
        for col, c in coefs.items():
            if c:
                self.row_cols.append(col)
                self.row_coefs.append(c)
        self.row_start.append(len(self.row_cols))
        self.row_names.append(name)
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    @property
    def num_rows(self) -> int:
        return len(self.row_names)

    def objective(self, values: Sequence[float]) -> float:
        """The objective at `values` (per column), summed in the objective's order."""
        total = 0.0
        for col, c in self.cost.items():
            total += values[col] * c
        return total


@dataclass
class Solved:
    """A solve's outcome: PuLP's problem and solution status constants (pulp.LpStatus*,
    pulp.LpSolution*) and the value of every column (None where the solver returned none;
    `Milp.objective` gives the objective there)."""

    status: int
    sol_status: int
    values: list[float] | None

    def value(self, col: int) -> float:
        return 0.0 if self.values is None else float(self.values[col])


def _highs_status(h: Any) -> tuple[int, int]:
    """(problem status, solution status) of a finished HiGHS run, in PuLP's constants, as
    PuLP's own HiGHS interface maps them (a time or iteration limit without a solution is
    "not solved")."""
    s, status = highspy.HighsModelStatus, h.getModelStatus()
    if status in (s.kTimeLimit, s.kIterationLimit) and h.getObjectiveValue() == float(highspy.kHighsInf):
        return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound
    if status == s.kOptimal:
        return pulp.LpStatusOptimal, pulp.LpSolutionOptimal
    if status in (s.kInfeasible, s.kUnboundedOrInfeasible):
        return pulp.LpStatusInfeasible, pulp.LpSolutionInfeasible
    if status == s.kUnbounded:
        return pulp.LpStatusUnbounded, pulp.LpSolutionUnbounded
    if status in (s.kObjectiveBound, s.kObjectiveTarget, s.kInterrupt, s.kTimeLimit, s.kIterationLimit):
        return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible
    return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound


def _highs_lp(milp: Milp, integral: bool) -> tuple[Any, np.ndarray]:
    """The HiGHS model of `milp` (integrality only where `integral`), and each column's
    position in it. Columns go in the order of their PuLP names, the order PuLP gave
    HiGHS: the same model as before, so the same plans."""
    n = len(milp.names)
    order = sorted(range(n), key=lambda i: milp.names[i].translate(_PULP_NAME))
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    inf = highspy.kHighsInf
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n, milp.num_rows
    cost = np.zeros(n)
    for col, c in milp.cost.items():
        cost[pos[col]] = c
    lp.col_cost_ = cost
    lp.col_lower_ = np.array([-inf if v is None else v for v in milp.lower])[order]
    lp.col_upper_ = np.array([inf if v is None else v for v in milp.upper])[order]
    lp.row_lower_ = np.array([-inf if v is None else v for v in milp.row_lower], dtype=float)
    lp.row_upper_ = np.array([inf if v is None else v for v in milp.row_upper], dtype=float)
    cols = pos[np.asarray(milp.row_cols, dtype=np.int64)]
    rows = np.repeat(np.arange(milp.num_rows), np.diff(np.asarray(milp.row_start)))
    by_col = np.argsort(cols, kind="stable")  # rows ascend within a column
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.concatenate([[0], np.cumsum(np.bincount(cols, minlength=n))]).astype(np.int32)
    lp.a_matrix_.index_ = rows[by_col].astype(np.int32)
    lp.a_matrix_.value_ = np.asarray(milp.row_coefs, dtype=float)[by_col]
    if integral:
        kinds = (highspy.HighsVarType.kContinuous, highspy.HighsVarType.kInteger)
        lp.integrality_ = [kinds[milp.integer[i]] for i in order]
    return lp, pos


def _run_highs(milp: Milp, *, integral: bool, time_limit_s: float | None, **options: Any) -> Solved:
    """One HiGHS run on `milp`: one thread, the fixed seed, no output, proven optimality
    for an ILP (REL_GAP), `options` as HiGHS names them."""
    lp, pos = _highs_lp(milp, integral)
    with native_stdout_to_stderr():
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("threads", 1)
        h.setOptionValue("random_seed", SOLVER_SEED)
        if integral:
            h.setOptionValue("mip_rel_gap", REL_GAP)
        if time_limit_s is not None:
            h.setOptionValue("time_limit", float(time_limit_s))
        for key, value in options.items():
            h.setOptionValue(key, value)
        h.passModel(lp)
        h.run()
    status, sol_status = _highs_status(h)
    values = np.asarray(h.getSolution().col_value)
    return Solved(status, sol_status, values[pos].tolist() if len(values) == len(pos) else None)


def _run_cbc(milp: Milp, time_limit_s: float | None) -> Solved:
    """The ILP through PuLP and CBC (the cross-check solver)."""
    prob = pulp.LpProblem("intra_op", pulp.LpMinimize)
    xs = [prob.add_variable(name, lowBound=lo, upBound=up, cat=pulp.LpInteger if i else pulp.LpContinuous)
          for name, lo, up, i in zip(milp.names, milp.lower, milp.upper, milp.integer)]
    for r, name in enumerate(milp.row_names):
        a, b = milp.row_start[r], milp.row_start[r + 1]
        expr = pulp.LpAffineExpression([(xs[c], v) for c, v in zip(milp.row_cols[a:b], milp.row_coefs[a:b])])
        lo, up = milp.row_lower[r], milp.row_upper[r]
        if lo is not None and lo == up:
            prob += expr == lo, name
        elif lo is None:
            prob += expr <= up, name
        else:
            if up is not None:
                prob += expr <= up, name + "/upper"
            prob += expr >= lo, name
    prob += pulp.LpAffineExpression([(xs[c], v) for c, v in milp.cost.items()])
    with native_stdout_to_stderr():
        prob.solve(_cbc_solver(time_limit_s))
    return Solved(prob.status, prob.sol_status, [x.varValue or 0.0 for x in xs])


def solve_ilp(milp: Milp, solver: str, time_limit_s: float | None) -> Solved:
    """`milp` with its integer columns integral, by `solver` (SOLVERS)."""
    if solver == "highs":
        return _run_highs(milp, integral=True, time_limit_s=time_limit_s)
    if solver == "cbc":
        return _run_cbc(milp, time_limit_s)
    raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")


def solve(milp: Milp, choices: Sequence[int], solver: str, time_limit_s: float | None,
          cutoff_s: float | None = None) -> Solved:
    """Solve `milp`, whose 0/1 columns `choices` say which strategy each node takes.

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
        relaxed = _run_highs(milp, integral=False, time_limit_s=simplex_s, presolve="off")
        if relaxed.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionInfeasible):
            log.info("LP relaxation: simplex stopped after %.2f s (%s); interior point",
                     time.perf_counter() - start, pulp.LpStatus[relaxed.status])
            left = None if time_limit_s is None else max(1.0, time_limit_s - (time.perf_counter() - start))
            relaxed = _run_highs(milp, integral=False, time_limit_s=left, solver="ipm")
        fractional = sum(1 for c in choices if abs(relaxed.value(c) - round(relaxed.value(c))) > INTEGRALITY_TOL)
        log.info("LP relaxation: %s in %.2f s, %d fractional choice variables",
                 pulp.LpStatus[relaxed.status], time.perf_counter() - start, fractional)
        if relaxed.sol_status == pulp.LpSolutionOptimal and not fractional:
            return relaxed
        if relaxed.status == pulp.LpStatusInfeasible:
            return relaxed  # no relaxed plan fits, so no integral one does
        if cutoff_s is not None and relaxed.sol_status == pulp.LpSolutionOptimal:
            # i14s: the tie-break terms (1e-10 s per collective) are far below this margin
            bound_s = milp.objective(relaxed.values) / OBJECTIVE_SCALE
            if bound_s >= cutoff_s * (1 + 1e-6):
                raise CutoffExceeded(bound_s, cutoff_s)
        if time_limit_s is not None:
            time_limit_s = max(1.0, time_limit_s - (time.perf_counter() - start))
    return solve_ilp(milp, solver, time_limit_s)
