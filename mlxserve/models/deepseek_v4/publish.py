"""Write a DeepSeek-V4 model back in the layout DeepSeek publishes (the inverse of sanitize).

Why: a checkpoint in the published names is the one format every other loader reads
(DeepSeek's reference, vLLM, SGLang, mlx-vlm), so writing it is how mlxserve proves
its reading of the layout against loaders nobody here wrote, and how a model built
or trained here travels to them. ``sanitize.py`` reads exactly these names back.

The published names (DeepSeek-V4-Flash's ``model.safetensors.index.json``, as listed
by public loaders; see docs/deepseek-v4-flash.md#published-tensor-names):

* top level: ``embed.weight``, ``head.weight``, ``norm.weight``, ``hc_head_{fn,base,scale}``;
* per layer ``layers.N.`` (and per MTP block ``mtp.M.``): ``attn_norm``, ``ffn_norm``,
  ``hc_{attn,ffn}_{fn,base,scale}``, ``attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b}``,
  ``attn.attn_sink``, ``attn.compressor.*``, ``attn.indexer.*``, ``ffn.gate.{weight,bias}``
  (``ffn.gate.tid2eid``, int64, on hash layers), ``ffn.experts.E.w{1,2,3}`` (one tensor
  per expert) and ``ffn.shared_experts.w{1,2,3}``; ``wo_a`` is two-dimensional.

A DSpark draft head (DeepSeek-V4-Flash-0731; ``model.dspark``, see ``dspark.py``) is
written back on its stages ``mtp.0`` .. ``mtp.N-1``: each ``dspark.stages.I`` as the
block ``mtp.I`` (the per-layer names above), the parts the head holds once on the
stage that publishes them (``main_proj`` and ``main_norm`` on the first stage;
``norm``, ``hc_head_{fn,base,scale}``, ``markov_head`` and ``confidence_head`` on the
last), and its ``dspark_*`` keys in ``config.json``: the inverse of
``dspark.sanitize_head``, in the layout -0731 ships and mlx-vlm's
``deepseek_v4_dspark`` drafter reads (it builds ``main_proj`` on its first stage and
``hc_head`` / ``norm`` on its last, and takes ``markov_head`` from any).

Weights are written in float (quantised modules are dequantised): the FP8 / FP4
packing of the real release is a storage format that ``packed.py`` reads and that
the float values here could only approximate.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.utils import tree_flatten

from .config import CSA, HASH_MOE, HCA, SLIDING, ModelArgs
from .dspark import CONFIG_KEYS as DSPARK_CONFIG_KEYS
from .dspark import head_of

_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
#: MLX module names -> DeepSeek's, ``str.replace``d in order once ``model.`` is gone.
_RENAMES = (
    (".hc_attn.", ".hc_attn_"),
    (".hc_ffn.", ".hc_ffn_"),
    (".hc_head.hc_", ".hc_head_"),
    (".shared_experts.gate_proj.", ".shared_experts.w1."),
    (".shared_experts.down_proj.", ".shared_experts.w2."),
    (".shared_experts.up_proj.", ".shared_experts.w3."),
)
#: the attention's own kv norm (not a compressor's ``norm``): ``kv_norm`` when published.
_KV_NORM = re.compile(r"^((?:layers|mtp)\.\d+\.attn)\.norm\.weight$")
_EXPERT_STACK = re.compile(r"^(.+)\.ffn\.switch_mlp\.(gate|up|down)_proj\.weight$")
_EXPERT_NAME = {"gate": "w1", "down": "w2", "up": "w3"}
#: DeepSeek's (CSA, HCA) compression ratios, the only ones ``compress_ratios`` carries
_PUBLISHED_RATIOS = (4, 128)
_DSPARK_STAGE = re.compile(r"^dspark\.stages\.(\d+)\.(.+)$")
#: DSpark head parts held once, published on the first stage / on the last one.
_DSPARK_FIRST = ("main_proj.", "main_norm.")
_DSPARK_LAST = ("norm.", "hc_head.", "markov_head.", "confidence_head.")


def dspark_stage_name(name: str, stages: int) -> str:
    """``name`` of a DSpark head parameter (``dspark.*``) on its published stage
    ``mtp.I.*``, still in MLX spelling (`published_name` renames the rest); other
    names are returned as they are."""
    if not name.startswith("dspark."):
        return name
    match = _DSPARK_STAGE.match(name)
    if match is not None:
        return f"mtp.{match.group(1)}.{match.group(2)}"
    part = name.removeprefix("dspark.")
    if part.startswith(_DSPARK_FIRST):
        return f"mtp.0.{part}"
    if part.startswith(_DSPARK_LAST):
        return f"mtp.{stages - 1}.{part}"
    raise ValueError(f"DSpark parameter {name!r} has no published stage.")


def published_name(name: str) -> str:
    """The published name of the MLX parameter ``name`` (experts: see `published_weights`)."""
    if name in _TOP:
        return _TOP[name]
    name = name.removeprefix("model.")
    for mlx_name, ds_name in _RENAMES:
        name = name.replace(mlx_name, ds_name)
    return _KV_NORM.sub(r"\1.kv_norm.weight", name)


def _float_parameters(model: Module) -> dict[str, mx.array]:
    """``model``'s parameters with every quantised module dequantised to its weight."""
    params: dict[str, mx.array] = dict(tree_flatten(model.parameters()))  # type: ignore[no-untyped-call]
    modules: Any = tree_flatten(
        model.leaf_modules(),  # type: ignore[no-untyped-call]
        is_leaf=Module.is_module,
    )
    for path, module in modules:
        if "scales" not in module:
            continue
        biases = module.get("biases")
        params[f"{path}.weight"] = mx.dequantize(
            module["weight"],
            module["scales"],
            biases,
            group_size=module.group_size,
            bits=module.bits,
            mode=getattr(module, "mode", "affine"),
        )
        params.pop(f"{path}.scales")
        if biases is not None:
            params.pop(f"{path}.biases")
    return params


