"""The generic models of `benchmarks/serve.py`: what they are and that both load.

The benchmark itself (two live servers) is not run here; these check the
model it builds, at the shape the report names, and the memory ratio's
arithmetic.
"""

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from benchmarks import serve

#: A Qwen3-MoE of the benchmark's kind, small enough to build and load in a moment.
SMALL_QWEN3_MOE = {
    **serve.QWEN3_MOE,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}


def qwen3_moe_parameters(config: dict[str, int]) -> int:
    """Qwen3-MoE's parameter count from its shape (untied embeddings, every layer MoE)."""
    hidden, vocab, head = config["hidden_size"], config["vocab_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    experts, width = config["num_experts"], config["moe_intermediate_size"]
    attention = 2 * hidden * heads * head + 2 * hidden * kv_heads * head + 2 * head
    moe = hidden * experts + 3 * experts * hidden * width
    layer = attention + moe + 2 * hidden
    return 2 * vocab * hidden + hidden + config["num_hidden_layers"] * layer


def test_the_default_generic_model_is_the_issues_35_8m_qwen3_moe() -> None:
    # The count from the shape; the next test checks it against a built model.
    count = qwen3_moe_parameters(serve.QWEN3_MOE)
    assert round(count / 1e6, 1) == 35.8
    assert "35.8M parameters" in serve.describe(serve.QWEN3_MOE, count)
    assert serve.GENERIC["qwen3-moe"] is serve.QWEN3_MOE
    # The demo tokenizer's ids (0-1023) must all be rows of the embedding.
    tokenizer = json.loads((serve.DEMO_WEIGHTS / "tokenizer.json").read_text())
    assert max(tokenizer["model"]["vocab"].values()) < serve.QWEN3_MOE["vocab_size"]


def test_a_built_qwen3_moe_loads_through_mlxserve_with_its_parameters(tmp_path: Path) -> None:
    from mlxserve.models.loader import load

    out = serve.build_generic(tmp_path / "qwen3-moe", SMALL_QWEN3_MOE)
    assert json.loads((out / "config.json").read_text()) == SMALL_QWEN3_MOE
    model, tokenizer = load(str(out))
    arrays = tree_flatten(model.parameters())
    assert serve.parameter_count(model) == qwen3_moe_parameters(SMALL_QWEN3_MOE)
    assert {array.dtype for _, array in arrays} == {mx.float32}
    # What mlxserve reports as weights_bytes: float32, four bytes a parameter.
    assert sum(int(a.nbytes) for _, a in arrays) == 4 * qwen3_moe_parameters(SMALL_QWEN3_MOE)
    # The saved weights are the seeded random model's.
    reference = dict(tree_flatten(serve.random_model(SMALL_QWEN3_MOE).parameters()))
    for name, array in arrays:
        assert mx.array_equal(array, reference[name]), name
    ids = tokenizer.encode(serve.PROMPT)
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), SMALL_QWEN3_MOE["vocab_size"])


def test_a_vocabulary_smaller_than_the_demo_tokenizer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="1024"):
        serve.build_generic(tmp_path / "m", {**SMALL_QWEN3_MOE, "vocab_size": 512})


def _level(clients: int, memory: dict[str, int], before: dict[str, int] | None = None) -> dict:
    return {"clients": clients, "memory": memory, "memory_before": before}


def test_the_memory_ratio_counts_weights_caches_and_the_prefix_cache_apart() -> None:
    weights, cache = 1000, 10
    one = _level(1, {"weights_bytes": weights, "cache_bytes": cache, "busy_peak_bytes": 1015})
    # 8 rows held once (80), a prefix cache of 50 at the start that grew to 60 meanwhile.
    eight = _level(
        8,
        {"busy_peak_bytes": weights + 80 + 60, "prefix_cache_bytes": 60},
        {"prefix_cache_bytes": 50},
    )
    ratio = serve.memory_ratio([one, eight], 8)
    assert ratio is not None
    assert ratio["weights_plus_caches_bytes"] == 1080
    assert ratio["prefix_cache_bytes"] == 50
    assert ratio["ratio"] == round(1090 / 1080, 3)
    assert ratio["ratio_with_prefix_cache"] == round(1140 / 1080, 3)
    assert ratio["caches_ratio"] == round(90 / 80, 3)
    # The batch held twice for a moment shows in caches_ratio, hardly in ratio.
    eight["memory"]["busy_peak_bytes"] += 80
    doubled = serve.memory_ratio([one, eight], 8)
    assert doubled is not None and doubled["caches_ratio"] > 2 > 1.1 > doubled["ratio"]
    assert serve.memory_ratio([one], 8) is None
