"""One-off experiments: one question about this machine each; what they found is in the code's
docstrings and docs/ (benchmarks/README.md)."""
