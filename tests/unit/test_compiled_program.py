"""Inductor on the per-rank graphs (codegen/inductor.py), and a compiled program priced as
compiled.

- `compile_graph`: a graph runs Inductor's code from its first call on (equal results),
  its compile time recorded by label, its `.code` unchanged; a failed compile names the
  graph and says to run without --compile.
- `Graph.compiled` (ParallelConfig.compiled, `--compile`) scales memory-bound ops and views
  by Efficiency.compiled_memory_factor in the ILP's cost table and in the stage bounds,
  and leaves GEMMs and attention as they are; `autopar price --compile` records it in the
  plan, which round-trips through its JSON file.
The multi-rank programs, compiled and eager side by side: tests/dist/test_inductor.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopar.api import price
from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.ir import GEMM_OPS
from autopar.models import resolve
from autopar.plan import Plan
from cost_model import cost_table
from cost_model.efficiency import efficiency_for
from solver.intra_op.space import enumerate_strategies
from solver.stage_costs import lower_bound_s
from autopar.trace import trace_model

MODEL = "llama:layers=2,hidden=64,heads=4,vocab=128,seq=32"


@pytest.fixture(scope="module")
def graph():
    return trace_model(resolve(MODEL), batch=4, dtype="float32")


@pytest.mark.parametrize("spec", ["cpu:1x2", "h100:1x2"])
def test_memory_bound_ops_and_views_scale_by_the_compiled_factor(graph, spec):
    cluster = Cluster.parse(spec)
    factor = efficiency_for(cluster.hardware).compiled_memory_factor
    assert 0 < factor < 1
    space = enumerate_strategies(graph, (2,))
    eager = cost_table(graph, space, cluster)
    fused = cost_table(replace(graph, compiled=True), space, cluster)
    kinds = set()
    for node, a, b in zip(graph.nodes, eager.nodes, fused.nodes):
        for x, y in zip(a, b):
            assert y.memory_bytes == x.memory_bytes and y.comm_s == x.comm_s
            if node.op in GEMM_OPS:
                assert y.compute_s == x.compute_s
                kinds.add("gemm")
            elif x.compute_s > 0 and (node.is_view or node.flops == 0):
                assert y.compute_s == pytest.approx(factor * x.compute_s)
                kinds.add("view" if node.is_view else "memory")
    assert {"gemm", "memory"} <= kinds


def test_stage_bounds_stay_below_the_compiled_costs(graph):
    """The pipeline search's compute bounds scale the same ops (a bound of the compiled
    step must not exceed what the compiled step is priced at)."""
    cluster = Cluster.parse("cpu:1x2")
    eager = lower_bound_s(graph, cluster, 2)
    fused = lower_bound_s(replace(graph, compiled=True), cluster, 2)
    assert all(fused[p] <= eager[p] for p in eager) and sum(fused.values()) < sum(eager.values())


def test_a_batch_extrapolated_graph_stays_compiled():
    """The search prices large microbatches on a graph extrapolated from two traces
    (autopar.ir.extrapolate_batch): it keeps the traces' `compiled`, so those candidates
    are priced compiled too."""
    from autopar.ir import extrapolate_batch

    one, two = (replace(trace_model(resolve(MODEL), batch=b, dtype="float32"), compiled=True) for b in (2, 4))
    assert extrapolate_batch(one, two, 8).compiled
    assert extrapolate_batch(replace(one, compiled=False), replace(two, compiled=False), 8).compiled is False
    assert extrapolate_batch(one, replace(two, compiled=False), 8) is None


def test_price_compile_is_faster_and_recorded(tmp_path):
    config = ParallelConfig(dp=2)
    eager = price(MODEL, "cpu:2", config, global_batch=4)
    compiled = price(MODEL, "cpu:2", replace(config, compiled=True), global_batch=4)
    assert compiled.config.compiled and not eager.config.compiled
    assert compiled.predicted.step_time_s < eager.predicted.step_time_s
    path = tmp_path / "plan.json"
    compiled.save(str(path))
    assert Plan.load(str(path)).config.compiled


def _graph():
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        return (torch.nn.functional.silu(x @ w) * 2.0 + 1.0,)

    args = (torch.randn(4, 8), torch.randn(8, 8))
    return make_fx(f)(*args), args


def test_compile_graph_runs_inductor_code_and_times_it(tmp_path, monkeypatch):
    import torch

    from codegen.inductor import CompileTimes, compile_graph

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    gm, args = _graph()
    want = gm(*args)[0]
    times = CompileTimes()
    compile_graph(gm, "step", times)
    got = gm(*args)[0]
    torch.testing.assert_close(got, want)
    assert set(times.seconds) == {"step"} and times.total_s > 0
    assert "silu" in gm.code  # the graph itself is unchanged: what `.code` prints
    again = gm(*args)[0]  # compiled once
    torch.testing.assert_close(again, want)
    assert set(times.seconds) == {"step"}


def test_a_failed_compile_names_the_graph_and_the_way_out(monkeypatch):
    import torch._inductor.compile_fx as compile_fx

    from codegen.inductor import CompileError, CompileTimes, compile_graph

    def broken(*_args, **_kwargs):
        raise RuntimeError("C++ compile error: g++ not found")

    monkeypatch.setattr(compile_fx, "compile_fx", broken)
    gm, args = _graph()
    compile_graph(gm, "grad_sync", CompileTimes())
    with pytest.raises(CompileError, match=r"grad_sync graph \(RuntimeError: C\+\+ compile error.*without --compile"):
        gm(*args)
