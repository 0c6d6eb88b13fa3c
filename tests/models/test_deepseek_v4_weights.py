"""Checkpoint key mapping, MTP weight retention and sharding checks (no torch needed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")

from mlx.utils import tree_flatten  # noqa: E402

from mlxserve.models.deepseek_v4 import Model, ModelArgs  # noqa: E402
from mlxserve.models.deepseek_v4.sharding import check_shardable  # noqa: E402

_SHARED = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def _args(**overrides: Any) -> ModelArgs:
    params: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "head_dim": 16,
        "q_lora_rank": 16,
        "num_experts_per_tok": 2,
        "n_routed_experts": 4,
        "layer_types": [
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
        ],
        "mlp_layer_types": ["hash_moe", "moe", "moe"],
        "sliding_window": 8,
        "o_groups": 2,
        "o_lora_rank": 8,
        "index_n_heads": 4,
        "index_head_dim": 8,
        "index_topk": 4,
        "hc_mult": 2,
        "partial_rotary_factor": 0.25,
        "num_nextn_predict_layers": 1,
    }
    params.update(overrides)
    return ModelArgs.from_dict(params)


def _to_checkpoint(params: dict[str, Any], prefix: str, block_prefix: str) -> dict[str, Any]:
    """Write MLX parameters the way DeepSeek names them (the inverse of ``sanitize``)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key == "lm_head.weight":
            out["head.weight"] = value
            continue
        name = key.removeprefix("model.")
        if name.startswith("layers.") or name.startswith("mtp."):
            name = name.replace(".hc_attn.", ".hc_attn_").replace(".hc_ffn.", ".hc_ffn_")
            name = name.replace(".hc_head.hc_", ".hc_head_")
            for mlx_name, ds_name in _SHARED.items():
                name = name.replace(f".shared_experts.{mlx_name}.", f".shared_experts.{ds_name}.")
            if ".switch_mlp." in name:
                block, proj = name.split(".ffn.switch_mlp.")
                ds = _SHARED[proj.removesuffix(".weight")]
                for e in range(value.shape[0]):
                    out[f"{_block(block, prefix, block_prefix)}.ffn.experts.{e}.{ds}.weight"] = (
                        value[e]
                    )
                continue
            if name.endswith(".attn.wo_a.weight"):
                value = value.reshape(-1, value.shape[-1])
            if name.endswith(".tid2eid"):
                value = value.astype(mx.int64)
            block, rest = name.split(".", 2)[:2], name.split(".", 2)[2]
            out[f"{_block('.'.join(block), prefix, block_prefix)}.{rest}"] = value
        else:
            out[f"{prefix}{name}"] = value
    return out


def _block(block: str, prefix: str, block_prefix: str) -> str:
    return f"{block_prefix}{block}" if block.startswith("mtp.") else f"{prefix}{block}"


@pytest.fixture
def model_and_params() -> tuple[Model, dict[str, Any]]:
    model = Model(_args())
    mx.random.seed(0)
    params = dict(tree_flatten(model.parameters()))
    params = {
        k: mx.random.normal(v.shape) if v.dtype == mx.float32 else v for k, v in params.items()
    }
    model.load_weights(list(params.items()))
    return model, params


def _mtp_params(args: ModelArgs) -> dict[str, Any]:
    from mlxserve.models.deepseek_v4.model import MTPBlock

    block = MTPBlock(args, "sliding_attention")
    return {f"mtp.0.{k}": v for k, v in tree_flatten(block.parameters())}


@pytest.mark.parametrize(
    ("prefix", "block_prefix"), [("model.", ""), ("", ""), ("model.", "model.")]
)
def test_sanitize_maps_both_layouts(
    model_and_params: tuple[Model, dict[str, Any]], prefix: str, block_prefix: str
) -> None:
    model, params = model_and_params
    mtp = _mtp_params(model.args)
    checkpoint = _to_checkpoint({**params, **mtp}, prefix, block_prefix)
    assert f"{prefix}layers.0.ffn.experts.3.w2.weight" in checkpoint
    assert any(k.startswith(f"{block_prefix}mtp.0.") for k in checkpoint)

    clean = model.sanitize(checkpoint)
    assert set(clean) == set(params) | set(mtp)
    for key, value in params.items():
        assert clean[key].shape == value.shape, key
        assert mx.array_equal(clean[key], value), key
    assert clean["model.layers.0.ffn.gate.tid2eid"].dtype == mx.int32
    # The MTP weights survive and load into the MTP blocks created for them.
    assert len(model.mtp) == 1
    model.load_weights(list(clean.items()), strict=True)
    # Sanitising again is a no-op (converted / quantised checkpoints).
    again = model.sanitize(clean)
    assert set(again) == set(clean)


