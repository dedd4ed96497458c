"""The one-way flow of ../shared/DESIGN.md, checked on the imports of every module.

Where it sits: a guard over autopar/, cost_model/, solver/ and codegen/ (the product). The flow is

    trace -> Graph -> strategies -> costs -> solve -> Plan -> apply -> run

Graph and Plan (and the other cross-stage types) are shared data that every stage reads;
the stages are functions over them and do not import each other's internals; only the
wiring modules (autopar/api.py, autopar/cli.py, autopar/commands/*, and autopar/placing.py,
which decides the per-op placements before ranks start, and autopar/build/, each rank's
trace -> apply -> program) put stages together. The runtime imports no solver, tracer or
apply (RUNTIME_NEVER_IMPORTS), the build no solver (BUILD_NEVER_IMPORTS). benchmarks/ is
no stage: it measures the product and may import any of it, and no product module imports
benchmarks/ (BASELINES: the template search and rule tables live there, off the execution path).

Every `import` and `from ... import` is read with `ast` (function-local and TYPE_CHECKING
imports included, relative imports resolved, `from pkg import sub` read as the submodule,
and `pkg.sub` attribute use after `import pkg` read as an import of `pkg.sub`). Dynamic
imports by computed name (cli.py's `autopar.commands.<name>`) are not seen. An import of module B by module A is allowed when:
  - A is a wiring module (WIRING); or
  - B is shared (SHARED: the cross-stage types, and facts several stages must agree on);
  - A and B are in the same stage; or
  - (stage(A), stage(B)) is in ALLOWED_EDGES and B is one of that stage's PUBLIC modules.
Otherwise it is a violation: "against the flow" when B's stage comes later in FLOW than
A's, "internals" when the edge is allowed but B is not public, else "no edge" (a module
other than the wiring ones puts two stages together). Shared modules import only shared
modules. A module that no stage claims fails the test too: a new module is placed on
purpose.

Import cycles: the stages import autopar's types, and `autopar/__init__` re-exports the
public API (autopar/api.py), so the API may import the solver and cost model only inside
its functions. `test_each_package_imports_first` imports each stage package first in a
fresh interpreter, which is where such a cycle breaks.

No import cycles at all, module by module (`test_no_import_cycles`): the graph of every
import above (function-level ones too; those under `if TYPE_CHECKING:` never run and are no
edges) has no strongly connected component of more than one
module. A circle that is not a crash today (a function-level import) still ties its modules
into one unit no reader can take apart; KNOWN_CYCLES lists the ones that remain, each with
why, and only shrinks.

KNOWN_VIOLATIONS lists the (importer, imported) pairs that break these rules today, each
with why; the test fails on any violation not in it and on any entry that no longer
occurs, so the list only shrinks (delete an entry when its import goes).

Function-level imports (`test_function_level_imports_give_a_reason`): an import belongs at
module level unless running it later is worth something, and then its line (the first line
of a multi-line import) says what with a `# lazy: <why>` comment. The reasons that hold: a
heavy or optional dependency that one path alone uses (the solver's PuLP and HiGHS, rich,
matplotlib, triton, torch._inductor, aot_autograd, torch.distributed.checkpoint and
.pipelining); keeping `import autopar` and so `autopar --help` light (the API imports the
solver, placing and the per-rank build only inside its functions, as above); keeping what
the rank forkserver preloads (autopar/runtime/launch.py PRELOAD) to what every rank needs;
and an import whose moment is the point (launch.py `import_before_process_group`). Imports
under `if TYPE_CHECKING:` never run and need no reason.

Private names stay in their module (`test_no_private_names_across_modules`): no product
module imports a name starting with one underscore from another project module. What a
second module needs is part of its owner's surface and gets a public name.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("autopar", "cost_model", "solver", "codegen")

# --- the layering, as data ------------------------------------------------------------

# Stages in flow order; a module belongs to the stage with its longest matching prefix
# (a prefix matches the module itself and everything under it).
STAGE_MODULES: dict[str, tuple[str, ...]] = {
    "models": ("autopar.models",),                          # inputs: the model zoo
    "trace": ("autopar.trace", "autopar.recompute"),        # recompute rewrites the traced graph before lower()
    "strategies": ("solver.intra_op.space",),
    "costs": ("cost_model",),
    "solve": ("solver",),
    "apply": ("codegen",),
    "run": ("autopar.runtime", "autopar.determinism", "autopar.preflight"),  # the package: program, spmd,
    # pipe, pipe_spmd, jobs (train loop), launch, checkpoint
    # Outside the flow, reading its data: calibrate measures a Hardware profile for the
    # cost model (spawning ranks as `train` does); plots draws a Plan.
    "tools": ("autopar.calibrate", "autopar.calibrate_rank", "autopar.plots"),
}
FLOW = tuple(STAGE_MODULES)

# Importable by every stage. The cross-stage types (DESIGN: "Shared data types live in
# autopar/", with json_codec, their generic JSON form), and facts that several stages read so
# that they agree by construction: buckets (pricing and the program count the same gradient
# collectives), dtensor_bridge (strategies, reshard prices and the program all come from
# DTensor's registry/planner) and capabilities (what the runtime executes: the search ranks
# only that; the tracer and the runtime read its layer stack and pipeline cut), and grouped_mm
# (the experts' op: the tracer writes it, its rules and FLOPs price it, the program runs it).
SHARED = ("autopar.ir", "autopar.config", "autopar.cluster", "autopar.placement", "autopar.sharding",
          "autopar.plan", "autopar.plan_migrations", "autopar.explain", "autopar.estimate", "autopar.json_codec", "autopar.buckets", "autopar.dtensor_bridge",
          "autopar.capabilities", "autopar.units", "autopar.batch", "autopar.precision", "autopar.grouped_mm")

# May import anything (they are what wires the stages together). `autopar` is the package
# itself: the public surface re-exports (matched exactly, not as a prefix). `placing` decides
# the per-op placements before any rank builds (trace -> solve); `build` is each rank's
# wiring of trace -> apply -> the runtime's programs, and never imports the solver
# (BUILD_NEVER_IMPORTS), so no rank solves.
WIRING = ("autopar.api", "autopar.cli", "autopar.commands", "autopar.placing", "autopar.build")
WIRING_EXACT = ("autopar",)

# What other stages may import of a stage, where an edge allows it (exact module names).
PUBLIC: dict[str, tuple[str, ...]] = {
    "models": ("autopar.models", "autopar.models.zoo"),
    "trace": ("autopar.trace",),
    "strategies": ("solver.intra_op.space",),
    "costs": ("cost_model",),
    "solve": ("solver.pipeline_search", "solver.results", "solver.spmd_search"),
    "apply": ("codegen", "codegen.apply"),
    "run": ("autopar.runtime.launch", "autopar.runtime.jobs"),
    "tools": (),
}

# (importer stage, imported stage): why the importer may call the imported stage's PUBLIC
# modules itself rather than being handed their result by the wiring.
ALLOWED_EDGES: dict[tuple[str, str], str] = {
    ("trace", "models"): "the tracer takes a ModelSource (a preset, spec or factory)",
    ("run", "models"): "each spawned rank builds its model from the job's model name",
    ("solve", "strategies"): "the search enumerates each candidate graph's strategies inside its loop",
    ("solve", "costs"): "the search prices each candidate through cost_model's public functions",
    ("tools", "run"): "calibrate spawns local gloo ranks exactly as `autopar train` does",
}

# Violations as of today: (importer module, imported module, why it is there). Delete an
# entry when its import goes; never add one to make a new import pass.
KNOWN_VIOLATIONS: tuple[tuple[str, str, str], ...] = ()  # none today

# The runtime only launches, steps, syncs and checkpoints the programs the per-rank build
# (autopar/build/) hands it: it never traces, solves or applies. No KNOWN_VIOLATIONS entry
# can excuse one of these imports.
RUNTIME_NEVER_IMPORTS = ("solver", "autopar.trace", "codegen.apply")
# Each rank builds from placements decided before it started (autopar/placing.py): the
# build never solves, nor prices.
BUILD_NEVER_IMPORTS = ("solver", "cost_model")

# Import cycles as of today (the modules of one strongly connected component of the import
# graph, why it is there). A cycle found must lie inside one entry; an entry with no cycle
# inside it is deleted. Never add one to make a new import pass: move what is shared to the
# module that owns it.
KNOWN_CYCLES: tuple[tuple[frozenset[str], str], ...] = ()  # none today

# The baselines (benchmarks/baselines/: the template grid search, the per-family rule tables
# and the module-level template program that applies them, the hand-tuned program, the
# analytic step model) are what the product is compared with, not part of it. DESIGN: no
# rule table on the execution path, so no product module imports benchmarks/ (its imports
# are read like the product's own, so the check below sees them); benchmarks/ may import
# the product, which it measures.
BASELINES = "benchmarks"

# --- the checker ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Import:
    importer: str
    imported: str
    line: int
    type_only: bool = False
    """Under `if TYPE_CHECKING:`: never executed, so it can close no import circle (it
    still counts for the layering: a type is a dependence)."""


@dataclass(frozen=True, slots=True)
class Violation:
    importer: str
    imported: str
    line: int
    why: str


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def group_of(module: str) -> str | None:
    """The module's group: "wiring", "shared", a stage name, or None when nothing claims it."""
    if module in WIRING_EXACT or any(_matches(module, p) for p in WIRING):
        return "wiring"
    if any(_matches(module, p) for p in SHARED):
        return "shared"
    best: tuple[int, str] | None = None
    for stage, prefixes in STAGE_MODULES.items():
        for prefix in prefixes:
            if _matches(module, prefix) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), stage)
    return best[1] if best else None


