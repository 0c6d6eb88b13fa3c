"""Every published DeepSeek-V4 layout loads, or is refused in one line.

The fixtures (``published_layouts``) are tiny checkpoints written with the published
key names, header dtype strings and shapes; the reference is the float model of the
weights decoded in numpy, so a wrong nibble order, scale expansion or dtype reading
changes the weights or the logits.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx.nn import QuantizedLinear  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.switch_layers import QuantizedSwitchLinear  # noqa: E402

from mlxserve.config import Settings  # noqa: E402
from mlxserve.engine.core.build import speculative_depth  # noqa: E402
from mlxserve.errors import UsageError  # noqa: E402
from mlxserve.models.deepseek_v4.memory import weight_bytes  # noqa: E402
from mlxserve.models.loader import load_model  # noqa: E402
from mlxserve.models.safetensors_header import read_checkpoint  # noqa: E402
from tests.models.published_layouts import (  # noqa: E402
    TOKENS,
    build,
    config_for,
    float_tensors,
    write_checkpoint,
)

_CACHE: dict[str, Any] = {}


def _fixture(variant: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """``(published checkpoint, float reference checkpoint, Checkpoint)``, built once."""
    if variant not in _CACHE:
        ck = build(variant)
        root = tmp_path_factory.mktemp(f"published-{variant}")
        packed = write_checkpoint(root / "packed", config_for(variant), ck.tensors)
        reference = {n: v for n, v in ck.reference.items() if not n.startswith("mtp.")}
        if variant != "0731":
            reference = ck.reference
        plain = {k: v for k, v in config_for(variant).items() if k != "quantization_config"}
        floats = write_checkpoint(root / "float", plain, float_tensors(reference), shards=1)
        _CACHE[variant] = (packed, floats, ck)
    result: tuple[Path, Path, Any] = _CACHE[variant]
    return result


def _logits(model: Any, tokens: Any) -> list[Any]:
    """Main logits, and the MTP block's when the model has one."""
    streams = model.forward_hidden(tokens)
    out = [model.head_from_streams(streams)]
    if model.num_mtp_blocks:
        cache = model.make_mtp_cache()[0]
        out.append(model.mtp_forward(streams[:, :-1], tokens[:, 1:], cache, block=0)[0])
    return out


