"""autopar's benchmarks: the scripts that measure it and write benchmarks/results/ (README.md).

Not part of the installed package (pyproject.toml packages only autopar, cost_model, solver
and codegen). A package so that its scripts, run by path from the repository root
(`python benchmarks/fit/fit_one_model.py`), and the tests import each other by full name
(`from benchmarks.lib.published_runs import load_runs`): every script puts the repository
root on sys.path before those imports.
"""
