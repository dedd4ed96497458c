"""The documentation's checkable promises: a short README, links that resolve, and a CLI
reference (docs/cli.md) that names exactly the flags the argparse parser has.

Where it sits: a guard over README.md and docs/*.md. Fast: it reads files and builds the
parser (`autopar.cli.build_parser()`); no ranks, no traces, no searches.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from autopar.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
CLI_DOC = ROOT / "docs" / "cli.md"
README_MAX_LINES = 250

# [text](target) and ![alt](target); the target ends at the first space or ")" (a title may follow)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-z])(?![\w-])")


def _links(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))  # code blocks hold no links
    return _LINK.findall(text)


def _is_relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) and not target.startswith(("#", "//"))


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it <= {README_MAX_LINES} (move detail to docs/)"


def test_docs_exist() -> None:
    names = {p.name for p in DOCS}
    for page in ("getting-started.md", "concepts.md", "cli.md", "python-api.md", "plan-format.md", "search.md",
                 "cost-model.md", "troubleshooting.md", "benchmarks.md", "architecture.md"):
        assert page in names, f"docs/{page} is missing"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    broken = []
    for target in _links(path):
        if not _is_relative(target):
            continue
        file = target.split("#", 1)[0].split("?", 1)[0]
        if not file:
            continue
        if not (path.parent / file).resolve().exists():
            broken.append(target)
    assert broken == [], f"{path.relative_to(ROOT)}: links to missing files: {broken}"


def test_link_pattern_sees_links() -> None:
    """The checker is a real measurement: it finds links of both kinds and skips code blocks."""
    sample = ROOT / "README.md"
    assert any(_is_relative(t) for t in _links(sample)), "README.md links nowhere into the repository"
    text = "see [a](docs/a.md#x) and ![p](b.png \"t\") and [w](https://x.org)\n```\n[c](no.md)\n```\n"
    assert _LINK.findall(_FENCE.sub("", text)) == ["docs/a.md#x", "b.png", "https://x.org"]


def parser_flags(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """{"autopar": top-level option strings, subcommand: its option strings}, read from the
    parser's actions (as tests/unit/test_cli_surface.py reads its surface); --help excluded."""
    surface: dict[str, set[str]] = {"autopar": set()}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                surface[name] = {s for a in sub._actions if not isinstance(a, argparse._HelpAction)
                                 for s in a.option_strings}
            continue
        surface["autopar"].update(action.option_strings)
    return surface


def documented_flags(text: str) -> dict[str, set[str]]:
    """The flags docs/cli.md names, per section: a `## autopar NAME` heading starts a
    subcommand's section (`## Global options` the top-level one); flags are read from the
    whole section, code blocks included."""
    sections: dict[str, set[str]] = {}
    current = None
    for line in text.splitlines():
        heading = re.match(r"^##\s+(.*)$", line)
        if heading:
            title = heading.group(1).strip().strip("`")
            sub = re.match(r"^autopar\s+([a-z]+)", title)
            current = sub.group(1) if sub else ("autopar" if title.lower().startswith("global") else None)
            if current is not None:
                sections.setdefault(current, set())
            continue
        if current is not None:
            sections[current].update(f for f in _FLAG.findall(line) if f not in ("--help", "-h"))
    return sections


def test_cli_doc_names_exactly_the_parser_flags() -> None:
    actual = parser_flags(build_parser())
    documented = documented_flags(CLI_DOC.read_text(encoding="utf-8"))
    assert set(documented) == set(actual), (
        f"docs/cli.md sections {sorted(documented)} but the parser has {sorted(actual)}")
    problems = []
    for name in sorted(actual):
        missing = sorted(actual[name] - documented[name])
        extra = sorted(documented[name] - actual[name])
        if missing:
            problems.append(f"{name}: the parser has {missing}, docs/cli.md does not name them")
        if extra:
            problems.append(f"{name}: docs/cli.md names {extra}, which the parser lacks")
    assert problems == [], "\n".join(problems)


def test_cli_doc_checker_sees_a_difference() -> None:
    """A flag added to the parser, or one documented but absent, is reported."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    sub.choices["train"].add_argument("--fast", action="store_true")
    actual = parser_flags(parser)
    documented = documented_flags("## Global options\n`-v`\n## autopar train\n`--steps` and `--slow`\n")
    assert "--fast" in actual["train"] - documented["train"]
    assert documented["train"] - actual["train"] == {"--slow"}
