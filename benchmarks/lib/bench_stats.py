"""Statistics shared by the benchmark scripts (measure_cpu.py, sweep_cpu.py,
validate_cost_model.py, validate_one_model.py): one home for the rank correlation and
percentiles their reports quote, and their row selection."""

from __future__ import annotations

import statistics


def ranks(values: list[float]) -> list[float]:
    """0-based ranks, ties sharing the average of their positions."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties); nan for fewer than 2 points or
    when either side is constant."""
    if len(xs) < 2:
        return float("nan")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else float("nan")


def percentile(values: list[float], q: float) -> float:
    """The value at rank round(q (n - 1)) of the sorted values (nearest rank)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(round(q * (len(ordered) - 1)))))]


def row_filter(text: str | None) -> set[int] | None:
    """`--rows 10-15,22` -> {10, ..., 15, 22}; None for every row."""
    if not text:
        return None
    wanted: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        wanted.update(range(int(lo), int(hi or lo) + 1))
    return wanted
