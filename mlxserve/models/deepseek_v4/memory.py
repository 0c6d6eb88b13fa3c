"""What a DeepSeek-V4 checkpoint occupies once loaded, from its safetensors headers.

Packed weights stay packed (``packed.py``), so a tensor costs what its header says,
except the FP8 block scales: ``repack`` spreads each 128 x 128 block's scale over
every row and 32-column group, one byte each (``rows * cols / 32``), and turns float
scales into one-byte e8m0; the hash tables (``tid2eid``) become int32. Under tensor
parallelism a rank holds ``1 / n`` of the tensors ``sharding.is_sharded`` names and the
whole of the rest.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..safetensors_header import DTYPE_BYTES, TensorInfo
from .packed import repacked_scale_bytes
from .sharding import is_sharded


def weight_bytes(tensors: Mapping[str, TensorInfo], ranks: int = 1) -> int:
    """Bytes of weights each of ``ranks`` ranks holds after loading ``tensors``."""
    total = 0
    for name, info in tensors.items():
        size = info.nbytes
        weight = tensors.get(name.removesuffix(".scale") + ".weight")
        if name.endswith(".scale") and weight is not None and DTYPE_BYTES[weight.dtype] == 1:
            size = repacked_scale_bytes(weight.shape, info.shape)
        elif name.endswith(".tid2eid"):
            size = info.nbytes // DTYPE_BYTES[info.dtype] * 4
        if ranks > 1 and is_sharded(name):
            size = -(-size // ranks)
        total += size
    return total
