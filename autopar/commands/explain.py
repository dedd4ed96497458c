"""`autopar explain plan.json`: what the plan chose per stage and layer group, and why.

Reads the plan file only (no tracing, no re-solving): a plan is explainable from itself.
For the zoo's mixtures of experts it adds how tokens are routed (the capacity policy,
autopar/models/moe.py) and where the routed experts run, read off the plan's placements;
for any model whose experts run through the grouped matmul (autopar/grouped_mm.py: Hugging
Face's Mixtral, Qwen2-MoE and the like), where those matmuls run (`grouped_lines`).
"""

from __future__ import annotations

import argparse
import json

from autopar.explain import placement_axes
from autopar.ir import GROUPED_MM_FWD
from autopar.models import resolve
from autopar.models.moe import MoEConfig, capacity
from autopar.plan import Plan
from autopar.plots import plot_plan
from autopar.sharding import UPDATE_SEPARATOR


def routing_lines(plan: Plan) -> list[str]:
    """For a plan of the zoo's mixture of experts: its capacity policy and where its routed
    experts `[E, d, f]` run; [] for any other model.

    Capacity (GShard, Lepikhin et al. 2020, arXiv 2006.16668): each expert takes at most
    C = ceil(capacity_factor * s * k / E) of a group's s tokens' k choices; a choice past
    it is dropped and the residual carries the token (Switch Transformer, Fedus et al.
    2021, arXiv 2101.03961, section 2.2). Where the experts run: the compute placement
    the ILP gave the routed experts' weights (`moe.w1`, `moe.w3`, `moe.w2`); an E split
    over dp is expert parallelism where the plan moves tokens over dp (its all-to-alls
    there: solver/intra_op/restrict.py exchange_nodes), else ZeRO-3 storage."""
    try:
        config = resolve(plan.model).config
    except (ValueError, ImportError):  # a Hugging Face or user model: its routing is its own
        return []
    if not isinstance(config, MoEConfig):
        return []
    group = min(config.group_tokens or plan.seq, plan.seq)
    slots = capacity(group, config.top_k, config.experts, config.capacity_factor)
    lines = [f"mixture of experts: {config.experts} routed experts per layer, top-{config.top_k}, "
             f"{config.shared_experts} shared; capacity factor {config.capacity_factor:g}: at most {slots} of a group's "
             f"{group} tokens' {config.top_k * group} choices per expert (ceil({config.capacity_factor:g} x {group} x "
             f"{config.top_k} / {config.experts})), a choice past its expert's capacity is dropped and the "
             "residual connection carries the token"]
    info = plan.intra_op_info
    if info is not None:
        where = [(plan.config.dp, plan.config.tp, "", info.parameters, info.collectives)]
    else:
        where = [(st.submesh[0], st.submesh[1], f"stage {st.index}: ", st.placements, st.collectives)
                 for st in plan.stages]
    found = [line for dp, tp, label, params, colls in where
             if (line := _experts_line(params, colls, dp, tp, plan.cluster.startswith("cpu"), label))]
    if not found:
        lines.append("  routed experts: their placements are not recorded in this plan")
    lines.extend(found)
    return lines


