"""Units: bytes per element of each dtype, and numbers for people (counts and FLOPs with the
SI prefix that fits their size).

A tiny model has 10^4-10^6 parameters and a large one 10^11, so one fixed unit prints
either "0.000B" or a 12-digit number; these pick the prefix (k, M, B, T for counts: the
machine-learning convention of B for 10^9) and keep three significant digits.
"""

from __future__ import annotations

GIB = 1024**3
"""Bytes in a GiB: memory is printed in GiB everywhere (plans, tables, error messages)."""

DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "complex64": 8,
}
"""Bytes per element of each dtype by torch's name (the IR's tensors, the precision
policy's copies): one table, so every byte count agrees."""

_COUNT = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k"))
_FLOP = ((1e18, "EFLOP"), (1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP"), (1e3, "kFLOP"))


def _scaled(value: float, prefixes: tuple[tuple[float, str], ...], plain: str) -> str:
    for scale, name in prefixes:
        if abs(value) >= scale:
            return f"{value / scale:.3g}{name}"
    return f"{value:.3g}{plain}"


def count(n: float) -> str:
    """83_456 -> "83.5k", 8_030_261_248 -> "8.03B", 12 -> "12"."""
    return _scaled(float(n), _COUNT, "")


def flops(n: float) -> str:
    """2.5e15 -> "2.5 PFLOP", 3.1e7 -> "31 MFLOP" (a space before the unit)."""
    text = _scaled(float(n), _FLOP, "FLOP")
    for i, ch in enumerate(text):
        if ch.isalpha():
            return text[:i] + " " + text[i:]
    return text


__all__ = ["count", "flops"]
