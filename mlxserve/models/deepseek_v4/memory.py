"""What a DeepSeek-V4 checkpoint occupies once loaded, from its safetensors headers.

Packed weights stay packed (``packed.py``), so a tensor costs what its header says,
except the FP8 block scales: ``repack`` spreads each 128 x 128 block's scale over
every row and 32-column group, one byte each (``rows * cols / 32``), and turns float
scales into one-byte e8m0; the hash tables (``tid2eid``) become int32. Under tensor
parallelism a rank holds its share (``1 / n``, or ``split[rank] / sum(split)``) of the
tensors ``sharding.is_sharded`` names and the whole of the rest.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..safetensors_header import DTYPE_BYTES, TensorInfo
from .packed import repacked_scale_bytes
from .sharding import is_sharded

#: Routed experts (DeepSeek's per-expert names or MLX's stacked ones): a decode step
#: reads only the top-k experts' rows of them.
_ROUTED = re.compile(r"\.ffn\.(experts|switch_mlp)\.")

#: Tables a step reads one row of: the token embedding and the hash-routing table.
_LOOKUP = re.compile(r"(^|\.)embed(_tokens)?\.|tid2eid$")


def _loaded_size(name: str, info: TensorInfo, tensors: Mapping[str, TensorInfo]) -> int:
    """Bytes ``name`` occupies once loaded (see the module docstring)."""
    weight = tensors.get(name.removesuffix(".scale") + ".weight")
    if name.endswith(".scale") and weight is not None and DTYPE_BYTES[weight.dtype] == 1:
        return repacked_scale_bytes(weight.shape, info.shape)
    if name.endswith(".tid2eid"):
        return info.nbytes // DTYPE_BYTES[info.dtype] * 4
    return info.nbytes


def weight_bytes(
    tensors: Mapping[str, TensorInfo],
    ranks: int = 1,
    *,
    split: Sequence[int] | None = None,
    rank: int = 0,
) -> int:
    """Bytes of weights rank ``rank`` of ``ranks`` holds after loading ``tensors``,
    sharded by ``split`` (default: even, the same for every rank)."""
    parts, mine = (ranks, 1) if split is None else (sum(split), split[rank])
    total = 0
    for name, info in tensors.items():
        size = _loaded_size(name, info, tensors)
        if ranks > 1 and is_sharded(name):
            size = -(-size * mine // parts)
        total += size
    return total


def expert_group_size(config: Mapping[str, Any]) -> int:
    """Columns per quantisation group of the experts' weights (1 when not quantised).

    MLX-quantised checkpoints say it in ``quantization``; DeepSeek's FP8 / FP4 ones
    become ``mxfp8`` / ``mxfp4``, groups of 32.
    """
    quant = config.get("quantization")
    if isinstance(quant, Mapping) and isinstance(quant.get("group_size"), int):
        return int(quant["group_size"])
    if config.get("quantization_config"):
        return 32
    return 1


def split_granularity(config: Mapping[str, Any], tensors: Mapping[str, TensorInfo]) -> int:
    """Most equal parts the sharded tensors can be cut into: whole output groups (so
    whole heads), whole expert columns and whole quantisation groups of the quantised
    experts and ``wo_b`` input columns (``sharding.split_problems`` checks the loaded
    model itself). Which tensors are quantised, the headers say (their scales)."""
    groups = int(config.get("o_groups", 8))
    inter = int(config.get("moe_intermediate_size", 2048))
    lora = int(config.get("o_lora_rank", 1024))
    size = expert_group_size(config)
    scaled = [name for name in tensors if name.endswith((".scales", ".scale"))]
    granularity = math.gcd(groups, inter)
    if size > 1 and any(_ROUTED.search(n) or ".shared_experts." in n for n in scaled):
        granularity = math.gcd(granularity, inter // size)
    if size > 1 and any(".attn.wo_b." in name for name in scaled):
        granularity = math.gcd(granularity, groups * lora // size)
    return max(granularity, 1)


def shape_numbers(config: Mapping[str, Any], tensors: Mapping[str, TensorInfo]) -> dict[str, int]:
    """What the split policy reads of a checkpoint (``policy.split.ModelShape``'s fields):
    bytes held and bytes a decode step reads, replicated and sharded."""
    top_k = int(config.get("num_experts_per_tok", 6))
    experts = max(int(config.get("n_routed_experts", 256)), 1)
    numbers = dict.fromkeys(
        ("replicated_bytes", "sharded_bytes", "replicated_read", "sharded_read"), 0
    )
    for name, info in tensors.items():
        size = _loaded_size(name, info, tensors)
        kind = "sharded" if is_sharded(name) else "replicated"
        numbers[f"{kind}_bytes"] += size
        if _LOOKUP.search(name):
            continue
        numbers[f"{kind}_read"] += size * top_k // experts if _ROUTED.search(name) else size
    numbers["granularity"] = split_granularity(config, tensors)
    return numbers
