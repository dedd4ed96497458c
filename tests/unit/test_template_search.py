"""The template grid (benchmarks/baselines/template/search.py), a baseline: its best plan
equals brute force on small cases (toy and analytic cost models), pruning never changes the
answer, infeasible requests report the exact smallest memory, and the ILP's per-layer-group
choices are recorded beside the template's."""

from __future__ import annotations

import itertools

import pytest

from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.plan import InfeasiblePlanError, Plan
from autopar.trace import trace_model
from benchmarks.baselines import analytic  # the baseline
from benchmarks.baselines.template.inter_op import stage_work
from benchmarks.baselines.template.search import SearchSpace, enumerate_candidates, search
from tests.toy_price import toy_price

SPEC = "llama:layers=6,hidden=1024,heads=8,kv_heads=4,ffn=2816,vocab=32000,seq=2048"


@pytest.fixture(scope="module")
def graph():
    return trace_model(resolve(SPEC), batch=1, dtype="bfloat16", layers_traced=2)


def _divisors(n):
    return [k for k in range(1, n + 1) if n % k == 0]


def _compositions(total, parts):
    for bars in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *bars, total)
        yield tuple(edges[i + 1] - edges[i] for i in range(parts))


def brute_force(graph, cluster, global_batch, price, *, max_micro_batch=10**9, all_cuts=True):
    """Every (tp, pp, dp, zero, b, schedule, v, recompute, cut) written out independently;
    with all_cuts, every composition of the layers (a superset of the planner's cuts)."""
    m_info, n = graph.model, cluster.num_devices
    best = None
    for tp, pp in itertools.product(_divisors(n), repeat=2):
        if n % (tp * pp) or cluster.devices_per_node % tp or m_info.heads % tp or pp > m_info.num_layers:
            continue
        if m_info.kv_heads % tp:  # key/value heads are split, never replicated
            continue
        dp = n // (tp * pp)
        if global_batch % dp:
            continue
        for b in _divisors(global_batch // dp):
            if b > max_micro_batch:
                continue
            m = global_batch // (dp * b)
            scheds = [("1f1b", 1)] if pp == 1 else [("gpipe", 1), ("1f1b", 1)] + [
                ("interleaved", v) for v in range(2, 9) if m % pp == 0 and m_info.num_layers % (pp * v) == 0]
            for (sched, v), zero, rc in itertools.product(scheds, (0, 1, 2, 3), ("none", "selective", "full")):
                cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=b, schedule=sched,
                                     interleave=v, recompute=rc)
                if v > 1 or not all_cuts:
                    cut_list = [tuple([m_info.num_layers // pp] * pp)] if v > 1 else []
                else:
                    cut_list = list(_compositions(m_info.num_layers, pp))
                for cuts in cut_list:
                    est = price(cfg, cuts)
                    if est.fits and (best is None or est.step_time_s < best[0] - 1e-15):
                        best = (est.step_time_s, cfg, cuts)
    return best


def _pricers(graph, cluster, global_batch):
    work = stage_work(graph)
    profile = analytic.profile_graph(graph)
    return {
        "toy": lambda cfg, cuts: toy_price(graph, cfg, cluster, global_batch=global_batch, stage_layers=cuts,
                                           work=work),
        "cost_model": lambda cfg, cuts: analytic.price_profile(profile, cfg, cluster, global_batch=global_batch,
                                                                 stage_layers=cuts),
    }


@pytest.mark.parametrize("pricer", ["toy", "cost_model"])
@pytest.mark.parametrize("cluster_spec, memory_gb, global_batch", [
    ("h100:1x8", None, 16),
    ("a100-40gb:2x4", 4.0, 32),
    ("h100:1x4", 2.5, 8),
])
def test_best_plan_equals_brute_force(graph, pricer, cluster_spec, memory_gb, global_batch) -> None:
    cluster = Cluster.parse(cluster_spec).with_memory_gb(memory_gb)
    price = _pricers(graph, cluster, global_batch)[pricer]
    oracle = brute_force(graph, cluster, global_batch, price)
    result = search(graph, cluster, global_batch=global_batch, price=price, model=SPEC, fingerprint="f",
                    cost_model_name=pricer)
    best = result.ranked[0]
    assert oracle is not None
    assert best.estimate.step_time_s == pytest.approx(oracle[0], rel=1e-12), (best.config, oracle)
    # every fitting candidate the planner pruned would not have beaten it
    assert result.plan.search.num_priced <= result.plan.search.num_candidates


def test_pruning_never_changes_the_answer(graph) -> None:
    cluster = Cluster.parse("a100-40gb:2x4").with_memory_gb(3.0)
    price = _pricers(graph, cluster, 32)["cost_model"]
    kw = dict(global_batch=32, price=price, model=SPEC, fingerprint="f", cost_model_name="c")
    pruned = search(graph, cluster, **kw)
    full = search(graph, cluster, space=SearchSpace(prune_memory=False, prune_dominated=False), **kw)
    assert pruned.plan.config == full.plan.config and pruned.plan.stage_layers == full.plan.stage_layers
    assert pruned.plan.search.num_priced < full.plan.search.num_priced


def test_infeasible_request_reports_the_exact_smallest_memory(graph) -> None:
    cluster = Cluster.parse("h100:1x2").with_memory_gb(0.05)
    price = _pricers(graph, cluster, 4)["cost_model"]
    with pytest.raises(InfeasiblePlanError, match="No plan fits 0.05 GiB/device") as info:
        search(graph, cluster, global_batch=4, price=price, model=SPEC, fingerprint="f", cost_model_name="c")
    space = enumerate_candidates(graph, stage_work(graph), cluster, 4, SearchSpace())
    oracle = min(int(price(c.config, c.stage_layers).peak_memory_bytes) for c in space)
    assert info.value.min_memory_bytes == oracle
    assert "add devices" in str(info.value) and "--memory-gb" in str(info.value)


def test_ilp_intra_op_choices_are_recorded_and_memoised() -> None:
    from benchmarks.baselines.template.layer_groups import ilp_intra_op

    graph = trace_model(resolve("gpt-tiny"), batch=2, dtype="float32")
    cluster = Cluster.parse("h100:1x4")
    price = _pricers(graph, cluster, 8)["cost_model"]
    cache: dict = {}
    calls = []

    def intra(cfg):
        calls.append(cfg)
        return ilp_intra_op(graph, cluster, cfg, cache=cache)

    result = search(graph, cluster, global_batch=8, price=price, model="gpt-tiny", fingerprint="f",
                    cost_model_name="c", intra_op_fn=intra)
    c = result.plan.config
    ilp = [ch for ch in result.intra_op if ch.source == "ilp"]
    assert len(ilp) == len(graph.layer_groups) and ilp[0].submesh == (c.dp, c.tp)
    names = {n for n, _ in ilp[0].placements}
    assert "attn.qkv.weight" in names and len(names) == sum(
        1 for nid in graph.layer_groups[0].nodes[0] if graph[nid].role.value == "parameter")
    assert ilp[0].cost_s > 0
    assert Plan.loads(result.plan.dumps()) == result.plan
    assert "[ilp, ILP cost" in result.explain() and "not priced" in result.explain()
    assert "layer groups" not in result.plan.explain()  # the product's plan does not hold them
    again = ilp_intra_op(graph, cluster, c, cache=cache)
    assert again == tuple(ilp) and len(cache) == len(graph.layer_groups)
