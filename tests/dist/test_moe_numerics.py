"""The zoo's mixture of experts on real gloo ranks: experts sharded by the ILP, trained like one process.

World 4, mesh (dp 2, tp 2) from the forced configuration `--dp 2 --tp 2` (solver/forced.py).
The model (autopar/models/moe.py) dispatches GShard-style: routing masks from topk,
one_hot and cumsum, dispatch `einsum('gsec,gsm->egcm')`, experts as batched matmuls over
the expert dim e, combine `einsum('gsec,egcm->gsm')`. On this mesh the ILP splits the
expert weights [E, d, f] on e over the tp axis: expert parallelism over that axis, each
rank computing its own experts' slots. How the tokens reach them is the ILP's choice: on
gloo DTensor runs an all-to-all as an all-gather and a local chunk, priced so, so
gathering the whole is no dearer there than an all-to-all (the all-to-alls of a GPU
mesh's program are checked against their price in tests/unit/test_moe.py).
3 AdamW steps, 2 microbatches per step: losses equal the single-process reference (rtol
1e-4), parameters stay close (atol 1e-3), and the collectives each rank's program runs
per step (kind, mesh axis, calls, bytes) equal those the ILP priced. A second
configuration is expert parallelism over the
data-parallel ranks beside ZeRO-1 (`--dp 4 --zero 1 --ep 4`, the layout Megatron-Core and
torchtitan run): the ILP stores the experts split on e over dp (solver/forced.py
`expert_stack`), the dense weights whole with their update sharded, and moves the token
slots from their batch split to the expert split and back (the dispatch and combine
all-to-alls, solver/intra_op/restrict.py `exchange_nodes`). A third is that layout with
tensor parallelism inside (`--dp 2 --tp 2 --ep 2 --zero 1`): the experts stored split on e
over dp whatever the ILP does with tp. The same four-rank spawn runs all three.

On eight ranks, one pipeline with expert parallelism in its stages (`--pp 2 --dp 2 --tp 2
--ep 2 --zero 1`): each stage, one MoE layer on a (dp 2, tp 2) submesh, stores its experts
split on e over its dp axis, each layer's load-balance loss crosses the stage boundary to
the loss in the last stage, and the losses and parameters match the reference likewise.
"""

from __future__ import annotations

import copy

import pytest
import torch

from autopar.batch import batch_size, rows as batch_rows
from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.models import resolve
from autopar.placement import Shard
from autopar.build import train_worker
from autopar.build.chunks import trace_chunks
from autopar.placing import priced_per_step, solve_config
from autopar.ir import Graph
from autopar.plan import OpPlacement, ProgramPlacements
from autopar.runtime.jobs import TrainJob, reference_run
from autopar.runtime.launch import spawn
from autopar.trace import trace_step
from tests.parallel import place_jobs

pytestmark = pytest.mark.dist

MODEL = "moe:layers=2,hidden=64,heads=4,kv_heads=2,vocab=128,seq=16,experts=4,top_k=2,expert_ffn=48"
CONFIG = ParallelConfig(dp=2, tp=2, micro_batch=2)
EP_OVER_DP = ParallelConfig(dp=4, zero=1, ep=4, micro_batch=1)
"""Four ranks, data parallel with ZeRO-1: each rank holds one expert of each layer."""
EP_TP = ParallelConfig(dp=2, tp=2, ep=2, zero=1, micro_batch=2)
"""Expert parallelism over dp with tensor parallelism inside: the experts stored split on e
over dp, the tp axis the ILP's to use."""
PIPELINE_EP = ParallelConfig(pp=2, dp=2, tp=2, ep=2, zero=1, micro_batch=1)
"""Eight ranks: two stages of one MoE layer each, each on a (dp 2, tp 2) submesh storing its
experts split on e over its dp axis; each layer's load-balance loss is added to the
training loss in the last stage, so it crosses the stage boundary."""
PIPELINE_EP_BATCH = 4
"""The smallest global batch PIPELINE_EP runs as a pipeline: two microbatches of dp rows."""
BATCH = 8
EXPERT_WEIGHTS = ("moe.w1", "moe.w3", "moe.w2")
"""The routed experts' weights, [E, d, f] / [E, f, d], under each layer's module path."""