def published_weights(model: Module, dtype: mx.Dtype | None = None) -> dict[str, mx.array]:
    """``model``'s weights under DeepSeek's published names (see the module docstring).

    ``dtype`` casts the floating tensors, except those the reference keeps in float32
    (``model.cast_predicate``); None keeps each tensor's dtype.
    """
    keep = getattr(model, "cast_predicate", lambda _key: True)
    head = head_of(model)
    stages = head.spec.stages if head is not None else 0
    out: dict[str, mx.array] = {}
    for name, value in sorted(_float_parameters(model).items()):
        if dtype is not None and mx.issubdtype(value.dtype, mx.floating) and keep(name):
            value = value.astype(dtype)
        name = dspark_stage_name(name, stages)
        stack = _EXPERT_STACK.match(name)
        if stack is not None:
            block, proj = stack.groups()
            prefix = published_name(f"{block}.x").removesuffix(".x")
            for expert in range(value.shape[0]):
                out[f"{prefix}.ffn.experts.{expert}.{_EXPERT_NAME[proj]}.weight"] = value[expert]
            continue
        if name.endswith(".attn.wo_a.weight") and value.ndim == 3:
            value = value.reshape(-1, value.shape[-1])
        if name.endswith(".gate.tid2eid"):
            value = value.astype(mx.int64)
        published = published_name(name)
        if published in out:
            raise ValueError(f"two parameters publish as {published!r}.")
        out[published] = value
    return out


def published_config(args: ModelArgs, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``args`` as DeepSeek spells its ``config.json`` (``compress_ratios`` over the
    layers then the MTP blocks, when the ratios are DeepSeek's 4 and 128;
    ``num_hash_layers``, ``qk_rope_head_dim``, a flat ``rope_scaling``), plus ``extra``
    (token ids, for instance).

    A DSpark head's ``dspark_*`` keys are written when ``args`` has them (-0731's
    spelling; ``dspark.py``).

    Raises ``ValueError`` for what that spelling cannot say: hash-routed layers that
    are not the first ones.
    """
    assert args.layer_types is not None and args.mlp_layer_types is not None
    n_hash = sum(t == HASH_MOE for t in args.mlp_layer_types)
    if args.mlp_layer_types[:n_hash] != [HASH_MOE] * n_hash:
        raise ValueError("DeepSeek's config lists hash-routed layers only as the first ones.")
    ratios = {SLIDING: 0, CSA: args.compress_ratio(CSA), HCA: args.compress_ratio(HCA)}
    compress = dict((args.rope_parameters or {}).get("compress", {}))
    rope_scaling = None
    if compress.get("rope_type") not in (None, "default"):
        rope_scaling = {
            ("type" if key == "rope_type" else key): value
            for key, value in compress.items()
            if key not in ("rope_theta", "partial_rotary_factor")
        }
    config: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "moe_intermediate_size": args.moe_intermediate_size,
        "num_hidden_layers": args.num_hidden_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": 1,
        "head_dim": args.head_dim,
        "q_lora_rank": args.q_lora_rank,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "num_experts_per_tok": args.num_experts_per_tok,
        "n_routed_experts": args.n_routed_experts,
        "n_shared_experts": args.n_shared_experts,
        "scoring_func": args.scoring_func,
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": args.routed_scaling_factor,
        "max_position_embeddings": args.max_position_embeddings,
        "rope_theta": args.rope_theta,
        "compress_rope_theta": args.compress_rope_theta,
        "rope_scaling": rope_scaling,
        "num_hash_layers": n_hash,
        "hc_mult": args.hc_mult,
        "hc_sinkhorn_iters": args.hc_sinkhorn_iters,
        "hc_eps": args.hc_eps,
        "swiglu_limit": args.swiglu_limit,
        "sliding_window": args.sliding_window,
        "o_groups": args.o_groups,
        "o_lora_rank": args.o_lora_rank,
        "index_n_heads": args.index_n_heads,
        "index_head_dim": args.index_head_dim,
        "index_topk": args.index_topk,
        "num_nextn_predict_layers": args.num_nextn_predict_layers,
        "rms_norm_eps": args.rms_norm_eps,
        "tie_word_embeddings": args.tie_word_embeddings,
    }
    types = [*args.layer_types, *(args.mtp_layer_types or [])]
    if (ratios[CSA], ratios[HCA]) == _PUBLISHED_RATIOS:
        config["compress_ratios"] = [ratios[t] for t in types]
    else:
        # transformers' DeepseekV4Config (which tokenizer loading parses) knows only the
        # published ratios; other ratios (the demo's HCA 16) take its type spelling.
        config["layer_types"] = list(args.layer_types)
        config["mtp_layer_types"] = list(args.mtp_layer_types or [])
        config["compress_rates"] = {CSA: ratios[CSA], HCA: ratios[HCA]}
    for key in DSPARK_CONFIG_KEYS:
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    config.update(extra or {})
    return config


def write_published(
    model: Module,
    directory: Path,
    extra: dict[str, Any] | None = None,
    dtype: mx.Dtype | None = None,
) -> Path:
    """``model`` (with its MTP blocks or its DSpark head) in DeepSeek's published
    layout: ``model.safetensors`` (`published_weights`) and ``config.json``
    (`published_config` plus ``extra``) in ``directory``, which is created; the
    tokenizer is the caller's. Returns ``directory``."""
    args: ModelArgs = model.args
    directory.mkdir(parents=True, exist_ok=True)
    weights = published_weights(model, dtype)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "pt"})
    config = published_config(args, extra)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory
