"""The intra-op ILP's solver backend: a `Milp` solved by HiGHS directly and by CBC through
PuLP, the LP relaxation first, its cutoff, and the statuses the ILP reads."""

from __future__ import annotations

import pulp
import pytest

from solver.intra_op.backend import CutoffExceeded, Milp, _highs_lp, solve, solve_ilp


def _knapsack() -> tuple[Milp, list[int]]:
    """max 5a + 4b + 3c s.t. 2a + 3b + c <= 4 (as a minimisation), binaries: the LP optimum
    takes a fraction of b (-(5 + 3 + 4/3)), the ILP's is a = c = 1 (-8)."""
    m = Milp()
    cols = [m.add_binary(name) for name in ("x_a", "x_b", "x_c")]
    m.add_row(zip(cols, (2.0, 3.0, 1.0)), None, 4.0, "capacity")
    m.cost.update({cols[0]: -5.0, cols[1]: -4.0, cols[2]: -3.0})
    return m, cols


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_branch_and_bound_after_a_fractional_relaxation(solver: str) -> None:
    m, cols = _knapsack()
    solved = solve(m, cols, solver, time_limit_s=None)
    assert solved.sol_status == pulp.LpSolutionOptimal
    assert [solved.value(c) for c in cols] == pytest.approx([1.0, 0.0, 1.0])
    assert m.objective(solved.values) == pytest.approx(-8.0)


def test_a_relaxation_bound_at_the_cutoff_skips_branching() -> None:
    m, cols = _knapsack()
    with pytest.raises(CutoffExceeded) as err:
        solve(m, cols, "highs", time_limit_s=None, cutoff_s=-9.5e-6)  # the objective is in microseconds
    assert err.value.lower_bound_s == pytest.approx(-(8 + 4 / 3) / 1e6)
    assert solve(m, cols, "highs", time_limit_s=None, cutoff_s=-9.0e-6).sol_status == pulp.LpSolutionOptimal


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_infeasible_rows_are_reported_infeasible(solver: str) -> None:
    m = Milp()
    x = m.add_binary("x_0_0")
    m.add_row([(x, 1.0)], 2.0, None, "impossible")
    m.cost[x] = 1.0
    assert solve(m, [x], solver, time_limit_s=None).status == pulp.LpStatusInfeasible
    assert solve_ilp(m, solver, None).sol_status == pulp.LpSolutionInfeasible


def test_rows_sum_repeated_columns_and_drop_zeros() -> None:
    m = Milp()
    a, b, c = (m.add_col(n, 0.0, None) for n in ("a", "b", "c"))
    m.add_row([(a, 1.0), (b, 0.0), (a, 2.0), (c, -1.0)], 0.0, 0.0, "r")
    assert (m.row_start, m.row_cols, m.row_coefs) == ([0, 2], [a, c], [3.0, -1.0])


def test_columns_reach_highs_in_pulps_order() -> None:
    """HiGHS gets the columns in the order PuLP gave them (sorted by PuLP's name), so the
    model, and with it every plan, is the one the PuLP-built problem had."""
    names = ["x_10_0", "x_2_0", "e_1_2_0_0", "y_layer 3_fwd_0_torch.bfloat16", "sync_hidden", "y_-1/2"]
    m, prob = Milp(), pulp.LpProblem("p", pulp.LpMinimize)
    for name in names:
        col = m.add_col(name, 0.0, None)
        m.cost[col] = 1.0
    prob += pulp.lpSum(prob.add_variable(name, lowBound=0) for name in names)
    _lp, pos = _highs_lp(m, integral=False)
    assert [names[i] for i in sorted(range(len(names)), key=lambda i: pos[i])] == \
        [names[[n.translate(str.maketrans("-+[] ->/", "________")) for n in names].index(v.name)]
         for v in prob.variables()]