@pytest.mark.parametrize("variant", ["flash", "base"])
def test_published_layout_matches_the_float_reference(
    variant: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    packed, floats, ck = _fixture(variant, tmp_path_factory)
    model, _ = load_model(packed)
    expected, _ = load_model(floats)

    # The weights themselves, dequantised, are the numpy decode of the published bytes.
    experts = model.model.layers[1].ffn.switch_mlp.gate_proj
    assert isinstance(experts, QuantizedSwitchLinear)
    assert experts.mode == ("mxfp4" if variant == "flash" else "mxfp8")
    bits = 4 if variant == "flash" else 8
    got = mx.dequantize(
        experts.weight,
        experts.scales,
        group_size=32,
        bits=bits,
        mode=experts.mode,
        dtype=mx.float32,
    )
    want = np.stack([ck.reference[f"layers.1.ffn.experts.{e}.w1.weight"] for e in range(4)])
    np.testing.assert_array_equal(np.array(got), want)
    dense = model.model.layers[2].attn.wq_b
    assert isinstance(dense, QuantizedLinear) and dense.mode == "mxfp8"
    got = mx.dequantize(
        dense.weight, dense.scales, group_size=32, bits=8, mode="mxfp8", dtype=mx.float32
    )
    np.testing.assert_array_equal(np.array(got), ck.reference["layers.2.attn.wq_b.weight"])

    # And the model they make: main logits and the MTP block's (``mtp.0.*``).
    assert model.num_mtp_blocks == 1
    tokens = mx.array(TOKENS)
    for got, want in zip(_logits(model, tokens), _logits(expected, tokens), strict=True):
        assert mx.abs(want).max().item() > 0.1
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item(), mx.abs(got - want).max()

    # The header-computed footprint is what the loaded model holds, byte for byte.
    params = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert weight_bytes(read_checkpoint(packed)) == params


def test_0731_loads_its_dspark_head_and_says_so(
    tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The published -0731 checkpoint (FP8 / FP4 head too): its DSpark head is loaded
    (``model.dspark``, `tests/models/test_dspark.py`), so the engine drafts with it."""
    from mlxserve.models.deepseek_v4.dspark import head_of

    packed, floats, _ = _fixture("0731", tmp_path_factory)
    with caplog.at_level(logging.INFO, logger="mlxserve.models.loader"):
        model, _ = load_model(packed)
    lines = [r.getMessage() for r in caplog.records if r.name == "mlxserve.models.loader"]
    assert len(lines) == 1, lines
    assert "DSpark" in lines[0] and "loaded" in lines[0] and "\n" not in lines[0]
    assert model.num_mtp_blocks == 0 and head_of(model) is not None
    assert speculative_depth(Settings(), model) == "auto"
    assert speculative_depth(Settings(speculative={"depth": 3}), model) == 3

    expected, _ = load_model(floats)
    tokens = mx.array(TOKENS)
    (got,), (want,) = _logits(model, tokens), _logits(expected, tokens)
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item(), mx.abs(got - want).max()
    # The head is counted against memory, byte for byte.
    assert weight_bytes(read_checkpoint(packed)) == sum(
        v.nbytes for _, v in tree_flatten(model.parameters())
    )


def test_dspark_head_is_recognised_by_its_tensors_alone(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """A config without the ``dspark_*`` keys still does not load stages as MTP blocks."""
    _, _, ck = _fixture("0731", tmp_path_factory)
    config = {k: v for k, v in config_for("0731").items() if not k.startswith("dspark_")}
    model, _ = load_model(write_checkpoint(tmp_path / "m", config, ck.tensors))
    assert model.num_mtp_blocks == 0


def _one_line(exc: pytest.ExceptionInfo[UsageError]) -> str:
    text = str(exc.value)
    assert "\n" not in text and len(text) < 400, text
    return text


def _with(ck: Any, **changes: tuple[str, tuple[int, ...], bytes] | None) -> dict[str, Any]:
    tensors = dict(ck.tensors)
    for name, value in changes.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    return tensors


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"layers.1.attn.wkv.weight": None}, "lacks model.layers.1.attn.wkv.weight"),
        ({"layers.1.ffn.experts.2.w3.weight": None}, "experts"),
        (
            {"layers.0.attn.q_norm.weight": ("F32", (63,), bytes(63 * 4))},
            "model.layers.0.attn.q_norm.weight has shape [63]; the config gives [64]",
        ),
        (
            {"layers.1.ffn.experts.2.w1.weight": ("I8", (64, 72), bytes(64 * 72))},
            "layers.1.ffn.experts.2.w1.weight has shape [64, 72]; expert 0 has [64, 80]",
        ),
        (
            {"layers.2.attn.wq_b.scale": ("F8_E8M0", (3, 1), bytes(3))},
            "layers.2.attn.wq_b.weight: 3 scales along rows",
        ),
        ({"mtp.0.e_proj.extra": ("F32", (2,), bytes(8))}, "mtp.0.e_proj.extra"),
    ],
)
def test_missing_or_misshapen_tensors_are_refused_before_reading(
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    change: dict[str, Any],
    named: str,
) -> None:
    _, _, ck = _fixture("flash", tmp_path_factory)
    directory = write_checkpoint(tmp_path / "m", config_for("flash"), _with(ck, **change))
    mx.clear_cache()
    mx.reset_peak_memory()
    alive = mx.get_active_memory()  # other tests' arrays still held (the peak counts them)
    with pytest.raises(UsageError) as info:
        load_model(directory)
    assert named in _one_line(info)
    assert mx.get_peak_memory() - alive < 64 * 1024  # shapes only: no weight was read


def test_a_checkpoint_too_large_for_memory_is_refused_first(tmp_path: Path) -> None:
    """8 GiB of experts in the header (a sparse file): refused before any of it is read."""
    config = config_for("flash")
    big = {"layers.1.ffn.experts.0.w1.weight": ("I8", (65536, 131072), b"")}
    directory = tmp_path / "big"
    write_checkpoint(directory, config, {}, shards=1)
    path = directory / "model-00001-of-00001.safetensors"
    _write_sparse(path, big)
    mx.reset_peak_memory()
    alive = mx.get_active_memory()
    with pytest.raises(UsageError) as info:
        load_model(directory, memory_bytes=4 << 30)
    text = _one_line(info)
    assert "need 8.0 GiB" in text and "4.0 GiB is usable" in text, text
    assert mx.get_peak_memory() - alive < 64 * 1024
    # The same weights over two tensor-parallel ranks: experts are split between them.
    with pytest.raises(UsageError, match=r"need 4\.0 GiB per rank over 2 ranks"):
        load_model(directory, memory_bytes=3 << 30, ranks=2)
    with pytest.raises(UsageError, match="lacks"):  # fits in memory: on to the tensors
        load_model(directory, memory_bytes=4 << 30, ranks=2)


def _write_sparse(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    """A safetensors file whose data section is a hole: the header is all that is written."""
    import struct

    header, offset = {}, 0
    for name, (dtype, shape, _) in tensors.items():
        size = int(np.prod(shape))
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header).encode()
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
        handle.truncate(8 + len(raw) + offset)