def _experts_line(params: Sequence[tuple[str, str]], collectives: Sequence[tuple[str, str, int, int]],
                  dp_ways: int, tp_ways: int, cpu: bool, label: str) -> str | None:
    """Where one stage's (or a one-stage plan's) routed experts run, read off the compute
    placement of its first routed-expert weight and its all-to-alls per microbatch; None
    where the stage holds no routed experts (routing_lines)."""
    experts = [(name, placement) for name, placement in params
               if name.rsplit(".", 1)[-1] in ("w1", "w2", "w3") and ".moe." in f".{name}"]
    if not experts:
        return None
    name, placement = experts[0]
    compute = placement.partition(UPDATE_SEPARATOR)[0]
    dp, tp = (placement_axes(compute) + ["R", "R"])[:2]
    moves = {axis: calls for kind, axis, calls, _ in collectives if kind == "all_to_all"}
    if dp == "S(0)" and moves.get("dp"):
        over_dp = (f"; over dp too, {dp_ways} ways: each data-parallel rank computes its own experts on the "
                   f"tokens sent to it ({moves['dp']} all-to-alls over dp per microbatch), expert parallelism over "
                   "the data-parallel ranks")
    elif dp == "S(0)":
        over_dp = ("; over dp the split is ZeRO-3 storage, gathered before use" if not cpu
                   else "; over dp the experts are split on E: stored (ZeRO-3) and gathered before use, or computed "
                        "where they are stored with the tokens sent to them (on a CPU mesh that move runs as an "
                        "all-gather and a chunk: the per-op placements say which)")
    else:
        over_dp = ""
    head = f"  routed experts{' (' + label.rstrip(': ') + ')' if label else ''}:"
    if tp == "S(0)":
        return (f"{head} split {tp_ways} ways on E over tp ({name}: {placement}); tokens travel to their experts' "
                "ranks and back as the placements change (all-to-all on GPU meshes, all-gather and chunk on CPU "
                "meshes), priced and run" + over_dp)
    if dp == "S(0)" and moves.get("dp"):
        return (f"{head} split {dp_ways} ways on E over dp ({name}: {placement}): each data-parallel rank computes "
                f"its own experts on the tokens sent to it and back ({moves['dp']} all-to-alls over dp per "
                "microbatch), expert parallelism over the data-parallel ranks, priced and run: the ILP priced "
                "sending the tokens below gathering every expert's weights on every rank")
    return (f"{head} not split on E for compute ({name}: {placement}): the ILP priced each rank computing its own "
            "tokens with the experts whole cheaper than sending the tokens to split experts (an all-to-all over tp "
            "or dp)" + over_dp)


def grouped_lines(plan: Plan) -> list[str]:
    """Where the experts' grouped matmuls of `plan` run, read off its recorded per-op
    placements (the forward op's weights operand, one line per chunk that has such ops);
    [] where the plan records none. The weights split on E over an axis is expert
    parallelism there (each rank its experts' rows, the partial outputs summed); split on
    another dim, tensor parallelism inside each expert; whole, the ILP priced that below both
    on this mesh (fewer collectives: the expert-parallel outputs are pending sums, reduced
    before every nonlinearity). The rows (tokens) split over an axis are said beside it, and
    the policy: dropless (the op computes every row it is given; no capacity drops any)."""
    lines = []
    axes_names = ("dp", "tp")
    for stage in plan.placements:
        rows = [p for p in stage.placements if p.op == GROUPED_MM_FWD]
        if not rows:
            continue
        layouts = [placement_axes(p.inputs[1]) for p in rows]
        where = []
        for axis, name in enumerate(axes_names):
            on_axis = {layout[axis] if axis < len(layout) else "R" for layout in layouts}
            if on_axis == {"S(0)"}:
                where.append(f"expert parallelism over {name} (weights and experts split on E: each rank computes "
                             f"its own experts' rows, the partial outputs summed over {name})")
            elif on_axis and all(p.startswith("S(") for p in on_axis):
                where.append(f"split inside each expert over {name} ({', '.join(sorted(on_axis))})")
        chunk = f" (chunk {stage.chunk})" if len(plan.placements) > 1 else ""
        tokens = [name for axis, name in enumerate(axes_names)
                  if all(axis < len(lay) and lay[axis] == "S(0)" for lay in (placement_axes(p.inputs[0]) for p in rows))]
        split = f", each rank its own tokens (the rows split over {' and '.join(tokens)})" if tokens else ""
        head = f"  experts' grouped matmuls{chunk} (dropless: every routed copy of a token computed, no capacity):"
        if where:
            lines.append(f"{head} " + "; ".join(where) + split)
        else:
            lines.append(f"{head} computed with every expert's weights whole on the "
                         f"rank{split}: on this mesh the ILP priced that below expert parallelism, whose partial "
                         "outputs are summed before every nonlinearity (more collectives per layer)")
    return lines


def run(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    if args.plot:  # pipeline timeline + peak-device memory breakdown (autopar/plots.py)

        plot_plan(plan, args.plot)
    if args.json:
        print(json.dumps({"plan": plan.to_json(), "explanation": plan.explain().splitlines() + routing_lines(plan)
                          + grouped_lines(plan)},
                         indent=2, sort_keys=True))
    else:
        print("\n".join([plan.explain(), *routing_lines(plan), *grouped_lines(plan)]))
    return 0
