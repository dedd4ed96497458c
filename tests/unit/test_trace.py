"""Tracer and IR: FLOPs against the analytic transformer formulas, layer groups, roles,
Hugging Face models, and the errors a user sees for models that cannot be traced."""

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from autopar.ir import Phase, Role
from autopar.models import resolve
from autopar.trace import TraceError, lower, trace, trace_model


def gpt_model_flops(b, s, l, h, v):
    """Korthikanti et al. App. A eq. 7: model FLOPs per step, ffn = 4h, no recompute."""
    return 72 * b * l * s * h * h * (1 + s / (6 * h) + v / (12 * h * l))


def llama_model_flops(b, s, l, h, heads, kv_heads, ffn, v):
    """Megatron-Core's per-layer terms (GQA q/k/v/o, SwiGLU x3/2, logits), forward x3, with
    full (not causal-discounted) attention scores, as torchtitan counts 12*l*h*s per token."""
    t = b * s
    attn_linear = 4 * t * h * (h + h * kv_heads / heads)
    attn_core = 4 * t * s * h
    mlp = 6 * t * h * ffn
    logits = 2 * t * h * v
    return 3 * (l * (attn_linear + attn_core + mlp) + logits)


@pytest.mark.parametrize("name, batch", [("gpt3-1.3b", 2), ("gpt3-175b", 1), ("gpt2", 4)])
def test_gpt_flops_match_analytic(name, batch):
    source = resolve(name)
    c = source.config
    graph = trace_model(source, batch=batch, dtype="bfloat16", layers_traced=2)
    expected = gpt_model_flops(batch, c.seq, c.layers, c.hidden, c.vocab)
    assert abs(graph.flops_per_step - expected) / expected < 0.02


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "llama3-405b"])
def test_llama_flops_match_analytic(name):
    source = resolve(name).with_overrides(seq=4096)
    c = source.config
    graph = trace_model(source, batch=1, dtype="bfloat16", layers_traced=2)
    expected = llama_model_flops(1, c.seq, c.layers, c.hidden, c.heads, c.num_kv_heads, c.ffn_hidden, c.vocab)
    assert abs(graph.flops_per_step - expected) / expected < 0.02
    # and the 6*N*T rule of thumb is within the attention share of it
    six_nt = 6 * graph.model.num_parameters * c.seq
    assert 0.6 < six_nt / graph.flops_per_step < 1.0


@pytest.mark.parametrize("name", ["gpt-small", "llama-small"])
def test_uniform_model_is_one_layer_group(name):
    graph = trace_model(resolve(name), batch=2)
    layers = resolve(name).config.layers
    assert len(graph.layer_groups) == 1
    group = graph.layer_groups[0]
    assert group.multiplicity == layers and group.layers == tuple(range(layers))
    assert len({len(nodes) for nodes in group.nodes}) == 1
    # aligned positions hold the same op in every layer
    for pos in range(len(group.nodes[0])):
        assert len({graph[nodes[pos]].op for nodes in group.nodes}) == 1


def test_roles_phases_and_gradients():
    graph = trace_model(resolve("llama-tiny"), batch=2)
    params = graph.by_role(Role.PARAMETER)
    assert len(params) == len(graph.param_grads) == 2 * 9 + 3
    loss = graph[graph.loss]
    assert loss.output.shape == () and loss.phase is Phase.FORWARD
    for pid, gid in graph.param_grads:
        assert graph[pid].output.shape == graph[gid].output.shape
        assert graph[gid].phase is Phase.BACKWARD and graph[gid].role is Role.GRADIENT
        assert graph[gid].param_name == graph[pid].param_name
    mm = [n for n in graph if n.op == "aten.mm.default"]
    assert all(n.flops > 0 and n.bytes_moved > 0 for n in mm)
    assert all(n.bytes_moved == 0 for n in graph if n.is_view)
    assert {n.layer for n in graph if n.module_path.startswith("layers.1")} == {1}