def type_checking_lines(tree: ast.Module) -> set[int]:
    """The lines of the statements under `if TYPE_CHECKING:` (imports there never run)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


LAZY_REASON = "# lazy:"
"""What starts the reason a function-level import gives, on its (first) line."""


def unexplained_lazy_imports(source: str) -> list[int]:
    """The first lines of the imports inside a function of `source` that give no reason
    (LAZY_REASON on that line); those under `if TYPE_CHECKING:` need none."""
    tree = ast.parse(source)
    lines = source.splitlines()
    type_only = type_checking_lines(tree)
    found: list[int] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                if in_function and child.lineno not in type_only and LAZY_REASON not in lines[child.lineno - 1]:
                    found.append(child.lineno)
            else:
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return sorted(found)


def private_imports(source: str, module: str, *, is_package: bool, modules: frozenset[str]) -> list[str]:
    """`name (line N)` for every private name (one leading underscore, not a dunder) that
    `source`, the text of `module`, imports from another project module, anywhere in it."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            parent = package.split(".")[:len(package.split(".")) - node.level + 1]
            base = ".".join([*parent, *([base] if base else [])])
        if base == module or not (base in modules or any(m.startswith(base + ".") for m in modules)):
            continue
        found += [f"{alias.name} from {base} (line {node.lineno})" for alias in node.names
                  if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def imports_of(source: str, module: str, *, is_package: bool, modules: frozenset[str]) -> list[Import]:
    """The project modules that `source` (the text of `module`) imports, anywhere in it."""
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    found: list[Import] = []
    bound: dict[str, str] = {}  # local name -> project module, from `import pkg [as x]`

    type_only_lines = type_checking_lines(tree)

    def add(name: str, line: int) -> None:
        if name.split(".")[0] in PACKAGES or _matches(name, BASELINES):
            found.append(Import(module, name, line, type_only=line in type_only_lines))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
                if alias.asname:  # `import a.b as x` binds x to a.b; `import a.b` binds a to a
                    bound[alias.asname] = alias.name
                else:
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - (node.level - 1)])
                source_module = f"{base}.{node.module}" if node.module else base
            else:
                source_module = node.module or ""
            for alias in node.names:
                sub = f"{source_module}.{alias.name}"
                add(sub if sub in modules else source_module, node.lineno)
    for node in ast.walk(tree):  # `import cost_model` then `cost_model.table.x`: an import of cost_model.table
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            sub = f"{bound[node.value.id]}.{node.attr}"
            if sub in modules:
                add(sub, node.lineno)
    return found


