"""The runtime: the per-rank program a plan compiles to, and what starts, trains and saves it.

Where it sits: last in the flow (trace -> Graph -> strategies -> costs -> solve -> Plan ->
apply -> run). Its modules, in the order a job meets them:
- `launch`: start ranks (local gloo processes, or the world torchrun made); collective and
  build-time timeouts; a failed or hung rank named.
- `program`: `build_program(model, config, ...)`, the entry every caller uses: the process
  mesh, then the per-op program (pp = 1, `spmd`) or per-op pipeline stages (pp > 1,
  `pipe_spmd`); the shared optimizer update and loss checks.
- `spmd`: the one-stage per-op program: the ILP's placements applied to the traced step
  (codegen/apply.py), DTensor parameters, a stock torch.optim optimizer.
- `pipe`: cutting any model with a repeated layer stack into pipeline chunks
  (torch.distributed.pipelining's tracer), read by `pipe_spmd`.
- `pipe_spmd`: each chunk compiled by the per-op path on its (dp, tp) submesh, split into
  forward and backward graphs, run by torch's pipeline schedules.
- `jobs`: training jobs on synthetic data and the single-process reference they are
  checked against (the train loop of `autopar train`).
- `checkpoint`: complete, resumable checkpoints (torch.distributed.checkpoint), loadable
  under another plan.
"""
