"""Tiny DeepSeek-V4.1 checkpoints in the published key names, with and without Engram,
with or without a DSpark draft head.

The names are DeepSeek's (``embed.weight``, ``layers.N.attn.wq_a.weight``,
``layers.N.ffn.experts.E.w1.weight``, ``layers.N.engram.embed.weight``...): the inverse
of mlx-lm's ``deepseek_v41`` renaming, written from a random model. The config is
nested like the release's (``text_config``, ``vision_config``), and a few vision
tower tensors are included so the loader must name and leave them out. Without a
DSpark head an MTP-style ``mtp.*`` tensor is included too (not served: the config has
no ``dspark_*`` fields); with one (``dspark=True``), the head is in V4.1-Flash's
published names: ``mtp.0.main_proj`` / ``main_norm``, the stages' blocks (with their
image-routing ``ffn.gate.bias_vl``), ``mtp.{last}.norm``, ``markov_head.embed`` /
``.head`` and ``confidence_head.proj.weight``, and its own expert bank (3 experts
against the backbone's 4). The tokenizer is the demo's (1024 ids); the Engram token
map folds it onto 700 ids.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxserve.models.deepseek_v4.dspark import DSparkSpec
from mlxserve.models.deepseek_v41.dspark import V41DSparkHead
from mlxserve.models.deepseek_v41.engram import EngramHasher
from mlxserve.models.deepseek_v41.model import TOKEN_MAP_FILE, Model, ModelArgs
from mlxserve.models.demo.build import TOKENIZER_FILES, WEIGHTS_DIR

VOCAB = 1024
COMPRESSED_VOCAB = 700
TOKEN_MAP = [i % COMPRESSED_VOCAB for i in range(VOCAB)]
TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "o_groups": 2,
    "o_lora_rank": 16,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-6,
    "sliding_window": 16,
    "compress_ratios": [0, 4, 4, 4, 0],
    "kv_source_layer_ids": [1],
    "index_source_layer_ids": [1, 3],
    "candidate_source_layer_id": -1,
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 4,
    "hc_mult": 2,
    "bos_token_id": 1,
    "eos_token_id": 5,
}
ENGRAM_CONFIG: dict[str, Any] = {
    "engram_layer_ids": [1, 3],
    "engram_num_embeddings": [4000, 4000],
    "engram_max_ngram_size": 3,
    "engram_vocab_size": 600,
    "engram_n_heads": 2,
    "engram_head_dim": 16,
    "engram_pad_token_id": 0,
    "engram_compressed_vocab_size": COMPRESSED_VOCAB,
}
STAGES = 2
DSPARK_CONFIG: dict[str, Any] = {
    "num_nextn_predict_layers": STAGES,
    "compress_ratios": [0, 4, 4, 4] + [0] * STAGES,
    "dspark_block_size": 4,
    "dspark_target_layer_ids": [2, 3],
    "dspark_noise_token_id": 1000,
    "dspark_markov_rank": 8,
    "dspark_n_routed_experts": 3,
    "dspark_num_experts_per_tok": 2,
}
#: the head's parts held once: our name -> published (``{last}``: the last stage)
_HEAD_ONCE = {
    "dspark.main_proj.": "mtp.0.main_proj.",
    "dspark.main_norm.": "mtp.0.main_norm.",
    "dspark.norm.": "mtp.{last}.norm.",
    "dspark.markov_head.markov_w1.": "mtp.{last}.markov_head.embed.",
    "dspark.markov_head.markov_w2.": "mtp.{last}.markov_head.head.",
    "dspark.confidence_head.": "mtp.{last}.confidence_head.",
}
#: MLX names -> DeepSeek's, applied in this order (mlx-lm's ``_rename``, reversed).
_RENAMES = (
    (".self_attn.", ".attn."),
    (".mlp.", ".ffn."),
    (".input_layernorm.", ".attn_norm."),
    (".post_attention_layernorm.", ".ffn_norm."),
    (".attn_hc.", ".hc_attn_"),
    (".ffn_hc.", ".hc_ffn_"),
    (".sinks", ".attn_sink"),
    (".shared_experts.gate_proj.", ".shared_experts.w1."),
    (".shared_experts.down_proj.", ".shared_experts.w2."),
    (".shared_experts.up_proj.", ".shared_experts.w3."),
    (".q_a_proj.", ".wq_a."),
    (".q_b_proj.", ".wq_b."),
    (".kv_proj.", ".wkv."),
    (".gate_proj.", ".wgate."),
    (".o_a_proj.", ".wo_a."),
    (".o_b_proj.", ".wo_b."),
    (".q_a_norm.", ".q_norm."),
    (".compressor.kv_norm.", ".compressor.norm."),
    (".indexer.k_proj.", ".indexer.wk."),
    (".gate.e_score_correction_bias", ".gate.bias"),
)
_STACK = re.compile(
    r"^((?:layers|mtp)\.\d+)\.(?:ffn|mlp)\.experts\.switch_mlp\.(gate|up|down)_proj\.weight$"
)
_W = {"gate": "w1", "down": "w2", "up": "w3"}


def config(engram: bool, dspark: bool = False) -> dict[str, Any]:
    text = {**TEXT_CONFIG, **(ENGRAM_CONFIG if engram else {}), **(DSPARK_CONFIG if dspark else {})}
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": {**text, "model_type": "deepseek_v41_text"},
        "vision_config": {"num_hidden_layers": 1, "hidden_size": 16},
        "bos_token_id": 1,
        "eos_token_id": 5,
    }


def _published_name(name: str, last: int) -> str:
    """A name of ours in DeepSeek's published layout (before the per-name renames)."""
    for ours, theirs in _HEAD_ONCE.items():
        if name.startswith(ours):
            return theirs.format(last=last) + name.removeprefix(ours)
    if name.startswith("dspark.stages."):
        return "mtp." + name.removeprefix("dspark.stages.")
    return name.removeprefix("model.")