def check(imports: list[Import]) -> list[Violation]:
    """The imports that break the layering, with why."""
    out: list[Violation] = []
    for imp in imports:
        src, dst = group_of(imp.importer), group_of(imp.imported)
        if src == "wiring" or dst == "shared" or src == dst:
            continue
        if dst is None:
            why = f"{imp.imported} belongs to no stage"
        elif src == "shared":
            why = f"shared module imports {dst} ({imp.imported}); shared types import only shared modules"
        elif dst == "wiring":
            why = f"imports the wiring ({imp.imported}); import from the defining module instead"
        elif (src, dst) in ALLOWED_EDGES:
            if imp.imported in PUBLIC[dst]:
                continue
            why = f"imports {dst}'s internals ({imp.imported}); use {', '.join(PUBLIC[dst]) or 'no module'}"
        elif src in FLOW and dst in FLOW and FLOW.index(dst) > FLOW.index(src):
            why = f"against the flow: {src} imports {dst} ({imp.imported}), which comes after it"
        else:
            why = (f"no edge {src} -> {dst} ({imp.imported}): only api/cli/commands put stages together; "
                   f"pass its result in from the wiring, or add ({src!r}, {dst!r}) to ALLOWED_EDGES on purpose")
        out.append(Violation(imp.importer, imp.imported, imp.line, why))
    return out


