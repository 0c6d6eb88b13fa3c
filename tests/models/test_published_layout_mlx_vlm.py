"""The published DeepSeek-V4 layout, proven against mlx-vlm's loader (test-only reference).

A tiny random DeepSeek-V4 (sliding, CSA with an indexer that selects a strict subset,
HCA, hash and routed MoE, YaRN on the compressed layers, one MTP block) is written by
``deepseek_v4.publish`` in DeepSeek's published names; mlx-vlm's loader (strict: every
tensor must land on a parameter) and mlxserve's both load that one directory, and
their logits and greedy tokens are compared.

mlx-vlm 0.7.10 drops the CSA overlap (the previous window's half of each entry) when
a window closes in a later call than the one before it (decode steps, chunked
prefill), so its CSA layers agree with mlxserve (and transformers) in a single
prefill only; greedy decoding is compared on a model whose compressed layers are HCA.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
mlx_vlm_utils = pytest.importorskip("mlx_vlm.utils", reason="mlx-vlm is the reference loader")

from mlx.utils import tree_flatten  # noqa: E402

from mlxserve.models.deepseek_v4 import Model, ModelArgs  # noqa: E402
from mlxserve.models.deepseek_v4.model import MTPBlock  # noqa: E402
from mlxserve.models.deepseek_v4.publish import published_config, published_weights  # noqa: E402
from mlxserve.models.loader import load_model  # noqa: E402

VOCAB = 96
BASE: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "head_dim": 32,
    "q_lora_rank": 32,
    "num_experts_per_tok": 2,
    "n_routed_experts": 4,
    "num_hash_layers": 1,
    "sliding_window": 16,
    "o_groups": 2,
    "o_lora_rank": 16,
    # 16 indexer heads: no ties in the top-k (see test_deepseek_v4_parity.py).
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 4,
    "hc_mult": 2,
    "qk_rope_head_dim": 8,
    "num_nextn_predict_layers": 1,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
}
ALL_KINDS = {**BASE, "compress_ratios": [0, 4, 128, 0]}
NO_CSA = {**BASE, "compress_ratios": [0, 128, 0, 0]}


def write_random_published(directory: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """A random model (with its MTP block) written in DeepSeek's published layout."""
    args = ModelArgs.from_dict(config)
    model = Model(args)
    model.mtp = [MTPBlock(args, t) for t in args.mtp_layer_types or []]
    mx.random.seed(seed)
    weights = []
    for name, value in tree_flatten(model.parameters()):
        if value.dtype == mx.int32:  # tid2eid
            weights.append((name, mx.random.randint(0, args.n_routed_experts, value.shape)))
        elif name.endswith("norm.weight"):
            weights.append((name, 1 + 0.1 * mx.random.normal(value.shape)))
        else:
            weights.append((name, 0.2 * mx.random.normal(value.shape)))
    model.load_weights(weights)
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), published_weights(model))
    config_json = published_config(args, {"bos_token_id": 0, "eos_token_id": 1})
    (directory / "config.json").write_text(json.dumps(config_json))
    return directory


def both(directory: Path) -> tuple[Any, Any]:
    """mlxserve's model and mlx-vlm's, from the same directory."""
    ours, _ = load_model(directory, memory_bytes=0)
    theirs = mlx_vlm_utils.load_model(directory)
    return ours, theirs


def prompt(length: int, seed: int = 1) -> Any:
    mx.random.seed(seed)
    return mx.random.randint(2, VOCAB, (1, length))


@pytest.fixture(scope="module")
def all_kinds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    directory = write_random_published(tmp_path_factory.mktemp("all-kinds"), ALL_KINDS)
    return (directory, *both(directory))


def test_published_names_are_the_ones_deepseek_ships(all_kinds: tuple[Path, Any, Any]) -> None:
    directory, ours, _ = all_kinds
    names = set(mx.load(str(directory / "model.safetensors")))
    for name in (
        "embed.weight",
        "head.weight",
        "norm.weight",
        "hc_head_fn",
        "layers.0.attn.kv_norm.weight",
        "layers.0.hc_attn_fn",
        "layers.0.ffn.gate.tid2eid",
        "layers.1.ffn.gate.bias",
        "layers.1.ffn.experts.3.w2.weight",
        "layers.1.ffn.shared_experts.w1.weight",
        "layers.1.attn.indexer.compressor.ape",
        "layers.2.attn.compressor.wgate.weight",
        "mtp.0.e_proj.weight",
        "mtp.0.hc_head_scale",
    ):
        assert name in names, name
    assert not any(name.startswith("model.") or ".switch_mlp." in name for name in names)
    assert ours.num_mtp_blocks == 1  # mlxserve keeps the MTP block; mlx-vlm drops it


def test_both_loaders_give_the_same_prefill_logits(all_kinds: tuple[Path, Any, Any]) -> None:
    _, ours, theirs = all_kinds
    # 40 tokens: 10 CSA entries, of which the indexer keeps 4; 200: one HCA entry too.
    for length in (12, 40, 200):
        tokens = prompt(length)
        a = ours(tokens, cache=ours.make_cache())
        b = theirs(tokens, cache=theirs.make_cache()).logits
        assert mx.abs(a - b).max().item() <= 1e-4, length


def test_greedy_tokens_and_logits_are_identical_across_loaders(tmp_path: Path) -> None:
    ours, theirs = both(write_random_published(tmp_path, NO_CSA, seed=3))
    ours_cache, their_cache = ours.make_cache(), theirs.make_cache()
    tokens = prompt(140)  # past the sliding window and one HCA entry
    a = ours(tokens, cache=ours_cache)[:, -1]
    b = theirs(tokens, cache=their_cache).logits[:, -1]
    ours_text, their_text, worst = [], [], 0.0
    for _ in range(24):
        worst = max(worst, mx.abs(a - b).max().item())
        ours_text.append(int(mx.argmax(a, axis=-1).item()))
        their_text.append(int(mx.argmax(b, axis=-1).item()))
        a = ours(mx.array([[ours_text[-1]]]), cache=ours_cache)[:, -1]
        b = theirs(mx.array([[their_text[-1]]]), cache=their_cache).logits[:, -1]
    assert ours_text == their_text
    assert worst <= 1e-4
    assert len(set(ours_text)) > 1  # a real continuation, not one repeated token
