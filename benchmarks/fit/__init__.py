"""The cost models' constants fitted on published runs and recorded CPU sweeps, and readings of
those sweeps (benchmarks/README.md)."""
