"""Loading DeepSeek's published FP8 / FP4 packed checkpoints (no torch needed).

A tiny random DeepSeek-V4 with an MTP block is written the way DeepSeek publishes
V4-Flash: routed experts in FP4 (two e2m1 codes per byte, one e8m0 scale per 32
inputs), the other projections in FP8 e4m3 with one power-of-two scale per block, and
the embedding, head, router, norms, hyper-connections and the compressor / indexer
pooling projections in float. The reference is the float model of the *dequantised*
weights, loaded the same way, so a wrong scale, block expansion or packing order
changes the logits. ``hidden_size`` 160 makes the 128 x 128 blocks partial at the
edges, as DeepSeek's ``ceil``-sized scale grids are.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx.nn import QuantizedLinear  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.switch_layers import QuantizedSwitchLinear  # noqa: E402

from mlxserve.errors import UsageError  # noqa: E402
from mlxserve.models.deepseek_v4 import Model, ModelArgs  # noqa: E402
from mlxserve.models.deepseek_v4.model import MTPBlock  # noqa: E402
from mlxserve.models.deepseek_v4.packed import repack, to_e8m0  # noqa: E402
from mlxserve.models.loader import load_model  # noqa: E402
from tests.models.published_layouts import (  # noqa: E402
    CONFIG,
    RENAMES,
    SLIDING,
    TOKENS,
    is_expert_stack,
    is_flattened,
    published_names,
)

#: FP8 in V4-Flash: the attention projections, the indexer's query, the shared expert
#: and the MTP input projections (the compressors and weights_proj ship in bf16).
_FP8 = re.compile(
    r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|\.indexer\.wq_b\.weight$"
    r"|\.shared_experts\.\w+\.weight$|\.(e_proj|h_proj)\.weight$"
)


def _kind(name: str) -> str | None:
    """How the published checkpoint stores the MLX parameter ``name``."""
    if is_expert_stack(name):
        return "fp4"
    return "fp8" if _FP8.search(name) else None


def _float_params(seed: int = 0) -> dict[str, Any]:
    """Random float parameters (MLX names) of the tiny model and one MTP block."""
    args = ModelArgs.from_dict(CONFIG)
    model = Model(args)
    model.mtp = [MTPBlock(args, SLIDING)]
    mx.random.seed(seed)
    params = {}
    for name, value in tree_flatten(model.parameters()):
        if not mx.issubdtype(value.dtype, mx.floating):  # hash routing table
            params[name] = mx.random.randint(0, args.n_routed_experts, value.shape).astype(
                value.dtype
            )
        elif value.ndim == 1:
            params[name] = 1.0 + 0.1 * mx.random.normal(value.shape)
        else:
            params[name] = mx.random.normal(value.shape) / value.shape[-1] ** 0.5
    return params


def _deepseek_names(name: str, value: Any, prefix: str) -> list[tuple[str, Any]]:
    """One MLX parameter as DeepSeek's tensor(s): experts split, ``wo_a`` flattened."""
    names = [prefix + published for published in published_names(name, value.shape[0])]
    if is_expert_stack(name):
        return [(published, value[e]) for e, published in enumerate(names)]
    if is_flattened(name):
        value = value.reshape(-1, value.shape[-1])
    return [(names[0], value)]


def _scale_out(exponents: np.ndarray, scale_dtype: str) -> Any:
    """Exponents (unbiased) as DeepSeek stores scales: e8m0 bytes or float powers of two."""
    if scale_dtype == "uint8":
        return mx.array((exponents + 127).astype(np.uint8))
    return mx.array(np.exp2(exponents).astype(np.float32)).astype(getattr(mx, scale_dtype))


