"""Safetensors headers are read, and checked against the file, without reading tensors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from mlxserve.errors import UsageError
from mlxserve.models.loader import load_model
from mlxserve.models.safetensors_header import (
    HeaderError,
    read_checkpoint,
    read_header,
)
from tests.models.published_layouts import write_safetensors

CODES = np.arange(64, dtype=np.uint8).reshape(8, 8)


def _raw(path: Path, header: dict[str, object], data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_reads_published_dtype_strings_and_sizes(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    write_safetensors(
        path,
        {
            "w.weight": ("F8_E4M3", (8, 8), CODES.tobytes()),
            "w.scale": ("F8_E8M0", (1, 1), b"\x7f"),
            "e.weight": ("I8", (8, 4), CODES[:, :4].tobytes()),
            "t": ("I64", (2,), np.array([1, 2], np.int64).tobytes()),
        },
    )
    tensors = read_header(path)
    assert {n: (i.dtype, i.shape, i.nbytes) for n, i in tensors.items()} == {
        "w.weight": ("F8_E4M3", (8, 8), 64),
        "w.scale": ("F8_E8M0", (1, 1), 1),
        "e.weight": ("I8", (8, 4), 32),
        "t": ("I64", (2,), 16),
    }
    # And MLX reads the same file as those dtypes say (1-byte codes stay bytes).
    mx = pytest.importorskip("mlx.core")
    loaded = mx.load(str(path))
    assert loaded["w.weight"].dtype == mx.uint8 and loaded["e.weight"].dtype == mx.int8
    assert np.array(loaded["w.weight"]).tobytes() == CODES.tobytes()


@pytest.mark.parametrize(
    ("header", "data", "named"),
    [
        ({"w": {"dtype": "F4", "shape": [8], "data_offsets": [0, 4]}}, bytes(4), "dtype 'F4'"),
        (
            {"w": {"dtype": "F8_E5M2", "shape": [8], "data_offsets": [0, 8]}},
            bytes(8),
            "dtype 'F8_E5M2', which MLX cannot read",
        ),
        (
            {"w": {"dtype": "F32", "shape": [8], "data_offsets": [0, 16]}},
            bytes(16),
            "'w' is F32 [8] (32 bytes) but spans 16 bytes",
        ),
        (
            {"w": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}},
            bytes(20),
            "'w' ends at byte 32 of a data section of 20 bytes (truncated download?)",
        ),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4), "shape [-1]"),
        ({"w": [1, 2]}, b"", "'w' has no dtype"),
    ],
)
def test_broken_headers_are_named(
    tmp_path: Path, header: dict[str, object], data: bytes, named: str
) -> None:
    path = _raw(tmp_path / "model.safetensors", header, data)
    with pytest.raises(HeaderError) as info:
        read_header(path)
    assert named in str(info.value) and str(path) in str(info.value)


def test_not_a_safetensors_file(tmp_path: Path) -> None:
    short = tmp_path / "a.safetensors"
    short.write_bytes(b"abc")
    with pytest.raises(HeaderError, match="not a safetensors file"):
        read_header(short)
    huge = tmp_path / "b.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(HeaderError, match="header of 1099511627776 bytes in a file of 10"):
        read_header(huge)
    text = tmp_path / "c.safetensors"
    text.write_bytes(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(HeaderError, match="not JSON"):
        read_header(text)


def test_a_tensor_in_two_files_is_refused(tmp_path: Path) -> None:
    for index in (1, 2):
        write_safetensors(tmp_path / f"model-{index}.safetensors", {"w": ("U8", (1,), b"\x00")})
    with pytest.raises(HeaderError, match=r"'w' is in both model-1\.safetensors and model-2"):
        read_checkpoint(tmp_path)


def test_the_loader_refuses_a_truncated_download_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v4"}')
    path = tmp_path / "model-00001-of-00002.safetensors"
    write_safetensors(path, {"embed.weight": ("F32", (64, 16), bytes(64 * 16 * 4))})
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(UsageError) as info:
        load_model(tmp_path)
    text = str(info.value)
    assert "\n" not in text and "'embed.weight'" in text and "truncated" in text


def test_the_loader_refuses_a_directory_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v4"}')
    with pytest.raises(UsageError, match=r"no weights \(model\*\.safetensors\)"):
        load_model(tmp_path)
