"""Size limits of the product code: no file over MAX_FILE_LINES, no function over MAX_FUNCTION_LINES.

Where it sits: a guard over autopar/, cost_model/, solver/ and codegen/, beside
test_layering.py (which guards their imports). A reader holds a module in their head when
it is small and does one thing, and a function when its steps have names: past the limits,
split a file by responsibility (a stage, a constraint family, the reading of a result) and
a function into named steps, never into a grab-bag module.

A function's length is its whole definition (decorators excluded, docstring included), a
nested function counted inside its parent and on its own. KNOWN_LONG_FILES and
KNOWN_LONG_FUNCTIONS list what is over the limits today, each with why; the test fails on
anything over a limit that is not listed and on any entry that is no longer over it, so
the lists only shrink (delete an entry when its file or function is split).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("autopar", "cost_model", "solver", "codegen")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80

# Over the limits today (path relative to the repository root, why). Never add one to make
# a new file or function pass: split it.
KNOWN_LONG_FILES: dict[str, str] = {}
KNOWN_LONG_FUNCTIONS: dict[tuple[str, str], str] = {}


def file_lines(source: str) -> int:
    return len(source.splitlines())


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function or method of `source` longer than `limit`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > limit:
                out.append((node.name, node.lineno, length))
    return sorted(out, key=lambda f: f[1])


def product_files() -> dict[str, str]:
    return {path.relative_to(ROOT).as_posix(): path.read_text()
            for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def over_limits(files: dict[str, str]) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """({path: lines} of files over MAX_FILE_LINES, {(path, function): lines} of functions
    over MAX_FUNCTION_LINES)."""
    long_files = {path: file_lines(src) for path, src in files.items() if file_lines(src) > MAX_FILE_LINES}
    long_funcs: dict[tuple[str, str], int] = {}
    for path, src in files.items():
        for name, _line, length in long_functions(src):
            long_funcs[(path, name)] = max(length, long_funcs.get((path, name), 0))
    return long_files, long_funcs


def test_no_long_files_or_functions() -> None:
    long_files, long_funcs = over_limits(product_files())
    new_files = {p: n for p, n in long_files.items() if p not in KNOWN_LONG_FILES}
    new_funcs = {k: n for k, n in long_funcs.items() if k not in KNOWN_LONG_FUNCTIONS}
    assert not new_files, f"files over {MAX_FILE_LINES} lines; split them by responsibility: {new_files}"
    assert not new_funcs, f"functions over {MAX_FUNCTION_LINES} lines; split them into named steps: " + \
        ", ".join(f"{path} {name} ({n} lines)" for (path, name), n in sorted(new_funcs.items()))
    stale_files = sorted(set(KNOWN_LONG_FILES) - set(long_files))
    stale_funcs = sorted(set(KNOWN_LONG_FUNCTIONS) - set(long_funcs))
    assert not stale_files and not stale_funcs, \
        f"no longer over the limits; delete them from the known lists: {stale_files + stale_funcs}"


def test_the_checker_can_fail() -> None:
    short = "def f():\n    return 1\n"
    long = "def g():\n" + "    x = 1\n" * MAX_FUNCTION_LINES + "    return x\n"
    nested = "class C:\n    def m(self):\n" + "        y = 2\n" * MAX_FUNCTION_LINES
    assert long_functions(short) == []
    assert long_functions(long) == [("g", 1, MAX_FUNCTION_LINES + 2)]
    assert long_functions(nested) == [("m", 2, MAX_FUNCTION_LINES + 1)]
    files = {"solver/big.py": "x = 1\n" * (MAX_FILE_LINES + 1), "solver/small.py": long}
    assert over_limits(files) == ({"solver/big.py": MAX_FILE_LINES + 1},
                                  {("solver/small.py", "g"): MAX_FUNCTION_LINES + 2})
