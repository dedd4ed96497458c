"""The CLI's surface, frozen: every `autopar` subcommand and each one's flags.

Where it sits: a guard over autopar/cli.py (DESIGN.md "Contracts", CLI). The surface is read
from the argparse parser itself (`build_parser()`), not from help text, and compared with
the literal table below. A new, renamed or removed flag, a changed choice set, default or
required-ness fails this test: update EXPECTED_SURFACE on purpose, together with
docs/cli.md (tests/unit/test_docs.py checks that it names exactly the parser's flags).

How a flag is written in the table:
    MODEL                         a positional (its metavar)
    --json                        a switch (takes no value)
    --seq VALUE                   takes a value
    --zero {0,1,2,3}              takes one of these values
    ... (required)                must be given
    ... (repeatable)              may be given several times (action="append")
    ... (default X)               when omitted, X (None and False defaults are not written)
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from autopar.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[2]

# The price/train configuration flags (autopar/cli.py add_config_flags); in `price` and
# `train` none of them is required.
CONFIG_FLAGS = (
    "--tp VALUE",
    "--pp VALUE",
    "--dp VALUE",
    "--zero {0,1,2,3}",
    "--ep VALUE",
    "--micro-batch VALUE",
    "--schedule {gpipe,1f1b,interleaved,zb}",
    "--interleave VALUE",
    "--recompute {none,selective,full}",
    "--attention {flash,math}",
    "--precision {fp32,bf16-mixed,bf16}",
    "--reduce-dtype {float32,bfloat16}",
    "--compile",
)

# "autopar" is the top-level parser (flags before the subcommand).
EXPECTED_SURFACE: dict[str, tuple[str, ...]] = {
    "autopar": ("-v/--verbose",),
    "trace": (
        "MODEL",
        "--seq VALUE",
        "--global-batch VALUE (default 1)",
        "--dtype {float32,bfloat16} (default bfloat16)",
        "--json",
    ),
    "price": (
        "MODEL",
        "--plan VALUE",
        "--cluster VALUE",
        "--global-batch VALUE",
        "--seq VALUE",
        "--memory-gb VALUE",
        *CONFIG_FLAGS,
        "--hardware VALUE",
        "--json",
    ),
    "search": (
        "MODEL",
        "--cluster VALUE (required)",
        "--global-batch VALUE (required)",
        "--seq VALUE",
        "--memory-gb VALUE",
        "--top VALUE (default 5)",
        "--json",
        "--out VALUE",
        "--emit VALUE",
        "--time-limit VALUE",
        "--min-pp VALUE (default 1)",
        "--max-pp VALUE",
        "--precision {fp32,bf16-mixed,bf16}",
        "--reduce-dtype {float32,bfloat16}",
    "--compile",
    ),
    "explain": (
        "PLAN_JSON",
        "--plot VALUE",
        "--json",
    ),
    "train": (
        "MODEL",
        "--devices VALUE (required)",
        "--steps VALUE (default 3)",
        "--global-batch VALUE",
        "--seq VALUE",
        "--plan VALUE",
        *CONFIG_FLAGS,
        "--check",
        "--json",
        "--checkpoint-dir VALUE",
        "--save-every VALUE",
        "--resume",
        "--resume-if-exists",
        "--lr VALUE (default 0.001)",
    ),
    "calibrate": (
        "--devices VALUE (default 2)",
        "--repeats VALUE (default 1)",
        "--out VALUE",
        "--json",
        "--refit VALUE",
    ),
}


def _describe(action: argparse.Action) -> str:
    """One flag of the surface as the module docstring writes it."""
    if not action.option_strings:
        return action.metavar or action.dest
    text = "/".join(action.option_strings)
    if action.nargs != 0:  # store_true/store_false/count take no value
        text += (" {" + ",".join(str(c) for c in action.choices) + "}") if action.choices else " VALUE"
    if action.required:
        text += " (required)"
    if isinstance(action, argparse._AppendAction):
        text += " (repeatable)"
    if action.default not in (None, False):
        text += f" (default {action.default})"
    return text


def cli_surface(parser: argparse.ArgumentParser) -> dict[str, tuple[str, ...]]:
    """{"autopar": top-level flags, subcommand: its flags}, in the parser's own order."""
    surface: dict[str, tuple[str, ...]] = {}
    top: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                surface[name] = tuple(_describe(a) for a in sub._actions
                                      if not isinstance(a, argparse._HelpAction))
            continue
        top.append(_describe(action))
    return {"autopar": tuple(top), **surface}