def compare_with_known(violations: list[Violation],
                       known: tuple[tuple[str, str, str], ...]) -> tuple[list[Violation], list[tuple[str, str]]]:
    """(violations not in `known`, entries of `known` that no longer occur)."""
    known_pairs = {(importer, imported) for importer, imported, _ in known}
    found_pairs = {(v.importer, v.imported) for v in violations}
    new = [v for v in violations if (v.importer, v.imported) not in known_pairs]
    stale = sorted(known_pairs - found_pairs)
    return new, stale


def project_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def project_imports() -> list[Import]:
    modules = project_modules()
    names = frozenset(modules)
    found: list[Import] = []
    for module, path in modules.items():
        found += imports_of(path.read_text(), module, is_package=path.name == "__init__.py", modules=names)
    return found


def import_cycles(imports: list[Import]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module of the import graph
    (Tarjan's algorithm, iterative), sorted by their smallest module. Imports for type
    checking only are no edges: they never run."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.importer != imp.imported and not imp.type_only:
            graph.setdefault(imp.importer, set()).add(imp.imported)
            graph.setdefault(imp.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return sorted(found, key=min)


def compare_cycles(cycles: list[frozenset[str]], known: tuple[tuple[frozenset[str], str], ...]
                   ) -> tuple[list[frozenset[str]], list[frozenset[str]]]:
    """(cycles that lie inside no `known` entry, `known` entries with no cycle inside them)."""
    new = [c for c in cycles if not any(c <= allowed for allowed, _ in known)]
    stale = [allowed for allowed, _ in known if not any(c <= allowed for c in cycles)]
    return new, stale


# --- the tree as it is ----------------------------------------------------------------


def test_every_module_is_placed() -> None:
    unplaced = [m for m in project_modules() if group_of(m) is None]
    assert unplaced == [], f"add these modules to STAGE_MODULES, SHARED or WIRING: {unplaced}"


def test_layering_data_is_consistent() -> None:
    assert set(PUBLIC) == set(STAGE_MODULES)
    modules = project_modules()
    for stage, public in PUBLIC.items():
        for module in public:
            assert module in modules and group_of(module) == stage, (stage, module)
    for src, dst in ALLOWED_EDGES:
        assert src in STAGE_MODULES and dst in STAGE_MODULES, (src, dst)
    assert len({(a, b) for a, b, _ in KNOWN_VIOLATIONS}) == len(KNOWN_VIOLATIONS), "duplicate entries"


def solver_cost_model_internals(imports: list[Import]) -> list[Import]:
    """The solver's imports of a cost_model submodule. The solver reads every price through
    the `cost_model` package surface (its __init__ re-exports the cost table of
    cost_model/table.py and the formulas); no KNOWN_VIOLATIONS entry can excuse one."""
    return [i for i in imports if group_of(i.importer) == "solve" and _matches(i.imported, "cost_model")
            and i.imported != "cost_model"]


def test_solver_reads_cost_model_only_through_its_surface() -> None:
    found = solver_cost_model_internals(project_imports())
    assert found == [], "solver imports cost_model internals; import the name from `cost_model`:\n  " + \
        "\n  ".join(f"{i.importer} (line {i.line}) -> {i.imported}" for i in found)
    assert any(i.imported == "cost_model" and group_of(i.importer) == "solve" for i in project_imports())


def forbidden_imports(imports: list[Import], importer: str, forbidden: tuple[str, ...]) -> list[Import]:
    """The imports by `importer` (a module or package prefix) of a module under `forbidden`."""
    return [i for i in imports if _matches(i.importer, importer)
            and any(_matches(i.imported, f) for f in forbidden)]


def test_runtime_never_imports_solver_trace_or_apply() -> None:
    found = forbidden_imports(project_imports(), "autopar.runtime", RUNTIME_NEVER_IMPORTS)
    assert found == [], "the runtime runs what the build hands it; it imports none of " \
        f"{RUNTIME_NEVER_IMPORTS}:\n  " + "\n  ".join(f"{i.importer} (line {i.line}) -> {i.imported}" for i in found)


def test_build_never_imports_the_solver() -> None:
    found = forbidden_imports(project_imports(), "autopar.build", BUILD_NEVER_IMPORTS)
    assert found == [], "a rank builds from placements decided before it started (autopar/placing.py); " \
        "the build imports none of " + f"{BUILD_NEVER_IMPORTS}:\n  " + "\n  ".join(
            f"{i.importer} (line {i.line}) -> {i.imported}" for i in found)
    assert any(i.imported == "codegen.apply" for i in project_imports() if _matches(i.importer, "autopar.build"))


def test_forbidden_import_check_fails_on_a_runtime_import() -> None:
    def found(source: str, module: str, importer: str, forbidden: tuple[str, ...]) -> list[tuple[str, str]]:
        imports = imports_of(source, module, is_package=False, modules=MODULES)
        return [(i.importer, i.imported) for i in forbidden_imports(imports, importer, forbidden)]

    assert found("def f():\n    from solver.forced import solve_stage\n", "autopar.runtime.spmd", "autopar.runtime",
                 RUNTIME_NEVER_IMPORTS) == [("autopar.runtime.spmd", "solver.forced")]
    assert found("from autopar.trace import trace_step\n", "autopar.runtime.jobs", "autopar.runtime",
                 RUNTIME_NEVER_IMPORTS) == [("autopar.runtime.jobs", "autopar.trace")]
    assert found("import codegen\n\ndef f(g):\n    return codegen.apply.apply(g)\n", "autopar.runtime.program",
                 "autopar.runtime", RUNTIME_NEVER_IMPORTS) == [("autopar.runtime.program", "codegen.apply")]
    assert found("from codegen.apply import apply\n", "autopar.build.one_stage", "autopar.build",
                 BUILD_NEVER_IMPORTS) == []
    assert found("from solver.spmd_search import op_placements\n", "autopar.build.one_stage", "autopar.build",
                 BUILD_NEVER_IMPORTS) == [("autopar.build.one_stage", "solver.spmd_search")]
    assert found("from solver import forced\n", "autopar.placing", "autopar.build", BUILD_NEVER_IMPORTS) == []


def baseline_imports(imports: list[Import]) -> list[Import]:
    """The imports of a benchmarks/ module (BASELINES) by a product module."""
    return [i for i in imports if _matches(i.imported, BASELINES) and not _matches(i.importer, BASELINES)]


def test_no_product_module_imports_the_baselines() -> None:
    found = baseline_imports(project_imports())
    assert found == [], "the product imports benchmarks/ (the template search, its rule tables and the " \
        "other baselines are what it is compared with, never what it runs):\n  " + "\n  ".join(
            f"{i.importer} (line {i.line}) -> {i.imported}" for i in found)
    template = ("codegen.rules", "codegen.tp", "codegen.stages", "solver.search", "solver.inter_op")
    back = [m for m in project_modules() if any(_matches(m, t) for t in template)]
    assert back == [], f"template modules in the product packages (home: benchmarks/baselines/template/): {back}"


def test_imports_follow_the_flow() -> None:
    new, stale = compare_with_known(check(project_imports()), KNOWN_VIOLATIONS)
    assert new == [], "imports against DESIGN.md's flow:\n  " + "\n  ".join(
        f"{v.importer} (line {v.line}) -> {v.imported}: {v.why}" for v in new)
    assert stale == [], f"these KNOWN_VIOLATIONS no longer occur; delete them from the list: {stale}"


def test_no_import_cycles() -> None:
    new, stale = compare_cycles(import_cycles(project_imports()), KNOWN_CYCLES)
    assert new == [], "import cycles (move what the modules share to the module that owns it):\n  " + \
        "\n  ".join(" <-> ".join(sorted(c)) for c in new)
    assert stale == [], f"these KNOWN_CYCLES no longer occur; delete them from the list: {[sorted(c) for c in stale]}"


def test_function_level_imports_give_a_reason() -> None:
    found = [f"{module} (line {line})" for module, path in project_modules().items()
             for line in unexplained_lazy_imports(path.read_text())]
    assert found == [], f"imports inside functions with no `{LAZY_REASON} <why>` on their line; move them to " \
        "module level, or say why they wait (module docstring):\n  " + "\n  ".join(found)


def test_no_private_names_across_modules() -> None:
    modules = project_modules()
    names = frozenset(modules)
    found = [f"{module}: {hit}" for module, path in modules.items()
             for hit in private_imports(path.read_text(), module, is_package=path.name == "__init__.py", modules=names)]
    assert found == [], "private names imported from another module (give them a public name in their owner, " \
        "module docstring):\n  " + "\n  ".join(found)


def test_private_import_check_fails_on_a_private_name() -> None:
    names = frozenset({"autopar.runtime.pipe", "autopar.runtime.program", "autopar.runtime"})
    source = ("from autopar.runtime.program import _local, StepStats\n"
              "from .pipe import _tie as tie, routed\n"
              "from autopar.runtime import program as _program\n"
              "from typing import _SpecialForm\n"
              "from __future__ import annotations\n")
    assert private_imports(source, "autopar.runtime.pipe_spmd", is_package=False, modules=names) == [
        "_local from autopar.runtime.program (line 1)", "_tie from autopar.runtime.pipe (line 2)"]


def import_error(module: str, root: Path) -> str | None:
    """The last line of the error of `import module` (then `import autopar`, where present)
    in a fresh interpreter whose path starts at `root`; None when it imports."""
    then = "\nimport importlib.util\nif importlib.util.find_spec('autopar'): import autopar"
    proc = subprocess.run([sys.executable, "-c", f"import {module}{then}"], cwd=root, capture_output=True,
                          text=True, timeout=300)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["(no output)"])[-1]


@pytest.mark.parametrize("module", ["cost_model", "solver.pipeline_search", "codegen.apply"])
def test_each_package_imports_first(module: str) -> None:
    """No import cycle: a stage imported before autopar (whose __init__ re-exports the API)."""
    assert import_error(module, ROOT) is None


# --- the checker can fail -------------------------------------------------------------


def test_import_cycle_is_caught(tmp_path) -> None:
    """The cycle autopar <-> cost_model had (a package re-exporting from a later stage that
    imports the package's types): fine when the package is imported first, broken otherwise."""
    (tmp_path / "types_pkg").mkdir()
    (tmp_path / "types_pkg" / "__init__.py").write_text("from cost_pkg import price\n")
    (tmp_path / "types_pkg" / "graph.py").write_text("GRAPH = 1\n")
    (tmp_path / "cost_pkg").mkdir()
    (tmp_path / "cost_pkg" / "__init__.py").write_text("from types_pkg.graph import GRAPH\n\ndef price():\n"
                                                      "    return GRAPH\n")
    assert import_error("types_pkg", tmp_path) is None
    assert "partially initialized module 'cost_pkg'" in (import_error("cost_pkg", tmp_path) or "")

MODULES = frozenset(project_modules())


def _violations(source: str, module: str, *, is_package: bool = False) -> list[tuple[str, str]]:
    found = check(imports_of(source, module, is_package=is_package, modules=MODULES))
    return [(v.importer, v.imported) for v in found]


def test_checker_flags_an_import_against_the_flow() -> None:
    source = "from solver.intra_op.ilp import solve_intra_op\n"
    assert _violations(source, "cost_model.table") == [("cost_model.table", "solver.intra_op.ilp")]
    assert "against the flow" in check(imports_of(source, "cost_model.table", is_package=False,
                                                  modules=MODULES))[0].why


def test_checker_sees_function_local_imports() -> None:
    source = "import math\n\ndef build():\n    if True:\n        from codegen.apply import apply\n    return apply\n"
    assert _violations(source, "solver.pipeline_search") == [("solver.pipeline_search", "codegen.apply")]


def test_checker_flags_internals_of_an_allowed_edge() -> None:
    assert _violations("import cost_model\n", "solver.pipeline_search") == []          # the public entry is fine
    assert _violations("from cost_model.collectives import all_reduce_time_s\n", "solver.pipeline_search") == [
        ("solver.pipeline_search", "cost_model.collectives")]
    assert _violations("from cost_model import table\n", "solver.pipeline_search") == [
        ("solver.pipeline_search", "cost_model.table")]
    attribute_use = "import cost_model\n\ndef f(p):\n    return cost_model.table.cost_table(p)\n"
    assert _violations(attribute_use, "solver.pipeline_search") == [("solver.pipeline_search", "cost_model.table")]


def test_solver_surface_check_fails_on_a_submodule() -> None:
    def found(source: str) -> list[tuple[str, str]]:
        imports = imports_of(source, "solver.intra_op.ilp", is_package=False, modules=MODULES)
        return [(i.importer, i.imported) for i in solver_cost_model_internals(imports)]

    assert found("from cost_model import CostTable, cost_table\nimport cost_model\n") == []
    assert found("from cost_model.table import cost_table\n") == [("solver.intra_op.ilp", "cost_model.table")]
    assert found("import cost_model\n\ndef f(g, s, c):\n    return cost_model.table.cost_table(g, s, c)\n") == [
        ("solver.intra_op.ilp", "cost_model.table")]
    assert found("from cost_model import compute\n") == [("solver.intra_op.ilp", "cost_model.compute")]
    # the same import from a module of another stage is not this rule's business
    assert solver_cost_model_internals(imports_of("from cost_model.table import cost_table\n", "autopar.api",
                                                  is_package=False, modules=MODULES)) == []


def test_baseline_check_fails_on_a_product_import() -> None:
    def found(source: str, module: str) -> list[tuple[str, str]]:
        imports = imports_of(source, module, is_package=False, modules=MODULES)
        return [(i.importer, i.imported) for i in baseline_imports(imports)]

    assert found("from benchmarks.baselines.template.rules import rules_for\n", "autopar.api") == [
        ("autopar.api", "benchmarks.baselines.template.rules")]
    assert found("def f():\n    from benchmarks.baselines.template.stages import build_chunks\n",
                 "autopar.runtime.checkpoint") == [
        ("autopar.runtime.checkpoint", "benchmarks.baselines.template.stages")]
    assert found("from benchmarks.baselines import analytic\n", "cost_model.table") == [
        ("cost_model.table", "benchmarks.baselines")]
    assert found("import benchmarks\n", "codegen.apply") == [("codegen.apply", "benchmarks")]
    assert found("from codegen.apply import apply\n", "autopar.api") == []          # not a baseline
    assert found("from codegen.apply import apply\n", "benchmarks.measure_cpu") == []  # benchmarks/ imports the product
    # the flow check reads such an import as one of a module no stage claims
    assert _violations("from benchmarks.baselines.template.search import search\n", "solver.pipeline_search") == [
        ("solver.pipeline_search", "benchmarks.baselines.template.search")]


def test_checker_flags_wiring_outside_the_wiring_modules() -> None:
    source = "from autopar.trace import trace_step\nfrom codegen.apply import apply\n"
    assert _violations(source, "autopar.runtime_new") == [("autopar.runtime_new", "autopar.trace"),
                                                          ("autopar.runtime_new", "codegen.apply")]
    assert _violations(source, "autopar.api") == []
    assert _violations(source, "autopar.commands.train") == []


def test_checker_flags_shared_types_importing_a_stage_and_resolves_relative_imports() -> None:
    assert _violations("from solver.pipeline_search import search\n", "autopar.plan") == [
        ("autopar.plan", "solver.pipeline_search")]
    assert _violations("from autopar import Plan\n", "cost_model.table") == [("cost_model.table", "autopar")]
    assert _violations("from . import forced\n", "solver.pipeline_search") == []        # same stage
    assert _violations("from ..pipeline_search import search\n", "solver.intra_op.space") == [
        ("solver.intra_op.space", "solver.pipeline_search")]
    assert _violations("from .space import coverage\n", "solver.intra_op.ilp") == []  # solver.intra_op.space


def test_known_list_must_shrink() -> None:
    known = (("codegen.kernels.modules", "autopar.models.gpt", "why"),
             ("codegen.kernels.modules", "autopar.models.llama", "why"))
    found = [Violation("codegen.kernels.modules", "autopar.models.gpt", 1, "x")]
    new, stale = compare_with_known(found, known)
    assert new == [] and stale == [("codegen.kernels.modules", "autopar.models.llama")]
    new, stale = compare_with_known(found + [Violation("codegen.apply", "autopar.runtime.program", 3, "x")], known)
    assert [(v.importer, v.imported) for v in new] == [("codegen.apply", "autopar.runtime.program")]


def test_lazy_import_check_fails_without_a_reason() -> None:
    source = ("import math\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from solver import forced\n\n\n"
              "def f():\n"
              "    import pulp  # lazy: the ILP solver, only on the solve path\n"     # 9: a reason
              "    from rich.table import (  # lazy: rich, only to print tables\n"    # 10: on the first line
              "        Table)\n"
              "    import copy\n"                                                     # 12: none
              "    if TYPE_CHECKING:\n        from solver.forced import solve_stage\n"
              "    def g():\n"
              "        from solver.forced import (\n"                                 # 16: not on the first line
              "            solve_one_stage)  # lazy: the solver\n"
              "    return math, pulp, Table, copy, g\n")
    assert unexplained_lazy_imports(source) == [12, 16]
    assert unexplained_lazy_imports("import copy\n\n\nclass A:\n    x = 1\n") == []


def test_cycle_check_sees_function_level_and_package_cycles() -> None:
    def cycles(sources: dict[str, str]) -> list[frozenset[str]]:
        modules = frozenset(sources)
        imports = [i for m, src in sources.items() for i in imports_of(src, m, is_package=False, modules=modules)]
        return import_cycles(imports)

    three = {"cost_model.a": "from cost_model.b import x\n",
             "cost_model.b": "def f():\n    from cost_model.c import y\n",
             "cost_model.c": "import cost_model.a\n",
             "cost_model.d": "from cost_model.a import z\n"}
    assert cycles(three) == [frozenset({"cost_model.a", "cost_model.b", "cost_model.c"})]
    assert cycles({"solver.a": "from solver.b import x\n", "solver.b": "import math\n"}) == []
    known = ((frozenset({"cost_model.a", "cost_model.b", "cost_model.c"}), "x"),
             (frozenset({"solver.a", "solver.b"}), "y"))
    smaller = [frozenset({"cost_model.a", "cost_model.b"})]
    assert compare_cycles(smaller, known) == ([], [frozenset({"solver.a", "solver.b"})])
    type_only = {"solver.a": "from solver.b import x\n",
                 "solver.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from solver.a import y\n"}
    assert cycles(type_only) == []
    grown = [frozenset({"cost_model.a", "cost_model.b", "cost_model.c", "cost_model.d"})]
    assert compare_cycles(grown, known)[0] == grown