def published(model: Model) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    last = STAGES - 1
    for name, value in tree_flatten(model.parameters()):
        if name == "lm_head.weight":
            out["head.weight"] = value
            continue
        if name == "model.embed_tokens.weight":
            out["embed.weight"] = value
            continue
        name = _published_name(name, last)
        if ".engram." in name:
            out[name] = value
            continue
        stack = _STACK.match(name)
        if stack is not None:
            layer, proj = stack.groups()
            for e in range(value.shape[0]):
                out[f"{layer}.ffn.experts.{e}.{_W[proj]}.weight"] = value[e]
            continue
        for mlx_name, ds_name in _RENAMES:
            name = name.replace(mlx_name, ds_name)
        if name.endswith(".attn.wo_a.weight"):
            value = value.reshape(-1, value.shape[-1])
        out[name] = value
    return out


def with_head(model: Model) -> Model:
    """``model`` (whose config has the ``dspark_*`` fields) with a DSpark head of
    ``STAGES`` stages, as its checkpoint's tensors would shape it."""
    args = model.args
    assert args.dspark_block_size is not None
    spec = DSparkSpec(
        block_size=args.dspark_block_size,
        target_layers=tuple(args.dspark_target_layer_ids),
        noise_token=int(args.dspark_noise_token_id or 0),
        stages=STAGES,
        markov_rank=int(args.dspark_markov_rank or 0),
        confidence_with_markov=True,
    )
    model["dspark"] = V41DSparkHead(args, spec)
    return model


def random_v41(*, engram: bool, seed: int = 0, dspark: bool = False, echo: bool = False) -> Model:
    """A random tiny V4.1 (``config(engram, dspark)``), in memory.

    ``echo``: every attention and expert output projection is zero, so the streams
    stay the token's embedding and the model predicts a function of the last token
    alone; a DSpark head's first draft (its anchor's embedding, through the same
    norm and head) is then that very token, and its confidence head is zero (0.5:
    one draft verified a round). Speculation is then accepted: for tests of the
    serving path, not of the maths."""
    model = Model(ModelArgs.from_dict(config(engram, dspark)))
    if dspark:
        with_head(model)
    mx.random.seed(seed)
    weights = []
    for name, value in tree_flatten(model.parameters()):
        if name.endswith(("norm.weight", "q_weight", "k_weight")):
            weights.append((name, 1 + 0.1 * mx.random.normal(value.shape)))
        elif name.endswith(".sinks"):
            weights.append((name, mx.zeros(value.shape)))
        else:
            scale = 0.02 if "embed" in name and "engram" not in name else 0.1
            weights.append((name, scale * mx.random.normal(value.shape)))
    if echo:
        weights = [(name, _echo(name, value, weights)) for name, value in weights]
    model.load_weights(weights)
    if engram:
        assert model.spec is not None
        model.hasher = EngramHasher(model.spec, TOKEN_MAP)
    return model


def write_v41(
    directory: Path, *, engram: bool, seed: int = 0, dspark: bool = False, echo: bool = False
) -> Path:
    """``random_v41``'s model in the published layout, with the demo's tokenizer."""
    raw = config(engram, dspark)
    model = random_v41(engram=engram, seed=seed, dspark=dspark, echo=echo)
    tensors = published(model)
    tensors["vision.patch_embed.proj.weight"] = mx.zeros((16, 3, 2, 2))
    if dspark:
        experts = DSPARK_CONFIG["dspark_n_routed_experts"]
        for stage in range(STAGES):
            tensors[f"mtp.{stage}.ffn.gate.bias_vl"] = mx.zeros((experts,))
    else:
        tensors["mtp.0.e_proj.weight"] = mx.zeros((64, 64))
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), tensors, metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    for name in TOKENIZER_FILES:
        (directory / name).write_bytes((WEIGHTS_DIR / name).read_bytes())
    if engram:
        (directory / TOKEN_MAP_FILE).write_text(json.dumps(TOKEN_MAP))
    return directory


_SILENT = (
    ".o_b_proj.weight",
    ".down_proj.weight",
    "confidence_head.proj.weight",
    "markov_w2.weight",
)


def _echo(name: str, value: mx.array, weights: list[tuple[str, mx.array]]) -> mx.array:
    """``write_v41(echo=True)``'s weight for ``name``: the output projections silent, the
    draft's final norm the main model's."""
    if name.endswith(_SILENT) or (".engram." in name and name.endswith("wkv.weight")):
        return mx.zeros_like(value)
    if name == "dspark.norm.weight":
        return dict(weights)["model.norm.weight"]
    return value
