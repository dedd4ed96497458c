"""What autopar is compared with: the hand-tuned program, the template program, the torchtitan
driver, and the closed-form step model `analytic` (benchmarks/README.md)."""
