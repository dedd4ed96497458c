"""What autopar is compared with: the hand-tuned program, the template program and the
template grid search with its rule tables (`template/`), the torchtitan driver, and the
closed-form step model `analytic` (benchmarks/README.md)."""
