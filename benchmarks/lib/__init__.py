"""Helpers the benchmark scripts and tests share: the published-run loader, statistics, and the
small non-transformer models (benchmarks/README.md)."""