def test_attention_ops_and_causal_flag_match_torch_schemas():
    """ir.py is the one home of the fused attention ops and of where `is_causal` sits in
    each; checked against torch's own schemas, and read from a traced causal model."""
    from autopar import ir

    assert set(ir._IS_CAUSAL_POSITION) == ir.ATTENTION_OPS
    for op, position in ir._IS_CAUSAL_POSITION.items():
        _, name, overload = op.split(".")
        schema = getattr(getattr(torch.ops.aten, name), overload)._schema
        assert [a.name for a in schema.arguments].index("is_causal") == position, op
        assert name.endswith("_backward") == (op in ir.ATTENTION_BWD_OPS)
    graph = trace_model(resolve("llama-tiny"), batch=2)
    attention = [n for n in graph if n.op in ir.ATTENTION_OPS]
    assert len(attention) == 4 and all(n.is_causal for n in attention)  # 2 layers, forward + backward
    assert not any(n.is_causal for n in graph if n.op not in ir.ATTENTION_OPS)
    fwd = attention[0]
    args = list(fwd.args)
    args[ir._IS_CAUSAL_POSITION[fwd.op]] = False
    assert not ir.Node(**{**{f: getattr(fwd, f) for f in fwd.__dataclass_fields__}, "args": tuple(args)}).is_causal
    keyword = {**{f: getattr(fwd, f) for f in fwd.__dataclass_fields__}, "args": fwd.args[:3],
               "kwargs": (("is_causal", True),)}
    assert ir.Node(**keyword).is_causal


def test_graph_is_frozen_and_fingerprint_is_stable():
    a = trace_model(resolve("gpt-tiny"), batch=2)
    b = trace_model(resolve("gpt-tiny"), batch=2)
    c = trace_model(resolve("gpt-tiny"), batch=4)
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
    with pytest.raises(AttributeError):
        a.nodes[0].op = "x"  # type: ignore[misc]
    # tied embedding: one tensor, two names: one graph input whose gradient sums both uses
    params = [n.param_name for n in a.by_role(Role.PARAMETER)]
    assert "wte.weight" in params and "lm_head.weight" not in params and not a.tied_params
    assert a.model.num_parameters == sum(p.numel() for p in resolve("gpt-tiny").build().parameters())
    (grad,) = [g for p, g in a.param_grads if a[p].param_name == "wte.weight"]
    assert a[grad].op == "aten.add.Tensor"


def test_fake_trace_allocates_nothing_for_a_huge_model():
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    graph = trace_model(resolve("llama3-405b").with_overrides(seq=2048), batch=1, layers_traced=2)
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20
    assert graph.model.num_parameters > 400e9
    assert grown_gib < 2.0


# ----------------------------------------------------------------------------- errors


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x, y):
        return ((self.gate(self.inner(x)) - y) ** 2).mean()


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent branch: cannot be traced on fake tensors
            return x * 2
        return x


def test_data_dependent_control_flow_names_module_and_op():
    with pytest.raises(TraceError) as info:
        trace(Branchy(), (torch.randn(2, 4), torch.randn(2, 4)))
    msg = str(info.value)
    assert "data-dependent control flow" in msg and "'gate'" in msg and "aten." in msg


def test_model_without_loss_is_refused():
    model = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(TraceError, match="not a scalar loss.*loss_fn"):
        trace(model, (torch.randn(2, 4),))
    # with a loss_fn it traces; the last example input is the target
    traced = trace(model, (torch.randn(2, 4), torch.randn(2, 3)), loss_fn=nn.functional.mse_loss)
    graph = lower(traced, name="mlp", batch=2, seq=1)
    assert len(graph.param_grads) == 2


def test_model_without_parameters_is_refused():
    class Empty(nn.Module):
        def forward(self, x):
            return x.sum()

    with pytest.raises(TraceError, match="no parameters"):
        trace(Empty(), (torch.randn(2),))


def test_hf_models_trace_through_the_same_entry_point():
    transformers = pytest.importorskip("transformers", reason="transformers not installed (extra 'hf')")
    torch.manual_seed(0)
    models = [
        transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64)),
        transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=128, max_position_embeddings=64)),
    ]
    for model in models:
        ids = torch.randint(0, 128, (2, 16))
        graph = lower(trace(model, (), example_kwargs={"input_ids": ids, "labels": ids}),
                      name=type(model).__name__, batch=2, seq=16)
        assert graph.model.num_parameters == sum(p.numel() for p in model.parameters())
        assert len(graph.layer_groups) == 1 and graph.layer_groups[0].multiplicity == 3
        assert graph[graph.loss].output.shape == ()