def _worker(rank: int, job: TrainJob) -> list:
    return train_worker(rank, job)


RUNS = {"dp2xtp2": CONFIG, "ep4_over_dp": EP_OVER_DP, "ep2xtp2": EP_TP}
"""The four-rank spawn's configurations, by the name the tests give them."""


@pytest.fixture(scope="module")
def run():
    """(per configuration name: every rank's RunResult; the reference's (losses,
    parameters); the job as placed)."""
    job, = place_jobs(TrainJob(model=MODEL, configs=tuple(RUNS.values()), steps=3, global_batch=BATCH,
                               return_parameters=True))
    results = spawn(_worker, 4, (job,))
    return {name: [r[i] for r in results] for i, name in enumerate(RUNS)}, reference_run(job), job


@pytest.fixture(scope="module")
def run_pipeline_ep():
    """PIPELINE_EP on eight ranks, as `run`: ({"pp2xep2xtp2": every rank's RunResult},
    the reference, the job)."""
    job, = place_jobs(TrainJob(model=MODEL, configs=(PIPELINE_EP,), steps=3, global_batch=PIPELINE_EP_BATCH,
                               return_parameters=True))
    results = spawn(_worker, 8, (job,))
    return {"pp2xep2xtp2": [r[0] for r in results]}, reference_run(job), job


def _chunks(job: TrainJob, which: int) -> list[tuple[Graph, dict[str, OpPlacement]]]:
    """Per chunk of configuration `which` of `job`: its graph as the ranks traced it (the
    step at one microbatch; a pipeline's chunks) and its placements by node key."""
    config = job.configs[which]
    chunks = {c.chunk: c for c in ProgramPlacements.loads(job.placements[which]).placements}
    source = resolve(MODEL)
    example = source.example_inputs(job.global_batch)
    if config.pp == 1:
        rows = config.dp * config.micro_batch
        graphs = [(0, trace_step(source.build(), batch_rows(example, 0, rows, batch_size(example)))[1])]
    else:
        graphs = [(stage.index, stage.graph) for stage in trace_chunks(source.build(), config, example)]
    return [(graph, {p.key: p for p in chunks[chunk].placements}) for chunk, graph in graphs]


def _stored(graph: Graph, by_key: dict[str, OpPlacement]) -> dict[str, OpPlacement]:
    """Each parameter's placement row in one chunk, by parameter name."""
    keys = graph.node_keys()
    return {n.param_name: by_key[keys[n.id]] for n in graph.nodes if n.op == "placeholder" and n.param_name}


def _check_experts_over_dp(stored: dict[str, OpPlacement]) -> None:
    """The `--ep` layout beside ZeRO-1: the routed experts stored split on e over dp (the
    mesh's first axis) with no update placement of their own, the dense weights whole over
    dp with their update sharded there."""
    for name, row in stored.items():
        if name.endswith(EXPERT_WEIGHTS) and ".shared." not in name:
            assert row.outputs[0].startswith("(S(0)") and row.update == "", (name, row)
        elif name.endswith("attention.wq.weight"):
            assert row.outputs[0].startswith("(R") and row.update.startswith("(S("), (name, row)


@pytest.fixture(scope="module")
def solved():
    """The traced step and the ILP's solution for CONFIG, as the job's placements are solved
    before its ranks start (autopar/placing.py place_job)."""
    source = resolve(MODEL)
    model = source.build()
    example = source.example_inputs(BATCH)
    rows = CONFIG.dp * CONFIG.micro_batch
    _, graph = trace_step(copy.deepcopy(model), batch_rows(example, 0, rows, batch_size(example)))
    return graph, solve_config(graph, CONFIG, Cluster.parse("cpu:1x4"), num_microbatches=BATCH // rows)


def test_experts_are_sharded_on_the_expert_dim(solved):
    graph, solution = solved
    chosen = {c.node: c for c in solution.choices}
    experts = {n.param_name: chosen[n.id].outputs[0] for n in graph.nodes
               if n.op == "placeholder" and n.param_name and n.param_name.endswith(EXPERT_WEIGHTS)}
    assert len(experts) == 2 * len(EXPERT_WEIGHTS), experts  # 2 layers
    for name, placements in experts.items():
        assert Shard(0) in placements, (name, placements)


@pytest.mark.parametrize("which", [*RUNS, "pp2xep2xtp2"])
def test_losses_and_parameters_match_the_reference(request, which):
    runs, (ref_losses, ref_params), _ = request.getfixturevalue("run" if which in RUNS else "run_pipeline_ep")
    per_rank = runs[which]
    losses = per_rank[0].losses
    assert len(losses) == 3 and all(r.losses == losses for r in per_rank), "every rank reports the same global loss"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    params = {}
    for r in per_rank:
        params.update(r.parameters)
    assert any(name.endswith(EXPERT_WEIGHTS) for name in params)
    assert params and set(params) <= set(ref_params)
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], atol=1e-3, rtol=0, msg=name)


