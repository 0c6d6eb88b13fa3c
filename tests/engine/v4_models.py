"""Random tiny DeepSeek-V4 models with an MTP block, built in memory for engine tests."""

from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxserve.models.deepseek_v4 import Model, ModelArgs
from mlxserve.models.deepseek_v4.model import MTPBlock


def tiny_v4(seed: int = 0, **overrides: Any) -> Model:
    """Sliding (window 8), compressed-sparse (ratio 4) and heavily compressed (ratio 16)
    layers, hash and routed MoE, hc_mult 2, one MTP block; all weights random."""
    params: dict[str, Any] = {
        "vocab_size": 61,
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
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "mlp_layer_types": ["hash_moe", "moe", "moe"],
        "sliding_window": 8,
        "o_groups": 2,
        "o_lora_rank": 8,
        "index_n_heads": 16,
        "index_head_dim": 8,
        "index_topk": 4,
        "hc_mult": 2,
        "partial_rotary_factor": 0.25,
        "num_nextn_predict_layers": 1,
    }
    params.update(overrides)
    args = ModelArgs.from_dict(params)
    mx.random.seed(seed)
    model = Model(args)
    model.mtp = [MTPBlock(args, "sliding_attention")]
    randomized = []
    for name, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            value = mx.random.normal(value.shape) * (1.0 if value.ndim > 1 else 0.1)
            if value.ndim > 1:
                value = value / (value.shape[-1] ** 0.5)
        else:  # hash routing table: random experts
            value = mx.random.randint(0, args.n_routed_experts, value.shape).astype(value.dtype)
        randomized.append((name, value))
    model.update(tree_unflatten(randomized))
    mx.eval(model.parameters())
    return model