def _fp8(w: Any, block: int, scale_dtype: str, rng: np.random.Generator) -> tuple[Any, Any, Any]:
    """``(e4m3 bytes, block scales, dequantised weight)``.

    Each block's scale is the smallest power of two that fits its largest element into
    e4m3's 448, times a random 1, 2 or 4, so neighbouring blocks differ.
    """
    rows, cols = w.shape
    grid = (-(-rows // block), -(-cols // block))
    padded = np.zeros((grid[0] * block, grid[1] * block), dtype=np.float32)
    padded[:rows, :cols] = np.abs(np.array(w))
    amax = padded.reshape(grid[0], block, grid[1], block).max(axis=(1, 3))
    exponents = np.ceil(np.log2(np.maximum(amax, 1e-30) / 448.0)) + rng.integers(0, 3, grid)
    full = np.exp2(exponents).repeat(block, 0).repeat(block, 1)[:rows, :cols]
    codes = mx.to_fp8(w / mx.array(full.astype(np.float32)))
    dequantised = mx.from_fp8(codes, mx.float32) * mx.array(full.astype(np.float32))
    return codes, _scale_out(exponents, scale_dtype), dequantised


def _fp4(w: Any, scale_dtype: str, byte_dtype: Any) -> tuple[Any, Any, Any]:
    """``(e2m1 pairs as bytes, per-32 scales, dequantised weight)`` via MLX's mxfp4."""
    packed, scales = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
    dequantised = mx.dequantize(packed, scales, group_size=32, bits=4, mode="mxfp4")
    exponents = np.array(scales).astype(np.int64) - 127
    return packed.view(byte_dtype), _scale_out(exponents, scale_dtype), dequantised


def _checkpoints(
    params: dict[str, Any],
    *,
    prefix: str,
    block: int,
    scale_dtype: str,
    byte_dtype: Any,
    seed: int = 0,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(published-style packed tensors, float tensors of the dequantised weights)``."""
    rng = np.random.default_rng(seed)
    packed: dict[str, Any] = {}
    reference: dict[str, Any] = {}
    for mlx_name, value in params.items():
        kind = _kind(mlx_name)
        for name, tensor in _deepseek_names(mlx_name, value, prefix):
            if kind is None:
                packed[name] = reference[name] = tensor
                continue
            if kind == "fp8":
                codes, scale, dequantised = _fp8(tensor, block, scale_dtype, rng)
            else:
                codes, scale, dequantised = _fp4(tensor, scale_dtype, byte_dtype)
            packed[name] = codes
            packed[f"{name.removesuffix('.weight')}.scale"] = scale
            reference[name] = dequantised
    return packed, reference


def _write(directory: Path, tensors: dict[str, Any], quantization: dict[str, Any] | None) -> Path:
    directory.mkdir()
    config = dict(CONFIG)
    if quantization is not None:
        config["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(directory / "model.safetensors"), tensors)
    return directory


def _fp8_config(block: int) -> dict[str, Any]:
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [block, block],
        "activation_scheme": "dynamic",
        "expert_dtype": "fp4",
    }


@pytest.fixture(scope="module")
def float_params() -> dict[str, Any]:
    params = _float_params()
    mx.eval(params)
    return params


@pytest.mark.parametrize(
    ("prefix", "block", "scale_dtype", "byte_dtype"),
    [
        ("", 128, "uint8", "uint8"),  # DeepSeek's own names, e8m0 scales
        ("model.", 128, "float32", "int8"),  # transformers' prefix, float powers of two
        ("", 32, "bfloat16", "int8"),  # V4.1-style 32 x 32 blocks
    ],
)
def test_packed_checkpoint_matches_dequantised_model(
    tmp_path: Path,
    float_params: dict[str, Any],
    prefix: str,
    block: int,
    scale_dtype: str,
    byte_dtype: str,
) -> None:
    packed, reference = _checkpoints(
        float_params,
        prefix=prefix,
        block=block,
        scale_dtype=scale_dtype,
        byte_dtype=getattr(mx, byte_dtype),
    )
    # The test only bites if neighbouring blocks have different scales.
    wq_b = packed[f"{prefix}layers.0.attn.wq_b.scale"]
    assert wq_b.shape == (256 // block, 64 // block if block < 64 else 1)
    assert len(set(np.array(wq_b.astype(mx.float32)).ravel().tolist())) > 1
    assert packed[f"{prefix}mtp.0.ffn.experts.3.w2.weight"].dtype == getattr(mx, byte_dtype)

    model, config = load_model(_write(tmp_path / "packed", packed, _fp8_config(block)))
    expected, _ = load_model(_write(tmp_path / "float", reference, None))
    assert config["quantization"] == {"group_size": 32, "bits": 8, "mode": "mxfp8"}

    # (a) exactly the packed projections are quantised, each in its own mode.
    quantised = {
        name: (type(module), module.mode)
        for name, module in model.named_modules()
        if isinstance(module, QuantizedLinear | QuantizedSwitchLinear)
    }
    wanted = {
        name.removesuffix(".weight"): (
            QuantizedSwitchLinear
            if ".switch_mlp." in name or ".wo_a." in name
            else QuantizedLinear,
            "mxfp4" if kind == "fp4" else "mxfp8",
        )
        for name in float_params
        if (kind := _kind(name)) is not None
    }
    assert quantised == wanted
    assert any(name.startswith("mtp.0.") for name in quantised)
    # What the reference keeps in float32 (hyper-connections, sinks, router bias,
    # compressor position bias, hash table) is untouched.
    for name, value in tree_flatten(model.parameters()):
        if not model.cast_predicate(name):
            assert value.dtype in (mx.float32, mx.int32), name

    # (b) logits of the main model and (d) of the MTP block equal the float model's.
    tokens = mx.array(TOKENS)
    for got, want in zip(_outputs(model, tokens), _outputs(expected, tokens), strict=True):
        assert mx.abs(want).max().item() > 0.1
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item(), mx.abs(got - want).max()


def _outputs(model: Any, tokens: Any) -> tuple[Any, Any]:
    """Main logits and MTP-block logits for ``tokens``."""
    streams = model.forward_hidden(tokens)
    logits = model.head_from_streams(streams)
    mtp_logits, _ = model.mtp_forward(
        streams[:, :-1], tokens[:, 1:], model.make_mtp_cache()[0], block=0
    )
    return logits, mtp_logits


@pytest.mark.parametrize("block", [128, 32])
def test_sanitize_expands_block_scales_per_row_and_group(
    float_params: dict[str, Any], block: int
) -> None:
    packed, _ = _checkpoints(
        float_params, prefix="", block=block, scale_dtype="uint8", byte_dtype=mx.uint8
    )
    model = Model(ModelArgs.from_dict(CONFIG))
    clean = model.sanitize(packed)
    # Every FP8 scale, checked against an independent per-element lookup.
    for name, scale in packed.items():
        if not name.endswith(".scale") or ".experts." in name:
            continue
        weight = packed[f"{name.removesuffix('.scale')}.weight"]
        rows, cols = weight.shape
        grid = np.array(scale)
        row_of = np.arange(rows)[:, None] // block
        col_of = (np.arange(cols // 32)[None, :] * 32) // block
        want = grid[row_of, col_of]
        got_name = _mlx_name(name)
        got = clean[f"{got_name}.scales"]
        assert got.dtype == mx.uint8
        assert clean[f"{got_name}.weight"].dtype == mx.uint32
        np.testing.assert_array_equal(np.array(got).reshape(rows, -1), want, err_msg=name)
    # Experts: stacked, their per-32 scales untouched.
    stacked = clean["mtp.0.ffn.switch_mlp.down_proj.scales"]
    want_experts = mx.stack([packed[f"mtp.0.ffn.experts.{e}.w2.scale"] for e in range(4)])
    assert mx.array_equal(stacked, want_experts).item()
    # Sanitising the result again changes nothing (MLX-converted checkpoints).
    again = model.sanitize(clean)
    assert set(again) == set(clean)
    assert all(mx.array_equal(again[k], clean[k]).item() for k in clean)


def _mlx_name(deepseek: str) -> str:
    """The MLX module path of a DeepSeek ``X.scale`` tensor (non-expert)."""
    base = deepseek.removesuffix(".scale")
    for mlx_name, ds_name in RENAMES:
        base = base.replace(ds_name.rstrip("."), mlx_name.rstrip("."))
    return base if base.startswith("mtp.") else f"model.{base}"


def test_float_scales_become_e8m0() -> None:
    for dtype in (mx.float32, mx.bfloat16, mx.float16):
        scale = mx.array([1.0, 2.0, 0.5, 2.0**-10, 2.0**7], dtype=dtype)
        assert to_e8m0(scale).tolist() == [127, 128, 126, 117, 134]
    with pytest.raises(ValueError, match="uint8"):
        to_e8m0(mx.array([1, 2], dtype=mx.int32))


def test_repack_rejects_what_mx_formats_cannot_hold() -> None:
    codes = mx.zeros((64, 64), dtype=mx.uint8)
    with pytest.raises(ValueError, match="1-byte"):
        repack(codes.astype(mx.float32), mx.zeros((1, 1), dtype=mx.uint8), "w")
    with pytest.raises(ValueError, match="multiple of 32"):  # 16-column FP8 blocks
        repack(codes, mx.zeros((1, 4), dtype=mx.uint8), "w")
    with pytest.raises(ValueError, match="power-of-two"):  # 3 blocks over 64 rows
        repack(codes, mx.zeros((3, 1), dtype=mx.uint8), "w")


def test_sanitize_rejects_partly_packed_experts() -> None:
    model = Model(ModelArgs.from_dict(CONFIG))
    weights = {
        f"layers.1.ffn.experts.{e}.w1.weight": mx.zeros((64, 80), dtype=mx.uint8) for e in range(4)
    }
    weights["layers.1.ffn.experts.0.w1.scale"] = mx.zeros((64, 5), dtype=mx.uint8)
    with pytest.raises(ValueError, match="only some"):
        model.sanitize(weights)


@pytest.mark.parametrize(
    ("quantization", "named"),
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "scale_fmt None"),
        ({**_fp8_config(128), "fmt": "e5m2"}, "fmt 'e5m2'"),
        ({**_fp8_config(128), "weight_block_size": [96, 96]}, "weight_block_size"),
        ({**_fp8_config(128), "weight_block_size": [128, 16]}, "weight_block_size"),
        ({**_fp8_config(128), "expert_dtype": "int4"}, "expert_dtype 'int4'"),
    ],
)
def test_loader_names_unsupported_quantization_config(
    tmp_path: Path, quantization: dict[str, Any], named: str
) -> None:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(
        json.dumps({**CONFIG, "quantization_config": quantization})
    )
    with pytest.raises(UsageError, match="unsupported quantization_config") as info:
        load_model(directory)
    assert named in str(info.value)
