"""What a DeepSeek-V4 checkpoint occupies once loaded, from its safetensors headers.

Packed weights stay packed (``packed.py``), so a tensor costs what its header says,
except the FP8 block scales: ``repack`` spreads each 128 x 128 block's scale over
every row and 32-column group, one byte each (``rows * cols / 32``), and turns float
scales into one-byte e8m0; the hash tables (``tid2eid``) become int32. Under tensor
parallelism a rank holds its share (``1 / n``, or ``split[rank] / sum(split)``) of the
tensors ``sharding.is_sharded`` names and the whole of the rest.

And what one sequence adds to them (`sequence_peak_bytes`, the prediction
docs/deepseek-v4-flash.md states and ``benchmarks/real_width.py`` measures against):
its cache (`cache_bytes`) and one prefill chunk's bounded working set
(`prefill_working_bytes`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..safetensors_header import DTYPE_BYTES, TensorInfo
from .config import CSA, ModelArgs
from .indexer import SCORE_BYTES
from .packed import repacked_scale_bytes
from .prefill_attention import WORKING_BYTES
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


def cache_bytes(args: ModelArgs, context: int, itemsize: int = 4) -> int:
    """Bytes of one sequence's cache after ``context`` tokens, from the layer shapes.

    Per layer the window's last ``sliding_window - 1`` K=V rows; per compressor (a
    compressed layer's own, and a CSA layer's indexer's) its ``context // ratio``
    entries, float32 (pooled under a float32 softmax), and the raw (kv, gate) rows it
    still needs (its open window, and the one before it when windows overlap: twice
    as wide then). The rows are the activations' dtype, the residual streams' (the
    norms cast their output back to their input's dtype, ``norm.py``): ``itemsize`` 2
    for a bfloat16 checkpoint, 4 for a float32 one.
    """
    total = 0
    for kind in args.layer_types or []:
        total += itemsize * min(args.sliding_window - 1, context) * args.head_dim
        ratio = args.compress_ratio(kind)
        if not ratio:
            continue
        compressors = [args.head_dim] + ([args.index_head_dim] if kind == CSA else [])
        overlap = kind == CSA
        closed = context // ratio
        held = context - max(closed - (1 if overlap else 0), 0) * ratio
        for dim in compressors:
            total += 4 * closed * dim
            total += itemsize * 2 * held * (2 * dim if overlap else dim)
    return total


def prefill_working_bytes(
    args: ModelArgs,
    chunk: int,
    itemsize: int = 4,
    attention_budget: int = WORKING_BYTES,
    score_budget: int = SCORE_BYTES,
) -> int:
    """The most a prefill chunk of ``chunk`` tokens holds beside the weights and the cache.

    Two parts, each bounded whatever the context: the chunk's activations, about three
    query-wide rows per token (``num_attention_heads x head_dim`` values of
    ``itemsize``: the rotated queries the attention reads, its per-group outputs and
    their concatenation, the widest arrays of a layer), and the larger of the two
    grouped stages' budgets, the attention's query groups (``attention_budget``,
    `prefill_attention.WORKING_BYTES`) and the indexer's score groups
    (``score_budget``, `indexer.SCORE_BYTES`), which run one after the other and one
    group at a time.
    """
    activations = 3 * chunk * args.num_attention_heads * args.head_dim * itemsize
    return activations + max(attention_budget, score_budget)


def sequence_peak_bytes(
    weights: int, args: ModelArgs, context: int, chunk: int, itemsize: int = 4
) -> int:
    """What one sequence of ``context`` tokens prefilled in ``chunk``s peaks at: the
    weights, its cache (`cache_bytes`) and a chunk's working set (`prefill_working_bytes`;
    a decode step's, its logits and the head's float32 slices, is smaller)."""
    cache = cache_bytes(args, context, itemsize)
    return weights + cache + prefill_working_bytes(args, chunk, itemsize)
