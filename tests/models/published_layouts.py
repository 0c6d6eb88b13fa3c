"""Tiny DeepSeek-V4 checkpoints written the way DeepSeek publishes each variant.

The safetensors files are written byte by byte here, with the header dtype strings
of the published files (``I8``, ``F8_E4M3``, ``F8_E8M0``, ``F32``, ``I64``), so the
loader meets exactly what it meets in a download. The codes are random bytes and the
float reference is decoded from them in numpy, independently of MLX: e2m1 pairs
with the low nibble first, e4m3 with its bias of 7, e8m0 as ``2 ** (e - 127)``.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from mlx.utils import tree_flatten

from mlxserve.models.deepseek_v4 import Model, ModelArgs
from mlxserve.models.deepseek_v4.model import MTPBlock

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "vocab_size": 64,
    "hidden_size": 160,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "head_dim": 64,
    "q_lora_rank": 64,
    "num_experts_per_tok": 2,
    "n_routed_experts": 4,
    "layer_types": [SLIDING, CSA, HCA],
    "compress_rates": {CSA: 4, HCA: 8},
    "mlp_layer_types": ["hash_moe", "moe", "moe"],
    "sliding_window": 8,
    "o_groups": 2,
    "o_lora_rank": 32,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 2,
    "hc_mult": 2,
    "partial_rotary_factor": 0.25,
    "num_nextn_predict_layers": 1,
}
QUANTIZATION: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}
#: DeepSeek-V4-Flash-0731's config additions (its DSpark head), at this size.
DSPARK_CONFIG: dict[str, Any] = {
    "dspark_block_size": 5,
    "dspark_target_layer_ids": [0, 1, 2],
    "dspark_markov_rank": 8,
    "dspark_noise_token_id": 63,
}
BLOCK = 128
TOKENS = [[3, 17, 42, 8, 60, 1, 33, 25, 9, 51, 12, 40, 7, 19, 63, 28, 5, 44, 36, 21]]

#: FP8 in V4-Flash: the attention projections, the indexer's query, the shared expert
#: and the MTP input projections (the compressors and weights_proj ship in float).
FP8 = re.compile(
    r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|\.indexer\.wq_b\.weight$"
    r"|\.shared_experts\.w[123]\.weight$|\.(e_proj|h_proj|main_proj)\.weight$"
)
EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
#: MLX module names -> DeepSeek's (``str.replace``d in this order, after ``model.`` goes).
RENAMES = (
    (".hc_attn.", ".hc_attn_"),
    (".hc_ffn.", ".hc_ffn_"),
    (".hc_head.hc_", ".hc_head_"),
    (".shared_experts.gate_proj.", ".shared_experts.w1."),
    (".shared_experts.down_proj.", ".shared_experts.w2."),
    (".shared_experts.up_proj.", ".shared_experts.w3."),
)
_EXPERT_NAMES = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    """e4m3fn bytes as float32: sign, 4 exponent bits (bias 7), 3 mantissa bits."""
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0x0F
    mantissa = (codes & 0x07).astype(np.float64)
    normal = (1 + mantissa / 8) * np.exp2(exponent.astype(np.float64) - 7)
    subnormal = mantissa / 8 * 2.0**-6
    return (sign * np.where(exponent == 0, subnormal, normal)).astype(np.float32)


def decode_e2m1_pairs(codes: np.ndarray) -> np.ndarray:
    """Two e2m1 codes per byte, the low nibble first: ``[..., n] -> [..., 2n]``."""
    low, high = E2M1[codes & 0x0F], E2M1[codes >> 4]
    return np.stack([low, high], axis=-1).reshape(*codes.shape[:-1], -1)


def published_shapes(dspark: bool = False) -> dict[str, tuple[int, ...]]:
    """Published tensor names and (float) shapes of the tiny model and its draft head.

    Without ``dspark`` the draft head is V4-Flash's one MTP block (``mtp.0``); with it,
    three DSpark stages shaped like -0731's (``main_proj`` over the three target
    layers, the Markov and confidence heads on the last stage).
    """
    args = ModelArgs.from_dict(CONFIG)
    model = Model(args)
    model.mtp = [MTPBlock(args, SLIDING)]
    shapes: dict[str, tuple[int, ...]] = {}
    for name, value in tree_flatten(model.parameters()):
        for published, shape in _published(name, tuple(value.shape)):
            shapes[published] = shape
    if dspark:
        # Each stage: a sliding-attention MoE block, shaped like the MTP block's.
        mtp_only = (".e_proj.", ".h_proj.", ".enorm.", ".hnorm.", "mtp.0.norm.", ".hc_head_")
        stage = {
            name.removeprefix("mtp.0."): shape
            for name, shape in shapes.items()
            if name.startswith("mtp.0.") and not any(part in name for part in mtp_only)
        }
        shapes = {name: shape for name, shape in shapes.items() if not name.startswith("mtp.")}
        hidden, vocab = args.hidden_size, args.vocab_size
        for index in range(3):
            for name, shape in stage.items():
                shapes[f"mtp.{index}.{name}"] = shape
        shapes["mtp.0.main_proj.weight"] = (hidden, 3 * hidden)
        shapes["mtp.0.main_norm.weight"] = (hidden,)
        for part in ("fn", "base", "scale"):
            shapes[f"mtp.2.hc_head_{part}"] = shapes[f"hc_head_{part}"]
        shapes["mtp.2.norm.weight"] = (hidden,)
        rank = DSPARK_CONFIG["dspark_markov_rank"]
        shapes["mtp.2.markov_head.markov_w1.weight"] = (vocab, rank)
        shapes["mtp.2.markov_head.markov_w2.weight"] = (vocab, rank)
        shapes["mtp.2.confidence_head.proj.weight"] = (1, hidden)
        shapes["mtp.2.confidence_head.proj.bias"] = (1,)
    return shapes


def published_names(name: str, experts: int) -> list[str]:
    """The published name of the MLX parameter ``name``; an expert stack (``switch_mlp``,
    ``experts`` deep) is published as one tensor per expert. DeepSeek's ``wo_a`` is
    MLX's flattened to two dimensions (see `is_flattened`)."""
    if name in _TOP:
        return [_TOP[name]]
    name = name.removeprefix("model.")
    for mlx_name, ds_name in RENAMES:
        name = name.replace(mlx_name, ds_name)
    if name.endswith(".attn.norm.weight"):  # the attention's kv norm, as published
        name = name.removesuffix(".norm.weight") + ".kv_norm.weight"
    if is_expert_stack(name):
        block, proj = name.split(".ffn.switch_mlp.")
        w = _EXPERT_NAMES[proj.removesuffix(".weight")]
        return [f"{block}.ffn.experts.{e}.{w}.weight" for e in range(experts)]
    return [name]


