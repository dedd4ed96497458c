"""Model zoo: published parameter counts, spec strings, factories and their errors."""

import pytest

from autopar.models import PRESETS, parse_spec, resolve
from autopar.models.gpt import GPTConfig
from autopar.models.llama import LlamaConfig
from autopar.trace import trace_model

# Published sizes: Llama 3 model cards / paper Table 3 (8.03B, 70.6B, 405.9B; tied nothing);
# GPT-3 175B from Megatron SC'21 eq. 2 with V=51200, s=2048 (174.6B); GPT-2 small 124M.
PUBLISHED = {
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "llama3-405b": 405.9e9,
    "gpt3-175b": 12 * 96 * 12288**2 * (1 + 13 / (12 * 12288) + (51200 + 2048) / (12 * 96 * 12288)),
    "gpt2": 124e6,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_match_published(name):
    graph = trace_model(resolve(name).with_overrides(seq=128), batch=1, layers_traced=2)
    # seq only changes learned position embeddings (GPT): put the preset's back in
    seq_params = 0
    if isinstance(PRESETS[name], GPTConfig):
        seq_params = (PRESETS[name].seq - 128) * PRESETS[name].hidden
    count = graph.model.num_parameters + seq_params
    assert abs(count - PUBLISHED[name]) / PUBLISHED[name] < 0.01, (name, count)


def test_full_and_layer_scaled_traces_agree():
    source = resolve("llama:layers=6,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=16")
    full = trace_model(source, batch=2)
    scaled = trace_model(source, batch=2, layers_traced=2)
    assert full.model.num_parameters == scaled.model.num_parameters
    assert full.flops_per_step == scaled.flops_per_step
    assert scaled.layer_groups[0].multiplicity == 6 and len(scaled.layer_groups[0].layers) == 2


def test_spec_strings_parse():
    cfg = parse_spec("llama:layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=128256,seq=8192")
    assert cfg == PRESETS["llama3-70b"]
    gpt = parse_spec("gpt:layers=96,hidden=12288,heads=96,vocab=51200,seq=2048")
    assert gpt == PRESETS["gpt3-175b"]


@pytest.mark.parametrize(
    "spec, phrase",
    [
        ("gpt:layers=2,hidden=64,heads=4,vocab=256,seq=32,dropout=0.1", "unknown key 'dropout'"),
        ("gpt:layers=2,hidden=64,heads=5,vocab=256,seq=32", "not divisible by heads=5"),
        ("llama:layers=2,hidden=64,heads=4,kv_heads=3,vocab=256,seq=32", "not divisible by kv_heads=3"),
        ("gpt:layers=2,hidden=64,heads=4,vocab=256", "missing seq"),
        ("gpt:layers=0,hidden=64,heads=4,vocab=256,seq=32", "layers must be a positive integer"),
        ("gpt:layers=two,hidden=64,heads=4,vocab=256,seq=32", "not a valid number"),
        ("bert:layers=2", "unknown model family 'bert'"),
        ("no-such-model", "unknown model 'no-such-model'"),
        ("nonexistent_pkg.models:make", "cannot import module 'nonexistent_pkg.models'"),
        ("autopar.models.zoo:no_such_function", "has no callable 'no_such_function'"),
    ],
)
def test_bad_model_names_say_what_is_wrong(spec, phrase):
    with pytest.raises(ValueError, match=phrase.replace("(", r"\(").replace(")", r"\)")):
        resolve(spec)


def test_factory_models_trace(tmp_path, monkeypatch):
    (tmp_path / "my_factory.py").write_text(
        "import torch\n"
        "def make():\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))\n"
        "    class WithLoss(torch.nn.Module):\n"
        "        def __init__(self):\n"
        "            super().__init__(); self.net = model\n"
        "        def forward(self, x, y):\n"
        "            return torch.nn.functional.mse_loss(self.net(x), y)\n"
        "    return WithLoss(), (torch.randn(4, 8), torch.randn(4, 1))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = trace_model(resolve("my_factory:make"), batch=4)
    assert graph.model.num_parameters == 8 * 16 + 16 + 16 + 1
    assert graph.flops_per_step > 0
    assert len(graph.param_grads) == 4


def test_llama_config_defaults():
    cfg = LlamaConfig(layers=1, hidden=4096, heads=32, vocab=10, seq=8)
    assert cfg.ffn_hidden == 11008  # Llama 2 7B's SwiGLU size from the 2/3 * 4h rule
    assert cfg.num_kv_heads == 32
