"""Code generation: per-rank sharded programs from per-op placements (codegen/apply.py),
the fused Triton kernels (codegen/kernels/) and the template baseline's source (codegen/emit.py)."""