def is_expert_stack(name: str) -> bool:
    return ".ffn.switch_mlp." in name


def is_flattened(name: str) -> bool:
    """Published with its first two dimensions as one (the grouped ``wo_a``)."""
    return name.endswith(".attn.wo_a.weight")


def _published(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    names = published_names(name, shape[0])
    if is_expert_stack(name):
        return [(published, shape[1:]) for published in names]
    if is_flattened(name):
        shape = (shape[0] * shape[1], shape[2])
    return [(names[0], shape)]


@dataclass
class Checkpoint:
    """Published tensors (dtype string, shape, bytes) and their float reference."""

    tensors: dict[str, tuple[str, tuple[int, ...], bytes]] = field(default_factory=dict)
    reference: dict[str, np.ndarray] = field(default_factory=dict)

    def put(self, name: str, dtype: str, array: np.ndarray) -> None:
        self.tensors[name] = (dtype, tuple(array.shape), np.ascontiguousarray(array).tobytes())


def _exponents(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    """Power-of-two scale exponents near ``1 / sqrt(fan_in)``, differing between blocks."""
    base = -round(np.log2(np.sqrt(fan_in)))
    return base + rng.integers(-1, 2, shape)


def _fp8_codes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random e4m3 codes of magnitude 1/4 .. 2 (exponent field 5 .. 8), either sign."""
    sign = rng.integers(0, 2, shape) << 7
    exponent = rng.integers(5, 9, shape) << 3
    return (sign | exponent | rng.integers(0, 8, shape)).astype(np.uint8)


def _fp8(
    ck: Checkpoint, name: str, shape: tuple[int, ...], scale_dtype: str, rng: np.random.Generator
) -> None:
    """e4m3 weight with one power-of-two scale per 128 x 128 tile (``F8_E8M0`` or ``F32``)."""
    rows, cols = shape
    codes = _fp8_codes(rng, shape)
    grid = (-(-rows // BLOCK), -(-cols // BLOCK))
    exponents = _exponents(rng, grid, cols)
    full = np.exp2(exponents).repeat(BLOCK, 0).repeat(BLOCK, 1)[:rows, :cols]
    ck.put(name, "F8_E4M3", codes)
    base = name.removesuffix(".weight")
    if scale_dtype == "F8_E8M0":
        ck.put(f"{base}.scale", "F8_E8M0", (exponents + 127).astype(np.uint8))
    else:
        ck.put(f"{base}.scale", "F32", np.exp2(exponents).astype(np.float32))
    ck.reference[name] = (decode_e4m3(codes) * full).astype(np.float32)


def _fp4(ck: Checkpoint, name: str, shape: tuple[int, ...], rng: np.random.Generator) -> None:
    """Two e2m1 codes per ``I8`` byte, one ``F8_E8M0`` scale per 32 inputs of a row."""
    rows, cols = shape
    codes = rng.integers(0, 256, (rows, cols // 2)).astype(np.uint8)
    exponents = _exponents(rng, (rows, cols // 32), cols) - 1
    ck.put(name, "I8", codes.view(np.int8))
    ck.put(f"{name.removesuffix('.weight')}.scale", "F8_E8M0", (exponents + 127).astype(np.uint8))
    values = decode_e2m1_pairs(codes) * np.exp2(exponents).repeat(32, axis=1)
    ck.reference[name] = values.astype(np.float32)


def build(variant: str, seed: int = 0) -> Checkpoint:
    """``variant``: ``flash`` (FP4 experts), ``base`` (FP8 experts, F32 tile scales) or
    ``0731`` (flash plus a DSpark draft head)."""
    rng = np.random.default_rng(seed)
    ck = Checkpoint()
    vocab, experts = CONFIG["vocab_size"], CONFIG["n_routed_experts"]
    for name, shape in published_shapes(dspark=variant == "0731").items():
        if name.endswith("gate.tid2eid"):
            table = np.stack([rng.permutation(experts)[:2] for _ in range(vocab)])
            ck.put(name, "I64", table.astype(np.int64))
            ck.reference[name] = table.astype(np.int64)
        elif EXPERT.search(name) and variant == "base":
            _fp8(ck, name, shape, "F32", rng)
        elif EXPERT.search(name):
            _fp4(ck, name, shape, rng)
        elif FP8.search(name):
            _fp8(ck, name, shape, "F8_E8M0", rng)
        else:
            if len(shape) == 1:
                value = 1.0 + 0.1 * rng.standard_normal(shape)
            else:
                value = rng.standard_normal(shape) / np.sqrt(shape[-1])
            ck.put(name, "F32", value.astype(np.float32))
            ck.reference[name] = value.astype(np.float32)
    return ck


def config_for(variant: str) -> dict[str, Any]:
    """config.json of ``variant`` as published (``expert_dtype`` at the top level)."""
    config = {**CONFIG, "quantization_config": dict(QUANTIZATION)}
    config["expert_dtype"] = "fp8" if variant == "base" else "fp4"
    if variant == "0731":
        config.update(DSPARK_CONFIG)
    return config


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    """A safetensors file with exactly these header dtype strings, shapes and bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        end = offset + len(data)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
        for _, _, data in tensors.values():
            handle.write(data)


def write_checkpoint(
    directory: Path,
    config: dict[str, Any],
    tensors: dict[str, tuple[str, tuple[int, ...], bytes]],
    shards: int = 2,
) -> Path:
    """``config.json`` plus the tensors split over ``shards`` files, as published."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    names = list(tensors)
    for index in range(shards):
        part = {name: tensors[name] for name in names[index::shards]}
        write_safetensors(directory / f"model-{index + 1:05d}-of-{shards:05d}.safetensors", part)
    return directory


def float_tensors(
    reference: dict[str, np.ndarray],
) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """The reference as a float32 checkpoint (``I64`` for the hash tables)."""
    out = {}
    for name, value in reference.items():
        dtype = "I64" if value.dtype == np.int64 else "F32"
        out[name] = (dtype, tuple(value.shape), np.ascontiguousarray(value).tobytes())
    return out
