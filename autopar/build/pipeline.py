"""A rank's share of a pipeline: its chunks traced, their per-op placements applied, each
split into the forward and backward graphs torch's pipeline schedules run.

Where it sits: the per-rank build (autopar/build/), for pp > 1 programs. On every rank:
1. the model is cut into its chunks and this rank's chunks are traced
   (autopar/build/chunks.py: the one recipe the launcher's checks and the wiring's solve
   use too);
2. each chunk's per-op placements come from the ProgramPlacements every rank was given
   (a plan's stage placements, or the intra-op ILP's solution for the configuration,
   solved once before any rank started: autopar/placing.py), matched by node key and op, a
   mismatch refused; no rank solves;
3. codegen/apply.py applies them: one per-rank joint graph that also returns the outputs
   and the input gradients redistributed to the boundary layout (split by batch over dp
   where dim 0 is the microbatch's rows, whole over tp);
4. that graph is split into a forward graph (every node that does not depend on a
   tangent) and a backward graph (the rest; it reads the forward values it needs, which
   the forward returns: AOTAutograd's default partition), which autopar/runtime/pipe_spmd.py
   runs under torch.distributed.pipelining's PipelineStage and schedules.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.fx.graph import _BoxedCodeGen

from autopar.build.chunks import TracedStage, cut_model, trace_chunks
from autopar.config import ParallelConfig
from autopar.ir import Role
from autopar.placement import boundary_placements
from autopar.plan import ProgramPlacements
from autopar.runtime.launch import gather_build_results
from autopar.runtime.pipe import canonical_names, make_tie_groups
from autopar.runtime.pipe_spmd import PerOpStage, PipeSpmdProgram, StageRunner, runner_source
from autopar.runtime.program import OptimizerFactory, default_optimizer, make_mesh
from autopar.runtime.spmd import SpmdProgram, distribute_parameters, local_shard, make_optimizer, release_build_memory
from codegen.apply import apply, count_collectives

log = logging.getLogger(__name__)


def split_joint(gm: fx.GraphModule, seeds: set[str], forward_outputs: list[int],
                backward_outputs: list[int]) -> tuple[fx.GraphModule, fx.GraphModule, int]:
    """Cut a per-rank joint graph into forward and backward graphs.

    `seeds`: names of the placeholders only backward has (the tangents). Backward is every
    node that depends on one or is tagged backward (a forward op the recompute policy
    copied into backward, autopar/recompute.py); forward is the rest. Forward: (the other placeholders) ->
    (the joint's outputs at `forward_outputs`, then the saved values: forward nodes that
    backward reads). Backward: (saved values, seeds in placeholder order) -> (the joint's
    outputs at `backward_outputs`). Returns (forward, backward, number of saved values)."""
    nodes = list(gm.graph.nodes)
    output = nodes[-1]
    values = list(output.args[0])
    back: set[fx.Node] = set()
    for n in nodes:
        if n.op == "output":
            continue
        if (n.op == "placeholder" and n.name in seeds) or any(a in back for a in n.all_input_nodes) \
                or n.meta.get("partitioner_tag") == "is_backward":  # recomputed forward ops too
            back.add(n)
    for i in forward_outputs:
        if values[i] in back:
            raise RuntimeError(f"stage output {values[i].name} depends on a tangent")
    saved: list[fx.Node] = []
    for n in nodes:
        if n in back:
            for a in n.all_input_nodes:
                if a not in back and a not in saved:
                    saved.append(a)
    for i in backward_outputs:
        if isinstance(values[i], fx.Node) and values[i] not in back and values[i] not in saved:
            saved.append(values[i])

    fwd = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n.op == "output" or n in back:
            continue
        env[n] = fwd.node_copy(n, lambda a: env[a])
    fwd.output(tuple(env[values[i]] for i in forward_outputs) + tuple(env[s] for s in saved))

    bwd = fx.Graph()
    benv: dict[fx.Node, fx.Node] = {}
    for k, s in enumerate(saved):
        benv[s] = bwd.placeholder(f"saved_{k}")
        benv[s].meta = dict(s.meta)
    for n in nodes:
        if n.op == "placeholder" and n in back:
            benv[n] = bwd.node_copy(n, lambda a: benv[a])
    for n in nodes:
        if n in back and n.op != "placeholder":
            benv[n] = bwd.node_copy(n, lambda a: benv[a])
    bwd.output(tuple(benv[values[i]] if isinstance(values[i], fx.Node) else None for i in backward_outputs))
    fgm, bgm = fx.GraphModule(gm, fwd), fx.GraphModule(gm, bwd)
    # boxed: the runner hands over one list of saved values and seeds, which the graph
    # empties, so each saved activation is freed after its last use in the backward, as
    # in a one-stage step graph (called with *args, every one was held to the end)
    bgm.graph.set_codegen(_BoxedCodeGen())
    bgm.recompile()
    return fgm, bgm, len(saved)


AccumulatorSpec = tuple[tuple[int, ...], torch.dtype, torch.device]


def accumulate_in_graph(bgm: fx.GraphModule, count: int, dtype: torch.dtype) -> list[AccumulatorSpec | None]:
    """Rewrite a chunk's backward graph so it adds its first `count` outputs (the raw
    parameter gradients of one microbatch) into accumulators, each as soon as it is
    computed: one placeholder per gradient after the graph's other inputs, an in-place
    `add_` of the gradient into it right after the gradient's node, and the accumulator
    returned in its place. fx frees a value after its last use, so each microbatch
    gradient is freed at once, as eager autograd accumulates into `.grad`; returned whole
    at the end (the gradients summed after the graph returns), a microbatch's gradients of
    every parameter of the chunk were live together at the end of every backward. Returns
    each accumulator's (shape, dtype, device) in output order (None: that output is not a
    tensor and gets none); `dtype` is the precision policy's reduction dtype, which sums
    are kept in (autopar/runtime/spmd.py `accumulate`)."""
    graph = bgm.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    values = list(output.args[0])
    anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
    specs: list[AccumulatorSpec | None] = []
    sums: dict[int, fx.Node] = {}
    for i in range(count):
        grad = values[i]
        val = grad.meta.get("val") if isinstance(grad, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            specs.append(None)
            continue
        with graph.inserting_after(anchor):
            anchor = sums[i] = graph.placeholder(f"accumulated_{i}")
        specs.append((tuple(val.shape), dtype if val.is_floating_point() else val.dtype, val.device))
    for i, total in sums.items():
        grad = values[i]
        # after its gradient; a gradient that is an input itself, after the last input
        with graph.inserting_after(anchor if grad.op == "placeholder" else grad):
            values[i] = graph.call_function(torch.ops.aten.add_.Tensor, (total, grad))
    output.args = (tuple(values),)
    graph.lint()
    bgm.recompile()
    return specs


def build_stage_runner(stage: TracedStage, *, choices: Sequence[Any], config: ParallelConfig, mesh: DeviceMesh,
                       optimizer: OptimizerFactory, grads_each_microbatch: bool) -> StageRunner:
    """Apply `choices` (one NodeStrategy per node of `stage.graph`: the chunk's per-op
    placements) to one traced chunk on `mesh` (its (dp, tp) submesh) and split the
    per-rank joint graph into the forward and backward graphs a PipelineStage runs. The
    chunk's parameters become DTensors in their placements. `grads_each_microbatch`: the
    placements sync every microbatch's gradients (zero 2, ProgramPlacements)."""
    extra = list(stage.extra)
    if stage.last:
        # the loss leaves in its own placement (a pending sum over dp, say): it seeds the
        # backward through the loss tangent, and is reduced for reporting once per step
        # (as the pp = 1 program reports it; priced: pipeline_search.pipeline_loss_report_s)
        extra[0] = (extra[0][0], choices[extra[0][0]].outputs[0])
    # before the build: its peak holds shards only
    params = distribute_parameters(stage.chunk, stage.graph, choices, mesh, stage.masters)
    # zero 2: each microbatch's backward reduce-scatters its gradients to their update
    # shards (the sync lands in the backward graph) and the runner accumulates the shards
    graphs = apply(stage.traced.gm, stage.graph, choices, mesh, extra_outputs=extra, keep_phases=True,
                   sync_in_step=grads_each_microbatch, compiled=config.compiled)
    # the applied step: (loss, raw grads..., outputs..., input grads...)
    num_inputs, outputs, grad_inputs = stage.num_inputs, stage.outputs, stage.grad_inputs
    num_grads = len(graphs.grads)
    num_fwd = 1 if stage.last else len(outputs)
    first_extra = 1 + num_grads
    seeds = {s for s, slot in zip([n.name for n in graphs.step.graph.nodes if n.op == "placeholder"], graphs.slots)
             if slot.role is Role.TANGENT or (slot.role is Role.INPUT
                                              and int(slot.name.removeprefix("input_")) >= num_inputs)}
    forward, backward, num_saved = split_joint(
        graphs.step, seeds, list(range(first_extra, first_extra + num_fwd)),
        list(range(1, 1 + num_grads)) + list(range(first_extra + num_fwd, first_extra + num_fwd + len(grad_inputs))))
    # eager: each microbatch gradient is added into its sum where the backward computes it
    # (Inductor plans the compiled graphs' memory itself; they return the gradients)
    accumulators = None if config.compiled else accumulate_in_graph(
        backward, num_grads, getattr(torch, stage.graph.model.precision.reduce))
    graphs.compile_like_step({"forward": forward, "backward": backward})  # Inductor where config.compiled
    program = SpmdProgram(config=config, mesh=mesh, model=stage.chunk, graphs=graphs, graph=stage.graph,
                          optimizer_factory=optimizer, choices=tuple(choices), params=params,
                          grads_at_update=grads_each_microbatch)
    # counted before their metadata goes; the boundary reshards (tagged by apply) apart
    counted = {boundary: tuple((per_microbatch, count_collectives(
        gm, lambda node, b=boundary: bool((node.meta.get("custom") or {}).get("boundary")) == b))
        for gm, per_microbatch in ((forward, True), (backward, True), (graphs.grad_sync, False),
                                   (graphs.param_gather, False)) if gm is not None)
        for boundary in (False, True)}
    # as a one-stage program does: the joint and its two halves each carried make_fx's metadata
    release_build_memory(graphs.step, forward, backward, graphs.grad_sync, graphs.param_gather)
    return StageRunner(index=stage.index, program=program, forward=forward, backward=backward, num_saved=num_saved,
                       slots=graphs.slots, num_inputs=num_inputs, grad_inputs=grad_inputs, outputs=outputs,
                       grad_outputs=stage.grad_outputs, last=stage.last, collective_counts=counted,
                       accumulators=accumulators)


