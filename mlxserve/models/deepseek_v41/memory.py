"""What a DeepSeek-V4.1 checkpoint occupies per rank once loaded, from its headers.

Why a V4.1 rule of its own: the parts mlxserve does not serve (the vision tower and
the draft head, ``parts.NOT_SERVED``) are never loaded, and mlx-lm's tensor-parallel
``shard`` of ``deepseek_v41`` splits only the query up-projection, the grouped output
projections and the experts' (routed and shared) hidden dimension over the ranks;
everything else, the Engram tables (~98 GB each in FP8 in the release) included, is
held whole by every rank. Packed FP8 / FP4 weights stay packed, so a tensor costs
what its header says (the scales are small next to it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..safetensors_header import TensorInfo
from .parts import NOT_SERVED

#: Tensors mlx-lm's ``Model.shard`` divides among the ranks (published names).
_SHARDED = re.compile(
    r"^(model\.)?layers\.\d+\.(attn\.(wq_b|wo_a|wo_b)\.|ffn\.(experts\.\d+|shared_experts)\.w[123]\.)"
)


def is_sharded(name: str) -> bool:
    return _SHARDED.match(name) is not None


def is_loaded(name: str) -> bool:
    bare = name.removeprefix("model.")
    return not any(bare.startswith(prefixes) for prefixes in NOT_SERVED.values())


def weight_bytes(tensors: Mapping[str, TensorInfo], ranks: int = 1) -> int:
    """Bytes of weights each of ``ranks`` tensor-parallel ranks holds (even split)."""
    total = 0
    for name, info in tensors.items():
        if not is_loaded(name):
            continue
        total += -(-info.nbytes // ranks) if is_sharded(name) else info.nbytes
    return total