def test_price_equals_run(run, solved):
    """Every rank's program runs per step the collectives the ILP priced, by (kind, mesh
    axis): calls and bytes; the solution inspected above is the one that ran (same priced
    collectives)."""
    runs, _, _ = run
    per_rank = runs["dp2xtp2"]
    graph, solution = solved
    microbatches = BATCH // (CONFIG.dp * CONFIG.micro_batch)
    assert priced_per_step(solution, microbatches, ("dp", "tp")) == per_rank[0].priced
    for rank, r in enumerate(per_rank):
        assert r.priced is not None and r.collectives, f"rank {rank}"
        assert r.collectives == r.priced, f"rank {rank}"


def test_experts_over_dp_run_where_their_tokens_are_sent(run):
    """Under EP_OVER_DP the program each rank ran computes every expert matmul, forward and
    backward, on its own expert (the stacked weight and the token slots split on e over dp:
    no weight gathered), and its collectives per step are those the ILP priced: on gloo
    each dispatch or combine runs as an all-gather of the slots and a local chunk."""
    runs, _, job = run
    (graph, by_key), = _chunks(job, list(RUNS).index("ep4_over_dp"))
    keys = graph.node_keys()
    expert_matmuls = [n for n in graph.nodes if n.op == "aten.bmm.default" and any(  # f = 48: experts only
        48 in shape for shape in (n.output.shape, *(graph[i].output.shape for i in n.inputs)))]
    assert len(expert_matmuls) == 2 * 3 * 3, len(expert_matmuls)  # 2 layers x (w1, w3, w2) x (fwd, dgrad, wgrad)
    for n in expert_matmuls:
        inputs = by_key[keys[n.id]].inputs
        assert all(layout.startswith("(S(0)") for layout in inputs), (n.name, inputs)
    _check_experts_over_dp(_stored(graph, by_key))
    for rank, r in enumerate(runs["ep4_over_dp"]):
        assert r.priced is not None and r.collectives == r.priced, f"rank {rank}"
        assert any(kind == "all_gather" for kind, _ in r.collectives), r.collectives


@pytest.mark.parametrize("which", ["ep2xtp2", "pp2xep2xtp2"])
def test_experts_stay_split_over_dp_beside_tp_and_stages(request, which):
    """`--ep` composes with tp and pipeline stages: under EP_TP, and in every stage of
    PIPELINE_EP, both layers' routed experts are stored split on e over dp (whatever tp
    adds) and the dense weights whole over dp, update sharded (ZeRO-1); every rank's
    collectives per step are those its ILP solutions priced."""
    runs, _, job = request.getfixturevalue("run" if which in RUNS else "run_pipeline_ep")
    which_config = list(RUNS).index(which) if which in RUNS else 0
    stored: dict[str, OpPlacement] = {}
    for graph, by_key in _chunks(job, which_config):
        chunk = _stored(graph, by_key)
        assert any(name.endswith(EXPERT_WEIGHTS) for name in chunk), "every chunk holds one MoE layer"
        stored.update(chunk)
    assert sum(name.endswith(EXPERT_WEIGHTS) and ".shared." not in name for name in stored) == 2 * 3, stored
    _check_experts_over_dp(stored)
    for rank, r in enumerate(runs[which]):
        assert r.priced is not None and r.collectives == r.priced, f"rank {rank}"
