"""What a pipeline cut needs of the runtime: routing, renaming, relays and tied-weight groups.

Where it sits: runtime. The cut itself (autopar/build/chunks.py `split_model`) finds the
model's repeated layer stack (the model's largest ModuleList / Sequential / numbered
ModuleDict: the container autopar/trace/ groups layers by), cuts it into pp * interleave
chunks (the plan's `stage_layers` or an even split) and captures one microbatch of the
training step with `torch.distributed.pipelining.pipeline` through `routed` (model +
loss, or a model whose forward returns the loss), whose split points are the first layer
of every chunk but the first: chunk 0 holds everything before its last layer's successor
(embeddings, masks, position ids), the last chunk everything after its first layer
(final norm, head, loss). Parameter names inside each stage module are the unsplit
model's (`canonicalize`), so checkpoints and comparisons need no renaming.

Model inputs reach later stages through the first: every tensor input is copied at the
top of the traced step, so the copy is made in chunk 0 and sent on like an activation
(torch's traced stages feed root inputs to the first stage only; labels are consumed by
the last); values a later chunk reads from an earlier, non-adjacent one are relayed
(`relay_skips`). A parameter that several chunks use (a tied embedding and head) is held
by each; `make_tie_groups` makes the groups of pp ranks holding one tied tensor, over which
their gradients are summed (Megatron's embedding group).

`pipeline_support` (autopar/capabilities.py) says which configurations run.
"""

from __future__ import annotations

import copy
import logging
import operator
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.config import ParallelConfig
from autopar.runtime.program import default_group_timeout

log = logging.getLogger(__name__)


def output_is_loss(output: torch.Tensor, target: Any) -> torch.Tensor:
    """The schedule's loss function: the last stage already returns the loss (as a
    one-element tensor, so the schedule can concatenate the microbatches' outputs)."""
    return output.sum()


def routed(model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None) -> nn.Module:
    """`model` (sharing its modules and parameters, so names are unchanged) with a forward
    that copies every tensor input first (so later stages receive them from stage 0) and
    returns the loss (shape (1,)): `loss_fn(model(*inputs[:-1]), inputs[-1])`, or the model's own
    output (its `.loss` for Hugging Face outputs)."""
    base = type(model)

    def forward(self: nn.Module, *args: Any) -> torch.Tensor:
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        out = loss_fn(base.forward(self, *args[:-1]), args[-1]) if loss_fn is not None else base.forward(self, *args)
        if not isinstance(out, torch.Tensor) and hasattr(out, "loss"):
            out = out.loss
        return out.reshape(1)

    routed_cls = type(f"Routed{base.__name__}", (base,), {"forward": forward})
    out = copy.copy(model)  # shares _modules/_parameters: the same tensors under the same names
    out.__class__ = routed_cls
    return out


def relay_skips(pipe: Any) -> int:
    """Route every value a stage sends past its neighbour through the stages in between
    (each passes it on unchanged), so stages talk to adjacent stages only, which torch's
    multi-stage schedules (interleaved 1F1B, zero bubble) require. Returns the relays added.

    A Hugging Face model computes its attention mask and position ids before the first
    layer and every layer reads them: cut in k chunks, chunk 0 would send them to all k - 1
    others."""
    outer = pipe.split_gm.graph
    calls = [n for n in outer.nodes if n.op == "call_module"]
    stage_of = {n: k for k, n in enumerate(calls)}

    def source(value: fx.Node) -> int:
        while value.op == "call_function" and value.target is operator.getitem:
            value = value.args[0]
        return stage_of.get(value, -1)

    relayed: dict[tuple[fx.Node, int], fx.Node] = {}

    def pass_through(call: fx.Node, value: fx.Node, example: Any) -> fx.Node:
        sub = pipe.split_gm.get_submodule(call.target)
        graph = sub.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        if value in call.args:  # the stage reads it too: pass its own input on
            ph = placeholders[list(call.args).index(value)]
        else:
            with graph.inserting_after(placeholders[-1]):
                ph = graph.placeholder(f"relay_{value.name}")
            ph.meta["val"] = example
            call.args = tuple(call.args) + (value,)
        output = graph.output_node()
        old = output.args[0]
        if not isinstance(old, (tuple, list)):  # one output: the outer graph reads it as item 0 now
            with outer.inserting_after(call):
                first = outer.call_function(operator.getitem, (call, 0))
            call.replace_all_uses_with(first, delete_user_cb=lambda user: user is not first)
            old = (old,)
        output.args = (tuple(old) + (ph,),)
        graph.lint()
        sub.recompile()
        getters = [u for u in call.users if u.target is operator.getitem]
        with outer.inserting_after(getters[-1] if getters else call):
            return outer.call_function(operator.getitem, (call, len(old)))

    for k, call in enumerate(calls):
        sub = pipe.split_gm.get_submodule(call.target)
        examples = [n.meta["val"] for n in sub.graph.nodes if n.op == "placeholder"]
        for pos in range(len(call.args)):
            value = call.args[pos]  # read afresh: a relay may have rewritten this stage's inputs
            if not isinstance(value, fx.Node):
                continue
            s = source(value)
            if s < 0 and k > 0:
                raise ValueError(f"stage {k} reads model input {value.name} directly; inputs must reach later "
                                 "stages through the first (autopar.runtime.pipe.routed)")
            for j in range(s + 1, k):
                key = (value, j)
                if key not in relayed:
                    relayed[key] = pass_through(calls[j], value, examples[pos])
                value = relayed[key]
            call.update_arg(pos, value)
    for k, call in enumerate(calls[1:], start=1):
        _order_inputs(pipe, call, calls[k - 1])
    outer.lint()
    pipe.split_gm.recompile()
    return len(relayed)


