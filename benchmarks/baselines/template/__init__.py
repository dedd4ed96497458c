"""The template baseline: what autopar searched and ran before the per-op compiler.

Not the product (DESIGN: the plan is the program; no per-model-family rule table on the
execution path, and tests/unit/test_layering.py checks that no product module imports
benchmarks/). Kept to compare with, each module one idea:
- search.py        the template grid: mesh shape x stage cuts x ZeRO x microbatching x
                   schedule x recompute, priced by a callable (the analytic baseline)
- inter_op.py      per-stage work and the even / exact min-max balanced stage cuts
- intra_op.py      the Megatron tp + dp placement of each parameter, per layer group
- layer_groups.py  the intra-op ILP's choice per (layer group, submesh), recorded beside it
- rules.py         per-family rule tables (GPT, Llama): pipeline chunks and TP styles
- stages.py        pipeline chunks cut from a zoo model by those tables
- tp.py            Megatron TP (+ sequence parallelism) on a chunk by `parallelize_module`
- emit.py          the template program's per-stage source, traced on a fake process group
The template program itself (run on ranks) is benchmarks/baselines/template_program.py.
"""
