"""Code generation: per-rank sharded programs from per-op placements (codegen/apply.py),
the fused Triton kernels (codegen/kernels/) and a fake process group to build them on
without running them, with their source written to files (codegen/emit.py)."""