def _order_inputs(pipe: Any, call: Any, previous: Any) -> None:
    """Order stage `call`'s inputs as its predecessor sends them (by output index): the
    sends and receives between two stages are matched in the order they are posted."""
    sub = pipe.split_gm.get_submodule(call.target)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]

    def index(value: Any) -> int:
        if value is previous:
            return 0
        assert value.target is operator.getitem and value.args[0] is previous, "not adjacent after relaying"
        return value.args[1]

    order = sorted(range(len(call.args)), key=lambda i: index(call.args[i]))
    if order == list(range(len(order))):
        return
    anchor = placeholders[-1].next
    for i in order:
        anchor.prepend(placeholders[i])
    call.args = tuple(call.args[i] for i in order)
    sub.graph.lint()
    sub.recompile()


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every parameter name -> the first name of its tensor (tied names share one)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def canonicalize(stage: nn.Module, canonical: dict[str, str]) -> None:
    """Read every tied tensor under its canonical name. torch's splitter keeps one of a tied
    tensor's names per stage, picked in set order, which varies between processes: dp peers
    would then hold their parameters in different orders (FSDP's all-gathers and the flat
    gradient all-reduce need one order)."""
    changed = False
    for node in stage.graph.nodes:
        if node.op != "get_attr" or canonical.get(node.target, node.target) == node.target:
            continue
        alias, name = node.target, canonical[node.target]
        owner, _, leaf = alias.rpartition(".")
        value = getattr(stage.get_submodule(owner), leaf, None)
        if value is not None:
            new_owner, _, new_leaf = name.rpartition(".")
            target = stage.get_submodule(new_owner)
            if getattr(target, new_leaf, None) is None:
                target.register_parameter(new_leaf, value)
            delattr(stage.get_submodule(owner), leaf)
        node.target = name
        changed = True
    for alias, _ in list(stage.named_parameters(remove_duplicate=False)):
        if canonical.get(alias, alias) != alias:  # a leftover copy under an alias, read by no node
            owner, _, leaf = alias.rpartition(".")
            delattr(stage.get_submodule(owner), leaf)
    if changed:
        stage.recompile()


def make_tie_groups(pipe: Any, canonical: dict[str, str], config: ParallelConfig, mesh: DeviceMesh,
                mine: set[str]) -> dict[str, dist.ProcessGroup]:
    """Groups of the pp ranks (per dp/tp coordinate) that hold one tied tensor, for every
    tensor held on more than one pp rank. Every rank creates every group, in one order."""
    holders: dict[str, set[int]] = {}
    for index in range(pipe.num_stages):
        for name, _ in pipe.get_stage_module(index).named_parameters(remove_duplicate=False):
            holders.setdefault(canonical.get(name, name), set()).add(index % config.pp)
    grid = mesh.mesh  # (pp, dp, tp) global ranks
    groups: dict[str, dist.ProcessGroup] = {}
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for name in sorted(holders):
        pp_ranks = sorted(holders[name])
        if len(pp_ranks) < 2:
            continue
        for d in range(config.dp):
            for t in range(config.tp):
                ranks = tuple(int(grid[r, d, t]) for r in pp_ranks)
                if ranks not in made:
                    made[ranks] = dist.new_group(list(ranks), timeout=default_group_timeout())
                if dist.get_rank() in ranks and name in mine:
                    groups[name] = made[ranks]
    return groups
