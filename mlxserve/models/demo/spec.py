"""The demo model's architecture and its special tokens, shared by training and build.

Sized for a slow CPU: every DeepSeek-V4 feature is present (sliding, ratio-4 CSA with
an indexer that selects a strict subset, a compressed HCA layer, hash-routed then
routed MoE, two hyper-connection streams, one MTP block), at widths that train in
minutes. The HCA ratio is 16 rather than 128 so that training sequences of 128 tokens
produce compressed entries at all.
"""

from __future__ import annotations

from typing import Any

SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
PAD, BOS = "<|pad|>", "<|bos|>"
SPECIAL_TOKENS = [PAD, BOS, SYSTEM, USER, ASSISTANT, END]
VOCAB_SIZE = 1024

#: Jinja chat template: role tokens, ``<|end|>`` (the EOS) closing every turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('Roles must be system, user or assistant.') }}"
    "{%- endif -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)

#: Expert quantisation applied by ``build`` (mlx-lm affine, 4 bits, groups of 32).
QUANT_BITS = 4
QUANT_GROUP_SIZE = 32

MODEL_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "head_dim": 32,
    "q_lora_rank": 64,
    "num_experts_per_tok": 2,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "routed_scaling_factor": 1.5,
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],
    "mlp_layer_types": ["hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "mtp_layer_types": ["sliding_attention"],
    "num_nextn_predict_layers": 1,
    "sliding_window": 32,
    "o_groups": 2,
    "o_lora_rank": 32,
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 8,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 20,
    "partial_rotary_factor": 0.25,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1.0e-6,
    "tie_word_embeddings": False,
}