def stage_sources(placed: ProgramPlacements, model: nn.Module, example_inputs: Sequence[Any], mesh: DeviceMesh, *,
                  loss_fn: Callable[..., torch.Tensor] | None = None) -> dict[str, str]:
    """Every chunk's per-rank program of a pipeline as Python source, by chunk
    (`stage<k>`), as the rank at (dp, tp) coordinate `mesh.get_coordinate()` of its stage
    builds it: the chunk traced as at build, its placements (`placed`: a plan's, or those
    solved for it by autopar/placing.py) applied, split into forward and backward. `mesh`
    is a ("dp", "tp") mesh of dp * tp ranks (a `fake` process group will do: nothing
    runs); `model` is cut and its parameters replaced by shards."""
    config = placed.config
    num_chunks = config.pp * config.interleave
    how = "the plan's stage placements" if placed.origin == "plan" else \
        "solved for the plan before the build (it records no stage placements)"
    stages = trace_chunks(model, config, example_inputs, loss_fn=loss_fn, stage_layers=placed.stage_layers or None)
    out: dict[str, str] = {}
    for stage in stages:
        runner = build_stage_runner(stage, choices=placed.choices_for(stage.graph, stage.index), config=config,
                                    mesh=mesh, optimizer=default_optimizer(),
                                    grads_each_microbatch=placed.grads_each_microbatch)
        out[f"stage{stage.index}"] = (f"# autopar {placed.model}: per-rank program of pipeline chunk {stage.index}, "
                                      f"placements: {how}\n" + runner_source(runner, config, num_chunks,
                                                                              tuple(mesh.shape)))
    return out


