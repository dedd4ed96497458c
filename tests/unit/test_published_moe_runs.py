"""The published mixture-of-experts runs (benchmarks/data/published_moe_runs.csv) parse into
pricing jobs: every row cites its source, builds a valid `moe:` model of the published sizes
and a configuration whose degrees multiply to the row's GPUs. No pricing here
(benchmarks/validate_moe.py prices them)."""

from __future__ import annotations

import csv

import pytest

from autopar.models.zoo import parse_spec
from benchmarks.lib.published_moe_runs import MOE_CSV, attention_heads, load_moe_runs, shard_degree, to_moe_run


@pytest.fixture(scope="module")
def rows() -> list[dict[str, str]]:
    with open(MOE_CSV, newline="") as f:
        return list(csv.DictReader(f))


def test_every_row_cites_a_source_and_parses(rows):
    assert len(rows) >= 10
    assert len({r["publication"] for r in rows}) >= 3
    for i, row in enumerate(rows):
        assert None not in row and None not in row.values(), f"row {i} has the wrong number of columns"
        assert row["url"].startswith("https://"), f"row {i}: url {row['url']!r}"
        assert row["publication"].strip() and row["source_id"].strip() and row["notes"].strip()
        assert float(row["reported_tokens_per_sec_per_gpu"]) > 0


def test_each_row_builds_a_valid_moe_model_of_its_sizes(rows):
    runs = load_moe_runs()
    assert [r.index for r in runs] == list(range(len(rows)))
    for run, row in zip(runs, rows):
        cfg = parse_spec(run.spec)
        assert (cfg.layers, cfg.hidden, cfg.vocab, cfg.seq) == tuple(
            int(row[k]) for k in ("layers", "hidden", "vocab", "seq_len"))
        assert (cfg.experts, cfg.top_k, cfg.ffn_hidden, cfg.shared_experts) == tuple(
            int(row[k]) for k in ("experts", "top_k", "expert_ffn", "shared_experts"))
        assert cfg.hidden % cfg.heads == 0 and cfg.heads % cfg.num_kv_heads == 0
        c = run.config
        assert c.tp * c.pp * c.dp == run.cluster.num_devices == int(row["gpus"])
        assert run.global_batch % (c.dp * c.micro_batch) == 0, f"row {run.index}: batch does not split"


def test_rows_the_headline_leaves_out_are_flagged(rows):
    runs = load_moe_runs()
    for run, row in zip(runs, rows):
        assert bool(run.flags) == (row["precision"] != "bf16" or "h800" in row["gpu_type"].lower())


def test_attention_heads_keep_hidden_and_an_even_head_size():
    assert attention_heads(4096, 64, 4, 128) == (64, 4)       # splits as published (head size 64)
    assert attention_heads(2880, 64, 8, 64) == (45, 5)        # 2880 / 64 = 45: odd size, so 45 heads of 64
    with pytest.raises(ValueError, match="splits neither"):
        attention_heads(2880, 64, 8, 0)


def test_a_row_without_a_source_is_rejected(rows):
    row = dict(rows[0], url="")
    with pytest.raises(ValueError, match="no url"):
        to_moe_run(0, row)


def test_expert_parallel_degree_is_the_product_of_the_axes_sharding_experts():
    # placements on the (dp, tp) axes of a (pp, dp, tp) = (1, 4, 2) mesh
    assert shard_degree("(S(0), S(0)) update (S(0), S(0))", (1, 4, 2)) == 8
    assert shard_degree("(R, S(0))", (1, 4, 2)) == 2
    assert shard_degree("(S(0), R) update (S(0), S(1))", (1, 4, 2)) == 4
    assert shard_degree("(R, S(1))", (1, 4, 2)) == 1


def test_priced_models_have_the_published_parameter_counts(rows):
    """Each distinct spec built with one layer under FakeTensorMode (nothing allocated):
    its layer scaled to the row's depth, plus embedding and head, is within 10% of the
    published total (the priced attention and the dense-as-MoE first layers move it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopar.models import resolve

    seen: dict[str, float] = {}
    for run, row in zip(load_moe_runs(), rows):
        if run.spec not in seen:
            cfg = parse_spec(run.spec)
            with FakeTensorMode():
                model = resolve(run.spec).build(layers=1)
            outside = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("layers."))
            layer = sum(p.numel() for p in model.layers[0].parameters())
            assert tuple(model.layers[0].moe.w1.shape) == (cfg.experts, cfg.hidden, cfg.ffn_hidden)
            seen[run.spec] = (outside + cfg.layers * layer) / 1e9
        assert seen[run.spec] == pytest.approx(float(row["params_b_total"]), rel=0.10), row["model"]