def test_numbered_module_dict_is_the_layer_list():
    """torchtitan keeps its blocks in a ModuleDict keyed "0", "1", ...: the tracer must find
    them as the repeated layers (else a searched plan has stage_layers for 0 layers)."""

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 16)
            self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for i in range(3)})
            self.head = nn.Linear(16, 32)

        def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens)
            for layer in self.layers.values():
                h = h + layer(h)
            return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())

    tokens = torch.randint(0, 32, (2, 8))
    traced = trace(Blocks(), (tokens, tokens))
    assert (traced.layer_prefix, traced.num_layers) == ("layers", 3)
    graph = lower(traced, name="Blocks", batch=2, seq=8)
    assert len(graph.layer_groups) == 1 and graph.layer_groups[0].multiplicity == 3


def test_cli_trace_json_and_bad_input():
    out = subprocess.run([sys.executable, "-m", "autopar.cli", "trace", "gpt-tiny", "--json"],
                         capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    for key in ("num_parameters", "flops_per_step", "num_nodes", "layer_groups", "trace_time_s"):
        assert key in data
    assert data["layer_groups"][0]["multiplicity"] == 2
    bad = subprocess.run([sys.executable, "-m", "autopar.cli", "trace", "gpt:layers=2,hidden=64,heads=5,vocab=8,seq=4"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "not divisible by heads=5" in bad.stderr
    flag = subprocess.run([sys.executable, "-m", "autopar.cli", "trace", "gpt-tiny", "--seq", "-3"],
                          capture_output=True, text=True)
    assert flag.returncode == 2 and "positive integer" in flag.stderr


def test_segments_are_stamped_and_a_wrapper_module_does_not_move_the_head_to_pre():
    """lower() stamps Node.segment once (benchmarks/baselines/analytic/profile.py and the template solver read
    it). A module wrapping the whole model (Hugging Face models under `hf.`) must not make
    every non-layer node "pre": the wrapped model's segments are the bare model's."""

    class Wrapper(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.inner(tokens, labels)

    source = resolve("gpt-tiny")
    tokens, labels = source.example_inputs(2)
    torch.manual_seed(0)
    bare, wrapped = (lower(trace(m, (tokens, labels)), name="g", batch=2, seq=32)
                     for m in (source.build(), Wrapper(source.build())))
    segments = [n.segment for n in bare.nodes]
    assert [n.segment for n in wrapped.nodes] == segments
    by_param = {n.param_name: n.segment for n in bare.nodes if n.role is Role.PARAMETER}
    assert by_param["wte.weight"] == "pre" and by_param["ln_f.weight"] == "post"
    assert all(s == "layer" for n, s in zip(bare.nodes, segments) if n.layer is not None)
    head = [n for n in bare.nodes if n.op == "aten.mm.default" and n.layer is None and n.phase is Phase.FORWARD]
    assert head and all(n.segment == "post" for n in head)


TINY_LLAMA = "llama:layers=3,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=32"


@pytest.mark.parametrize("spec,recompute", [(TINY_LLAMA, "none"), (TINY_LLAMA, "full"), ("gpt-tiny", "selective")])
def test_a_trace_extrapolated_from_two_batches_equals_the_trace(spec, recompute):
    """autopar.ir.extrapolate_batch (what the search uses instead of re-tracing at every
    microbatch) gives exactly the graph the tracer gives: every node, shape, stride,
    argument, FLOP and byte count, and the layer signatures."""
    import dataclasses

    from autopar.ir import extrapolate_batch

    src = resolve(spec)
    two, four = (trace_model(src, batch=b, recompute=recompute) for b in (2, 4))
    for batch in (6, 8, 32):
        got = extrapolate_batch(two, four, batch)
        want = dataclasses.replace(trace_model(src, batch=batch, recompute=recompute), trace_time_s=0.0)
        assert got is not None and got.model.batch == batch
        assert got == want
        assert [g.signature for g in got.layer_groups] == [g.signature for g in want.layer_groups]
        assert got.flops_per_step == want.flops_per_step


def test_extrapolation_refuses_what_is_not_a_batch_scaling():
    from autopar.ir import extrapolate_batch

    two, four = (trace_model(resolve(TINY_LLAMA), batch=b) for b in (2, 4))
    other_seq = trace_model(resolve(TINY_LLAMA.replace("seq=32", "seq=48")), batch=4)
    one = trace_model(resolve(TINY_LLAMA), batch=1)
    assert extrapolate_batch(two, other_seq, 8) is None  # the sequence changed, not only the batch
    assert extrapolate_batch(one, two, 8) is None  # a one-sequence trace is not a base
    assert extrapolate_batch(two, four, 5) is None  # not a multiple of the base batch
    assert extrapolate_batch(two, four, 4) is four


def test_the_search_extrapolates_only_models_marked_batch_scaling():
    """solver/spmd_search.py traced: a zoo trace_at (a BatchScalingTracer) is traced at 2 and 4
    sequences and extrapolated to 8 and 16, equal to their traces; an unmarked one (a user
    module may branch on its batch) is traced at every microbatch."""
    import dataclasses

    from solver.spmd_search import BatchScalingTracer, traced

    src = resolve(TINY_LLAMA)
    calls: list[int] = []

    def trace_at(rows, recompute="none"):
        calls.append(rows)
        return trace_model(src, batch=rows, recompute=recompute)

    graphs: dict = {}
    got = [traced(graphs, trace_at, g) for g in (8, 16)]
    assert calls == [8, 16]
    calls.clear()
    graphs = {}
    got_scaled = [traced(graphs, BatchScalingTracer(trace_at), g) for g in (8, 16)]
    assert calls == [2, 4]
    assert got_scaled == [dataclasses.replace(g, trace_time_s=0.0) for g in got]


def test_full_recompute_re_runs_fused_attention_without_dropout():
    """ATen tags the fused attention kernels as random (their dropout_p argument). At
    dropout_p = 0 they draw nothing, so "full" recomputes them like every other op of the
    layer (the flops grow by one attention forward per layer; "selective" keeps them);
    with dropout they stay unrecomputed, as every random op does."""
    from autopar.ir import ATTENTION_FWD_OPS
    from autopar.recompute import _is_random

    src = resolve("gpt:layers=2,hidden=64,heads=4,vocab=128,seq=256")
    graphs = {rc: trace_model(src, batch=1, recompute=rc) for rc in ("none", "full", "selective")}

    def attention(graph, phase):
        return sum(1 for n in graph.nodes if n.op in ATTENTION_FWD_OPS and n.phase is phase)

    assert attention(graphs["none"], Phase.BACKWARD) == attention(graphs["selective"], Phase.BACKWARD) == 0
    assert attention(graphs["full"], Phase.BACKWARD) == attention(graphs["full"], Phase.FORWARD) == 2
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    g = torch.fx.Graph()
    q = g.placeholder("q")
    for args, kwargs, random in (((q, q, q), {}, False), ((q, q, q, 0.0, True), {}, False),
                                 ((q, q, q, 0.1), {}, True), ((q, q, q), {"dropout_p": 0.1}, True)):
        assert _is_random(g.call_function(op, args, kwargs)) is random
    assert _is_random(g.call_function(torch.ops.aten.native_dropout.default, (q, 0.0, True)))


@pytest.mark.parametrize("spec", ["moe-tiny"])
def test_a_policy_rewritten_on_a_captured_copy_equals_its_own_trace(spec):
    """trace_model with a `captured` memo (the search's zoo tracer) captures the joint graph
    once per batch and rewrites a copy per recompute policy: each lowered graph equals the
    one a fresh trace under that policy gives, node for node, and the captured graph itself
    is left as captured (the "none" graph after the rewrites equals a fresh "none" trace)."""
    import dataclasses

    src = resolve(spec)
    captured: dict = {}
    got = {rc: trace_model(src, batch=2, recompute=rc, captured=captured) for rc in ("full", "none")}
    assert len(captured) == 1
    for rc, graph in got.items():
        want = trace_model(src, batch=2, recompute=rc)
        assert dataclasses.replace(graph, trace_time_s=0.0) == dataclasses.replace(want, trace_time_s=0.0), rc
    assert len(got["full"].nodes) > len(got["none"].nodes)
