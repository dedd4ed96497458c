"""The runtime: what starts ranks and steps, syncs and saves the programs the build hands it.

Where it sits: last in the flow (trace -> Graph -> strategies -> costs -> solve -> Plan ->
apply -> run). Each rank's program is built by autopar/build/ (its step or its pipeline
chunks traced once, the per-op placements decided before the ranks started applied); the
runtime imports no solver, tracer or codegen.apply. Its modules, in the order a job meets
them:
- `launch`: start ranks (local gloo processes, or the world torchrun made); collective and
  build-time timeouts; a failed or hung rank named.
- `program`: what every program shares: the ("pp", "dp", "tp") process mesh, the optimizer
  update and loss checks, the measured step statistics, the chunks' state dicts.
- `spmd`: the one-stage per-op program: the per-rank graphs of the step, DTensor
  parameters in their placements, a stock torch.optim optimizer.
- `pipe`: what a pipeline cut needs at run time: the routed step, canonical names,
  relayed values and the tied-weight groups.
- `pipe_spmd`: per-op pipeline stages, each chunk's forward and backward graphs run by
  torch's pipeline schedules.
- `jobs`: training jobs on synthetic data (the train loop of `autopar train`, handed the
  build) and the single-process reference they are checked against.
- `checkpoint`: complete, resumable checkpoints (torch.distributed.checkpoint), loadable
  under another plan.
"""
