"""What a DeepSeek-V4.1 checkpoint occupies per rank once loaded, from its headers.

Why a V4.1 rule of its own: the parts mlxserve does not serve (the vision tower, and
the draft head unless the config describes its DSpark head: ``parts.not_served_parts``)
are never loaded, and mlx-lm's tensor-parallel
``shard`` of ``deepseek_v41`` splits only the query up-projection, the grouped output
projections (with the heads' attention sinks) and the experts' (routed and shared)
hidden dimension over the ranks;
everything else, the Engram tables (~98 GB each in FP8 in the release) and a DSpark
head included, is held whole by every rank. Packed FP8 / FP4 weights stay packed, so a tensor costs
what its header says (the scales are small next to it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..safetensors_header import TensorInfo
from .parts import not_served_parts

#: Tensors mlx-lm's ``Model.shard`` divides among the ranks (published names).
_SHARDED = re.compile(
    r"^(model\.)?layers\.\d+\.(attn\.(wq_b\.|wo_a\.|wo_b\.|attn_sink$)|ffn\.(experts\.\d+|shared_experts)\.w[123]\.)"
)


def is_sharded(name: str) -> bool:
    return _SHARDED.match(name) is not None


def is_loaded(name: str, config: Mapping[str, Any] | None = None) -> bool:
    """Whether a checkpoint tensor is held once loaded: not a part left unserved, nor a
    gate's ``bias_vl`` (it routes image tokens; the text model drops it)."""
    bare = name.removeprefix("model.")
    if bare.endswith(".gate.bias_vl"):
        return False
    return not any(bare.startswith(p) for p in not_served_parts(config).values())


def weight_bytes(
    tensors: Mapping[str, TensorInfo], ranks: int = 1, config: Mapping[str, Any] | None = None
) -> int:
    """Bytes of weights each of ``ranks`` tensor-parallel ranks holds (even split) of a
    checkpoint with ``config`` (config.json: whether its draft head is served)."""
    total = 0
    for name, info in tensors.items():
        if not is_loaded(name, config):
            continue
        total += -(-info.nbytes // ranks) if is_sharded(name) else info.nbytes
    return total
