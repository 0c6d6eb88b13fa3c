"""Read a checkpoint's safetensors headers without reading its tensors.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype string (``F8_E4M3``, ``I8``, ...), shape and byte range, then the data.
Reading only the headers tells what a checkpoint holds and how many bytes it will take
before anything large is allocated, so a download that is truncated, a tensor whose
byte range disagrees with its shape, or a dtype MLX cannot read is refused with one
line naming the file and the tensor, instead of failing half-way through a load.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

#: Bytes per element of every dtype string ``mx.load`` reads (measured with mlx 0.32.4:
#: F8_E8M0 and F8_E4M3 come back as uint8, I8 as int8). It refuses F4, F6_* and F8_E5M2.
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}

#: The safetensors format caps the JSON header at 100 MB; a larger length is a broken file.
MAX_HEADER_BYTES = 100_000_000


class HeaderError(ValueError):
    """A checkpoint file whose header cannot be what it claims (one line, names the file)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, checked against the file's size."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise HeaderError(f"{path}: not a safetensors file ({size} bytes)")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise HeaderError(f"{path}: header of {length} bytes in a file of {size} bytes")
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HeaderError(f"{path}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: header is not a JSON object")
    data_bytes = size - 8 - length
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor(path, name, entry, data_bytes)
    return tensors


def _tensor(path: Path, name: str, entry: object, data_bytes: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise HeaderError(f"{path}: tensor {name!r} has no dtype / shape / data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise HeaderError(f"{path}: tensor {name!r} has dtype {dtype!r}, which MLX cannot read")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise HeaderError(f"{path}: tensor {name!r} has shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets):
        raise HeaderError(f"{path}: tensor {name!r} has data_offsets {offsets!r}")
    info = TensorInfo(name, str(dtype), tuple(int(d) for d in shape), path)
    begin, end = offsets
    if end - begin != info.nbytes:
        raise HeaderError(
            f"{path}: tensor {name!r} is {dtype} {list(info.shape)} ({info.nbytes} bytes) "
            f"but spans {end - begin} bytes"
        )
    if end > data_bytes:
        raise HeaderError(
            f"{path}: tensor {name!r} ends at byte {end} of a data section of {data_bytes} "
            "bytes (truncated download?)"
        )
    return info


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def weight_files(directory: Path) -> list[Path]:
    """The files ``mlx_lm``'s loader reads, in a stable order (``model*.safetensors``)."""
    return sorted(directory.glob("model*.safetensors"))


def read_checkpoint(directory: Path) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint directory; a name in two files is refused."""
    tensors: dict[str, TensorInfo] = {}
    for path in weight_files(directory):
        for name, info in read_header(path).items():
            if name in tensors:
                raise HeaderError(
                    f"{directory}: tensor {name!r} is in both {tensors[name].file.name} "
                    f"and {path.name}"
                )
            tensors[name] = info
    return tensors
