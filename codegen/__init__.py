"""Code generation: per-rank sharded programs from a plan (see codegen/emit.py)."""


def emit_plan(plan, directory):  # noqa: ANN001, ANN201 - thin lazy re-export
    """Write each pipeline stage's per-rank program source for `plan` to `directory`."""
    from codegen.emit import emit_plan as _emit_plan

    return _emit_plan(plan, directory)
