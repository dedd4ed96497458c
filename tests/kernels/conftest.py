"""Triton tests: import triton in interpreter mode before anything else imports it.

Triton decides at decoration time whether a `@triton.jit` function is interpreted, and its
own library functions (`tl.sum`, ...) are decorated when `import triton` runs; so
TRITON_INTERPRET=1 must be set before the first `import triton` in the process (tracing
and torch.compile import triton as a side effect). This conftest is loaded at collection,
before any test runs. The variable is restored right after, so other tests see the
environment they expect; the `triton_interpret` fixture sets it per test, which is what
makes `codegen.kernels.ops` pick the Triton path on CPU tensors.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Iterator

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _import_interpreted() -> str:
    """'' when triton kernels run in the interpreter here, else why they cannot."""
    if not HAS_TRITON:
        return "triton is not installed"
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        import codegen.kernels.triton_kernels  # noqa: F401  (decorate our kernels now)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    if not isinstance(tl.standard.sum, InterpretedFunction):
        return ("triton was imported before TRITON_INTERPRET=1 was set in this process; run "
                "tests/kernels in its own pytest process (pytest tests/kernels)")
    return ""


INTERPRETER_UNAVAILABLE = _import_interpreted()


@pytest.fixture
def triton_interpret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if INTERPRETER_UNAVAILABLE:
        pytest.skip(INTERPRETER_UNAVAILABLE)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
