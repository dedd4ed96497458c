"""The template's per-stage programs as readable source: one rank's stage step traced to Python.

Where it sits: benchmarks/baselines/template/, the source of the module-level template
program (benchmarks/baselines/template_program.py, the hand-written baseline, not what
`autopar train` runs; the product's `autopar search --emit` writes a plan's per-rank
program, autopar/build/emit.py). `emit(model, config, example_inputs=...)` builds each
pipeline chunk by the rule tables (stages.py, tp.py here), then traces one microbatch of
that chunk's forward + backward + data-parallel gradient sync with `make_fx` on fake
tensors, so the source is ATen ops plus `_c10d_functional.*` collectives (+ `wait_tensor`)
where placements change. Nothing runs and nothing is communicated: with no process
group, a `fake` one (world = config.num_devices, codegen/emit.py `fake_world`) is created
for the call; inside a running job, the job's own mesh is used and only this rank's
chunks are traced.

What the source shows per rank: inputs are the rank's local parameter shards (named
`p_<fqn>`), buffers, and the microbatch (tokens / activations from the previous stage,
labels / the gradient from the next stage). TP collectives come from DTensor. The
data-parallel part is written out the way the runtime's ZeRO stage behaves: zero 0/1
all-reduce (mean) every gradient over "dp"; zero 2 reduce-scatters them over "dp" (dim
0); zero 3 also all-gathers each dp-sharded parameter before use. (At run time ZeRO 2/3
are FSDP2 hooks doing these same collectives, bucketed.) Pipeline send/recv is done by
the schedule between stage programs, so it is not in a stage's source.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.stateless import _reparametrize_module

from autopar.config import ParallelConfig
from benchmarks.baselines.template.rules import FamilyRules, rules_for
from benchmarks.baselines.template.stages import build_chunks
from benchmarks.baselines.template.tp import apply_tp, check_tp
from codegen.emit import fake_world


def _sanitize(name: str) -> str:
    return re.sub(r"\W", "_", name)


def _stage_step(chunk: nn.Module, rules: FamilyRules | None, config: ParallelConfig, mesh: DeviceMesh, *,
                is_first: bool, is_last: bool, loss_fn: Callable[..., torch.Tensor] | None
                ) -> tuple[Callable[..., Any], list[str], list[torch.Tensor], list[str], list[torch.Tensor]]:
    named = list(chunk.named_parameters())
    names = [n for n, _ in named]
    specs = [(p.device_mesh, p.placements, p.shape, p.stride()) if isinstance(p, DTensor) else None for _, p in named]
    local = [(p.to_local() if isinstance(p, DTensor) else p).detach() for _, p in named]
    buffer_names = [n for n, _ in chunk.named_buffers()]
    buffers = [b for _, b in chunk.named_buffers()]
    dp = config.dp
    dp_group = mesh.get_group("dp")
    zero_sharded = [config.zero >= 2 and dp > 1 and t.dim() > 0 and t.shape[0] % dp == 0 for t in local]
    if config.zero == 3:
        local = [t.chunk(dp, dim=0)[0].clone() if s else t for t, s in zip(local, zero_sharded)]

    def step(params: list[torch.Tensor], buffer_values: list[torch.Tensor], *io: torch.Tensor) -> Any:
        # torch.fx.traceback's global node metadata is restored afterwards: tracing a
        # selective-recompute chunk leaves {'recompute': ..., 'ac_graph_id': None} in it
        # (torch 2.13), which later graph captures in the process stamp on their nodes and
        # the min-cut partitioner then rejects (seen: fused-op opchecks after an emit).
        saved_meta = dict(fx_traceback.current_meta)
        try:
            return _step(params, buffer_values, *io)
        finally:
            fx_traceback.current_meta.clear()
            fx_traceback.current_meta.update(saved_meta)

    def _step(params: list[torch.Tensor], buffer_values: list[torch.Tensor], *io: torch.Tensor) -> Any:
        leaves = [t.detach().requires_grad_() for t in params]
        full = [funcol.all_gather_single_autograd(t, 0, dp_group) if config.zero == 3 and s else t
                for t, s in zip(leaves, zero_sharded)]
        values = {n: (DTensor.from_local(t, sp[0], sp[1], run_check=False, shape=sp[2], stride=sp[3]) if sp else t)
                  for n, t, sp in zip(names, full, specs)}
        values.update(zip(buffer_names, buffer_values))
        inputs, target = io[:-1], io[-1]
        if not is_first:
            inputs = tuple(x.detach().requires_grad_() for x in inputs)
        # Backward inside the reparametrisation: recomputation (checkpoint) re-runs layers
        # in backward and must see the traced parameters, not the module's own.
        with _reparametrize_module(chunk, values, tie_weights=True):
            out = chunk(*inputs)
            wrt = leaves + ([] if is_first else list(inputs))
            if is_last:
                if rules is not None:
                    out = rules.loss_fn(out, target)
                elif loss_fn is not None:
                    out = loss_fn(out, target)
                grads = torch.autograd.grad(out, wrt, allow_unused=True)
            else:
                grads = torch.autograd.grad(out, wrt, grad_outputs=target, allow_unused=True)
        param_grads, input_grads = list(grads[: len(leaves)]), list(grads[len(leaves):])
        if dp > 1:
            synced = []
            for g, s in zip(param_grads, zero_sharded):
                if g is None:
                    synced.append(None)
                elif s and config.zero == 2:
                    synced.append(funcol.reduce_scatter_single(g, "avg", 0, dp_group))
                elif config.zero == 3 and s:
                    synced.append(g)  # the all_gather's backward already reduce-scattered it (sum)
                else:
                    synced.append(funcol.all_reduce(g, "avg", dp_group))
            param_grads = synced
            if config.zero == 3:
                param_grads = [g / dp if (g is not None and s) else g for g, s in zip(param_grads, zero_sharded)]
        return out.detach(), param_grads, input_grads

    return step, names, local, buffer_names, buffers


def _rename_placeholders(gm: torch.fx.GraphModule, names: list[str]) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, names):
        node._rename(name)
        node.target = node.name
    gm.recompile()


def _trace_chunk(model: nn.Module, config: ParallelConfig, mesh: DeviceMesh, chunk_id: int, num_chunks: int,
                 example_inputs: Sequence[Any], stage_layers: tuple[int, ...] | None,
                 loss_fn: Callable[..., torch.Tensor] | None) -> str:
    model = copy.deepcopy(model)
    rules = rules_for(model)
    if rules is not None:
        chunk = build_chunks(model, rules, num_chunks, (chunk_id,), stage_layers=stage_layers,
                             recompute=config.recompute)[0]
        is_first, is_last = chunk.is_first, chunk.is_last
    else:
        chunk, is_first, is_last = model, True, True
    if config.tp > 1:
        apply_tp(chunk, rules, mesh["tp"], sequence_parallel=config.sequence_parallel)
    mb = config.micro_batch
    batch = [t[:mb] if isinstance(t, torch.Tensor) else t for t in example_inputs]
    if rules is not None:
        hidden = torch.empty(mb, batch[0].shape[1], model.cfg.hidden)
        io = [batch[0] if is_first else hidden, batch[1] if is_last else torch.empty_like(hidden)]
    else:
        io = list(batch) if loss_fn is not None else [*batch, torch.empty(())]
    step, names, local, buffer_names, buffers = _stage_step(chunk, rules, config, mesh, is_first=is_first,
                                                            is_last=is_last, loss_fn=loss_fn)
    gm = make_fx(step, tracing_mode="fake")(local, buffers, *io)
    io_names = ["tokens" if is_first else "activations", "labels" if is_last else "grad_output"]
    if rules is None:
        io_names = [f"input_{i}" for i in range(len(io))]
    _rename_placeholders(gm, [f"p_{_sanitize(n)}" for n in names] + [f"b_{_sanitize(n)}" for n in buffer_names]
                         + io_names)
    coords = {"pp": chunk_id % config.pp, "dp": mesh.get_local_rank("dp"), "tp": mesh.get_local_rank("tp")}
    groups = {axis: mesh.get_group(axis).group_name for axis in ("pp", "dp", "tp")}
    header = [
        f"# autopar stage {chunk_id} of {num_chunks}: the rank at mesh coordinates {coords}",
        f"# config: {config.to_json()}",
        "# process groups by mesh axis (the group argument of each collective): "
        + ", ".join(f"{a}={g!r}" for a, g in groups.items()),
        f"# one microbatch of {mb} sequence(s); returns (loss or activations, parameter grads, input grads)",
    ]
    return "\n".join(header) + "\n" + gm.code


def emit(model: nn.Module, config: ParallelConfig, *, example_inputs: Sequence[Any],
         mesh: DeviceMesh | None = None, stage_layers: tuple[int, ...] | None = None,
         loss_fn: Callable[..., torch.Tensor] | None = None, fused_kernels: bool = False) -> dict[str, str]:
    """Source of every pipeline chunk's per-rank program, by stage name (`stage0`, ...).

    With `mesh` (a running job's ("pp", "dp", "tp") mesh) only this rank's chunks are
    traced; without, a fake process group stands in for the whole world. With
    `fused_kernels` the program is the one the runtime runs on GPU: norms and MLP
    activations are `torch.ops.autopar.*` fused ops (codegen/kernels)."""
    if fused_kernels:
        if config.tp > 1:
            raise ValueError(f"fused kernels run with tp=1 only (tp={config.tp} given): the fused ops have no "
                             "DTensor sharding rules yet; emit with fused_kernels=False for tensor parallelism")
        from codegen.kernels.modules import swap_fused_modules

        model = swap_fused_modules(model)
    check_tp(rules_for(model), model, config.tp)
    num_chunks = config.pp * config.interleave
    if mesh is not None:
        pp_rank = mesh.get_local_rank("pp")
        ids = [pp_rank + v * config.pp for v in range(config.interleave)]
        return {f"stage{c}": _trace_chunk(model, config, mesh, c, num_chunks, example_inputs, stage_layers, loss_fn)
                for c in ids}
    if dist.is_initialized():
        raise ValueError("the template's emit without mesh= needs no process group; inside a job pass the job's "
                         "mesh")
    # One fake world for all chunks, as rank 0: a chunk's program does not depend on the
    # rank's pp coordinate, and re-creating fake worlds inside one process is fragile.
    with fake_world((config.pp, config.dp, config.tp), ("pp", "dp", "tp")) as fake_mesh:
        return {f"stage{c}": _trace_chunk(model, config, fake_mesh, c, num_chunks, example_inputs, stage_layers,
                                          loss_fn) for c in range(num_chunks)}


def count_collectives(source: str) -> dict[tuple[str, str], int]:
    """{(collective, group name): count} in an emitted source (wait_tensor excluded)."""
    counts: dict[tuple[str, str], int] = {}
    for op, group in re.findall(r"_c10d_functional\.(\w+)\.default\([^\n]*?'([^']+)'\)", source):
        if op != "wait_tensor":
            counts[(op, group)] = counts.get((op, group), 0) + 1
    return counts