def build_pipe_spmd_program(model: nn.Module, placed: ProgramPlacements, example_inputs: Sequence[Any], *,
                            loss_fn: Callable[..., torch.Tensor] | None = None, optimizer: OptimizerFactory,
                            mesh: DeviceMesh | None = None) -> PipeSpmdProgram:
    """This rank's chunks of `model`, cut at its repeated layers (`placed.stage_layers`),
    each compiled by the per-op path on its (dp, tp) submesh with the chunk's placements
    from `placed`, with their schedule; collective. `example_inputs` is one global batch
    (its first dp * micro_batch rows are traced). A chunk whose traced graph does not match
    its placements raises PlanFileError on every rank."""
    from torch.distributed.pipelining import PipelineStage  # lazy: torch.distributed.pipelining, only for pp > 1

    config = placed.config
    if config.schedule == "zb":
        raise ValueError("--schedule zb is not run by per-op pipeline stages (their backward computes input and "
                         "weight gradients together); use 1f1b, gpipe or interleaved")
    mesh = mesh if mesh is not None else make_mesh(config)
    submesh = mesh["dp", "tp"]
    num_chunks = config.pp * config.interleave
    canonical = canonical_names(model)
    # the stages compute in, and exchange, the precision policy's compute dtype
    cut = cut_model(model, config, example_inputs, loss_fn=loss_fn, stage_layers=placed.stage_layers or None,
                    device_type=mesh.device_type)
    rows = cut.rows
    pp_rank = mesh.get_local_rank("pp")
    chunk_ids = tuple(pp_rank + v * config.pp for v in range(config.interleave))

    def choose(stage: TracedStage) -> tuple[Any, ...]:
        # every rank matches its chunk to its placements; a mismatch on any rank is raised on every rank
        try:
            choices, mine = placed.choices_for(stage.graph, stage.index), None
        except ValueError as exc:  # PlanFileError
            choices, mine = (), exc
        failed = next((b for b in gather_build_results(mine) if isinstance(b, Exception)), None)
        if failed is not None:
            raise failed
        return choices

    runners, stages = [], []
    priced: dict[tuple[str, str], tuple[int, int]] = {}
    coords, mesh_shape = tuple(submesh.get_coordinate()), tuple(submesh.shape)
    for cid in chunk_ids:
        ins, outs = cut.boundaries[cid]
        last = cid == num_chunks - 1
        stage = cut.trace(cid, config)
        choices = choose(stage)
        for key, (calls, nbytes) in placed.stage_collectives(cid).items():
            c, b = priced.get(key, (0, 0))
            priced[key] = (c + calls, b + nbytes)
        runner = build_stage_runner(stage, choices=choices, config=config, mesh=submesh, optimizer=optimizer,
                                    grads_each_microbatch=placed.grads_each_microbatch)
        runners.append(runner)

        def local(x: torch.Tensor, grad: bool) -> torch.Tensor:
            piece = local_shard(x.detach(), boundary_placements(x.shape, rows, config.dp), coords, mesh_shape)
            return piece.clone().requires_grad_(grad)

        in_args = tuple(local(x, i in runner.grad_inputs) for i, x in enumerate(ins))
        out_args = (outs[0].detach().reshape(1),) if last else \
            tuple(local(o, i in runner.grad_outputs) for i, o in enumerate(outs))
        stages.append(PipelineStage(PerOpStage(runner), cid, num_chunks, torch.device(mesh.device_type),
                                    input_args=in_args, output_args=out_args, group=mesh.get_group("pp")))
    cut.masters.clear()  # the other chunks' master weights: this rank holds its own, sharded
    mine = {name for r in runners for name, _ in r.program.named_parameters()}
    tie_groups = make_tie_groups(cut.pipe, canonical, config, mesh, mine)
    params: dict[int, nn.Parameter] = {}
    for r in runners:
        for _, p in r.program.named_parameters():
            params.setdefault(id(p), p)
    opt = make_optimizer(optimizer, list(params.values()))
    log.info("rank %d: per-op pipeline chunks %s of %d (layers %s of %s) on a %s submesh, placements %s",
             dist.get_rank(), chunk_ids, num_chunks, [(cut.ranges[i].start, cut.ranges[i].stop) for i in chunk_ids],
             cut.prefix, mesh_shape, "from the plan" if placed.origin == "plan" else "solved before the build")
    return PipeSpmdProgram(config=config, mesh=mesh, runners=runners, stages=stages, chunk_ids=chunk_ids,
                           num_chunks=num_chunks, optimizer=opt, tie_groups=tie_groups, priced=priced,
                           replayed=placed.origin == "plan")
