"""`autopar explain` on the zoo's mixture of experts: the capacity policy and where the
routed experts run, read off the plan (autopar/commands/explain.py `routing_lines`)."""

from __future__ import annotations

from types import SimpleNamespace

from autopar.commands.explain import routing_lines
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.models.moe import capacity
from autopar.sharding import UPDATE_SEPARATOR

EXPERTS = ("layers.*.moe.w1", "layers.*.moe.w3", "layers.*.moe.w2")


def _plan(model: str, config: ParallelConfig, expert_placement: str, seq: int = 32,
          collectives: tuple = (), cluster: str = "h100:1x4") -> SimpleNamespace:
    """What routing_lines reads of a Plan: its model, seq, config, cluster, per-parameter
    placements and collectives per microbatch."""
    parameters = (("layers.*.attention.wq.weight", "(R, R)"),
                  *((name, expert_placement) for name in EXPERTS), ("layers.*.moe.gate.weight", "(R, R)"))
    return SimpleNamespace(model=model, seq=seq, config=config, cluster=cluster,
                           intra_op_info=SimpleNamespace(parameters=parameters, collectives=collectives))


def test_capacity_is_gshards_formula_for_the_plans_sequence():
    cfg = resolve("moe-tiny").config
    for seq in (32, 16):
        (line, _) = routing_lines(_plan("moe-tiny", ParallelConfig(dp=4), "(R, R)", seq=seq))
        slots = capacity(min(cfg.group_tokens or seq, seq), cfg.top_k, cfg.experts, cfg.capacity_factor)
        assert f"at most {slots} of a group's {seq} tokens' {cfg.top_k * seq} choices per expert" in line
        assert f"{cfg.experts} routed experts" in line and "dropped" in line


def test_experts_split_over_tp_are_named_with_their_ways():
    lines = routing_lines(_plan("moe-tiny", ParallelConfig(dp=2, tp=2), "(R, S(0))"))
    assert "split 2 ways on E over tp" in lines[1], lines
    # over dp an E split without tokens moving over dp is where the weights are stored
    # (ZeRO-3), gathered before use
    both = routing_lines(_plan("moe-tiny", ParallelConfig(dp=2, tp=2), "(S(0), S(0))"))
    assert "split 2 ways on E over tp" in both[1] and "over dp the split is ZeRO-3 storage" in both[1], both
    stored = routing_lines(_plan("moe-tiny", ParallelConfig(dp=4), "(S(0), R)"))
    assert "not split on E for compute" in stored[1] and "ZeRO-3 storage" in stored[1], stored
    # with all-to-alls over dp it is expert parallelism over the data-parallel ranks
    ep = routing_lines(_plan("moe-tiny", ParallelConfig(dp=4), "(S(0), R)",
                             collectives=(("all_to_all", "dp", 12, 4096), ("all_gather", "dp", 3, 64))))
    assert "split 4 ways on E over dp" in ep[1] and "12 all-to-alls over dp" in ep[1], ep
    # on a CPU mesh the move is an all-gather: both readings are named
    cpu = routing_lines(_plan("moe-tiny", ParallelConfig(dp=4), "(S(0), R)", cluster="cpu:4"))
    assert "ZeRO-3" in cpu[1] and "tokens sent to them" in cpu[1], cpu
    # the compute placement counts, not where the update is sharded (ZeRO-1)
    zero1 = routing_lines(_plan("moe-tiny", ParallelConfig(dp=2, tp=2), f"(R, R){UPDATE_SEPARATOR}(S(0), R)"))
    assert "not split on E for compute" in zero1[1], zero1


def test_a_pipeline_plan_says_where_each_stages_experts_run():
    """A pipeline plan records placements per stage: each stage holding routed experts gets
    its own line, expert parallelism over dp where the stage moves tokens there."""
    parameters = tuple((name, "(S(0), R)") for name in EXPERTS)
    stage = SimpleNamespace(index=0, submesh=(8, 1), placements=parameters,
                            collectives=(("all_to_all", "dp", 64, 2**30),))
    stored = SimpleNamespace(index=1, submesh=(8, 1), placements=parameters, collectives=())
    dense = SimpleNamespace(index=2, submesh=(8, 1), placements=(("layers.*.attention.wq.weight", "(R, R)"),),
                            collectives=())
    plan = SimpleNamespace(model="moe-tiny", seq=32, config=ParallelConfig(dp=8, pp=3), cluster="h100:3x8",
                           intra_op_info=None, stages=(stage, stored, dense))
    _, ep, zero3 = routing_lines(plan)
    assert ep.startswith("  routed experts (stage 0): split 8 ways on E over dp") and "64 all-to-alls" in ep, ep
    assert zero3.startswith("  routed experts (stage 1): not split on E") and "ZeRO-3 storage" in zero3, zero3
    from autopar.explain import summarize_placements

    (moved,) = summarize_placements(parameters, tokens_move_over_dp=True)
    assert "S(0) over dp (expert parallelism" in moved, moved
    (kept,) = summarize_placements(parameters)
    assert "S(0) over dp (sharded: ZeRO-3)" in kept, kept


def test_whole_experts_say_why():
    lines = routing_lines(_plan("moe-tiny", ParallelConfig(dp=4), "(R, R)"))
    assert "not split on E for compute" in lines[1] and "cheaper than sending the tokens" in lines[1], lines


def test_dense_and_user_models_get_no_routing_lines():
    assert routing_lines(_plan("gpt-tiny", ParallelConfig(dp=4), "(R, R)")) == []
    assert routing_lines(_plan("not-a-model-anyone-has", ParallelConfig(dp=4), "(R, R)")) == []


def test_the_layer_group_summary_names_the_expert_split():
    from autopar.explain import summarize_placements

    (line,) = [g for g in summarize_placements([(name, "(R, S(0))") for name in EXPERTS])]
    assert line.startswith("routed experts (3 params): experts over tp (E split")
    (dense,) = summarize_placements([("layers.*.feed_forward.w1.weight", "(R, S(0))")])
    assert "column over tp" in dense  # a 2-D linear's dim 0 is still its output features


def test_grouped_matmuls_say_where_the_experts_run():
    """Models whose experts run through autopar/grouped_mm.py's op (Hugging Face MoE): the
    forward op's weights layout read off the recorded placements says expert parallelism,
    a split inside each expert, or weights whole and why; nothing without such ops."""
    from autopar.commands.explain import grouped_lines
    from autopar.ir import GROUPED_MM_FWD
    from autopar.plan import OpPlacement, StagePlacements

    def plan(weights: str, op: str = GROUPED_MM_FWD, rows: str = "(R, R)") -> SimpleNamespace:
        row = OpPlacement(key="L0.96", op=op, outputs=("(R, P)",), inputs=(rows, weights, rows, weights))
        return SimpleNamespace(placements=(StagePlacements(chunk=0, placements=(row,)),))

    (ep,) = grouped_lines(plan("(R, S(0))"))
    assert "expert parallelism over tp" in ep and "over dp" not in ep and "dropless" in ep
    (inside,) = grouped_lines(plan("(R, S(2))"))
    assert "split inside each expert over tp (S(2))" in inside
    (whole,) = grouped_lines(plan("(R, R)"))
    assert "weights whole" in whole and "priced" in whole and "own tokens" not in whole
    (data_parallel,) = grouped_lines(plan("(R, R)", rows="(S(0), R)"))
    assert "weights whole" in data_parallel and "the rows split over dp)" in data_parallel
    (ep_dp,) = grouped_lines(plan("(R, S(0))", rows="(S(0), R)"))
    assert "expert parallelism over tp" in ep_dp and "the rows split over dp)" in ep_dp
    assert grouped_lines(plan("(R, S(0))", op="aten.mm.default")) == []