def test_sanitize_accepts_deepseek_top_level_names(
    model_and_params: tuple[Model, dict[str, Any]],
) -> None:
    model, params = model_and_params
    checkpoint = _to_checkpoint(params, "", "")
    checkpoint["embed.weight"] = checkpoint.pop("embed_tokens.weight")
    for part in ("fn", "base", "scale"):
        checkpoint[f"hc_head_{part}"] = checkpoint.pop(f"hc_head.hc_{part}")
    assert set(model.sanitize(checkpoint)) == set(params)


def test_sanitize_rejects_unknown_and_missing() -> None:
    model = Model(_args())
    with pytest.raises(ValueError, match="Unexpected"):
        model.sanitize({"vision.proj.weight": mx.zeros((2, 2))})
    partial = {"layers.1.ffn.experts.0.w1.weight": mx.zeros((16, 32))}
    partial["layers.1.ffn.experts.2.w1.weight"] = mx.zeros((16, 32))
    with pytest.raises(ValueError, match="missing"):
        model.sanitize(partial)


def test_legacy_config_matches_transformers_spelling() -> None:
    legacy = _args(
        layer_types=None,
        mlp_layer_types=None,
        partial_rotary_factor=None,
        compress_ratios=[0, 4, 128, 4],
        num_hash_layers=1,
        qk_rope_head_dim=4,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )
    assert legacy.layer_types == [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ]
    assert legacy.mlp_layer_types == ["hash_moe", "moe", "moe"]
    assert legacy.mtp_layer_types == ["compressed_sparse_attention"]
    assert legacy.qk_rope_head_dim == 4
    assert legacy.rope_parameters is not None
    assert legacy.rope_parameters["compress"]["rope_type"] == "yarn"
    assert legacy.rope_parameters["compress"]["attention_factor"] == 1.0
    assert legacy.rope_parameters["main"]["rope_type"] == "default"


@dataclass
class FakeGroup:
    """Enough of ``mx.distributed.Group`` for the size checks and weight slicing."""

    n: int
    r: int = 0

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.r


@pytest.mark.parametrize("size", [3, 8])
def test_shard_rejects_uneven_sizes(size: int) -> None:
    model = Model(_args())
    with pytest.raises(ValueError, match=f"over {size} ranks"):
        model.shard(FakeGroup(size))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="o_groups"):
        check_shardable(Model(_args(o_groups=1)), 2)


def test_shard_slices_weights_for_each_rank() -> None:
    model = Model(_args())
    full = dict(tree_flatten(model.parameters()))
    model.shard(FakeGroup(2, 1))  # type: ignore[arg-type]
    attn = model.layers[1].attn
    assert attn.num_heads == 2 and attn.o_groups == 1
    assert attn.attn_sink.shape == (2,)
    assert mx.array_equal(attn.attn_sink, full["model.layers.1.attn.attn_sink"][2:])
    assert attn.wq_b.weight.shape == (2 * 16, 16)
    assert attn.wo_a.weight.shape == (1, 8, 32)
    assert mx.array_equal(attn.wo_a.weight, full["model.layers.1.attn.wo_a.weight"][1:])
    assert attn.wo_b.weight.shape == (32, 8)
    experts = model.layers[1].ffn.switch_mlp
    assert experts.gate_proj.weight.shape == (4, 8, 32)
    assert experts.down_proj.weight.shape == (4, 32, 8)


def test_shard_on_one_rank_keeps_logits() -> None:
    model = Model(_args())
    mx.random.seed(1)
    params = dict(tree_flatten(model.parameters()))
    model.load_weights(
        [(k, mx.random.normal(v.shape) if v.dtype == mx.float32 else v) for k, v in params.items()]
    )
    tokens = mx.array([[1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12]])
    before = model(tokens)
    model.shard(mx.distributed.init())
    assert mx.allclose(model(tokens), before)