def surface_diff(expected: dict[str, tuple[str, ...]], actual: dict[str, tuple[str, ...]]) -> list[str]:
    """What differs, one line per subcommand or flag; empty when the surfaces are equal
    (order included: the order is the help text's)."""
    lines = [f"new subcommand {name!r}: {actual[name]}" for name in actual if name not in expected]
    lines += [f"subcommand {name!r} removed" for name in expected if name not in actual]
    for name in expected.keys() & actual.keys():
        want, got = expected[name], actual[name]
        lines += [f"{name}: new flag {flag!r}" for flag in got if flag not in want]
        lines += [f"{name}: flag {flag!r} removed or changed" for flag in want if flag not in got]
        if set(want) == set(got) and want != got:
            lines.append(f"{name}: flags reordered: {got}")
    return sorted(lines)


def test_cli_surface_is_frozen() -> None:
    diff = surface_diff(EXPECTED_SURFACE, cli_surface(build_parser()))
    assert diff == [], (
        "the CLI surface changed; if on purpose, update EXPECTED_SURFACE in this test and the "
        "docs/cli.md:\n  " + "\n  ".join(diff))


def test_every_subcommand_has_its_module() -> None:
    """cli.main imports autopar.commands.<name> and calls its run(args)."""
    assert tuple(cli_surface(build_parser())) == ("autopar", *COMMANDS)
    for name in COMMANDS:
        source = (ROOT / "autopar" / "commands" / f"{name}.py").read_text()
        assert "\ndef run(args" in source, name


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


def test_guard_reports_a_new_flag() -> None:
    parser = build_parser()
    _subparser(parser, "train").add_argument("--fast", action="store_true")
    assert surface_diff(EXPECTED_SURFACE, cli_surface(parser)) == ["train: new flag '--fast'"]


def test_guard_reports_changed_choices_defaults_and_new_subcommands() -> None:
    parser = build_parser()
    for action in _subparser(parser, "search")._actions:
        if action.dest == "top":
            action.default = 3
    for action in _subparser(parser, "price")._actions:
        if action.dest == "schedule":
            action.choices = ("gpipe", "1f1b")
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    sub.add_parser("serve").add_argument("--port", required=True)
    assert surface_diff(EXPECTED_SURFACE, cli_surface(parser)) == [
        "new subcommand 'serve': ('--port VALUE (required)',)",
        "price: flag '--schedule {gpipe,1f1b,interleaved,zb}' removed or changed",
        "price: new flag '--schedule {gpipe,1f1b}'",
        "search: flag '--top VALUE (default 5)' removed or changed",
        "search: new flag '--top VALUE (default 3)'",
    ]


def test_trace_prints_a_small_model_in_units_that_fit(capsys):
    """A factory model of 10^4-10^5 parameters is not "0.000B parameters", nor its step "0.00 TFLOP"."""
    from autopar import cli, units

    assert cli.main(["trace", "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    head = [out.splitlines()[0], next(line for line in out.splitlines() if line.startswith("joint graph"))]
    assert "0.000B" not in head[0] and "0.00 TFLOP" not in head[1], head
    assert units.count(90_432) + " parameters" == "90.4k parameters"
    assert re.search(r": \d+(\.\d+)?k parameters,", head[0]), head  # 28k
    assert units.count(8.03e9) == "8.03B" and units.count(12) == "12"
    assert units.flops(6.606e7) == "66.1 MFLOP" and units.flops(2.5e15) == "2.5 PFLOP"
    assert " MFLOP per step" in head[1], head
