"""Tensor parallelism for DeepSeek-V4.

Each rank keeps ``heads / n`` query heads (``wq_b`` rows, ``attn_sink``), the matching
whole output groups of ``wo_a`` and the matching columns of ``wo_b`` (whose output is
summed over ranks), plus ``1 / n`` of every expert's intermediate dim (routed and
shared; the MoE sums its output over ranks). The single K=V head, the compressors, the
indexer, the routers and the hyper-connections are small and stay replicated, so
every rank computes the same indexer picks and routing.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx.nn.layers.distributed import shard_inplace, shard_linear

if TYPE_CHECKING:
    from .model import Model


#: Tensors ``shard_model`` splits over the ranks (DeepSeek or MLX names, weights and
#: scales alike); every other tensor is replicated on each rank.
_SHARDED = re.compile(
    r"\.attn\.(wq_b|wo_a|wo_b)\.|\.attn\.attn_sink$|\.ffn\.(experts|shared_experts|switch_mlp)\."
)


def is_sharded(name: str) -> bool:
    """Whether each rank holds only ``1 / n`` of tensor ``name`` (see the module docstring)."""
    return _SHARDED.search(name) is not None


def check_shardable(model: Model, size: int) -> None:
    """Raise ``ValueError`` unless ``size`` ranks split the model evenly."""
    args = model.args
    sizes = {
        "attention heads (num_attention_heads)": args.num_attention_heads,
        "output groups (o_groups)": args.o_groups,
        "expert intermediate size (moe_intermediate_size)": args.moe_intermediate_size,
    }
    bad = [f"{name} = {value}" for name, value in sizes.items() if value % size]
    if bad:
        raise ValueError(
            f"Cannot shard DeepSeek-V4 over {size} ranks: {size} must divide the "
            + ", ".join(bad)
            + "."
        )


def shard_model(model: Model, group: mx.distributed.Group) -> None:
    """Shard ``model`` in place over ``group`` (see the module docstring)."""
    size, rank = group.size(), group.rank()
    check_shardable(model, size)
    if size == 1:
        return
    for layer in [*model.layers, *model.mtp]:
        attn = layer.attn
        attn.wq_b = shard_linear(attn.wq_b, "all-to-sharded", group=group)
        # Output group g reads heads g*H/G .. (g+1)*H/G - 1, so a rank keeps whole groups.
        shard_inplace(attn.wo_a, lambda path, weight: 0, group=group)
        attn.wo_b = shard_linear(attn.wo_b, "sharded-to-all", group=group)
        attn.num_heads //= size
        attn.o_groups //= size
        attn._group_ids = mx.arange(attn.o_groups)[None]
        attn.attn_sink = attn.attn_sink[rank * attn.num_heads : (rank + 1) * attn.num_heads]

        ffn = layer.ffn
        ffn.sharding_group = group
        for mlp in (ffn.switch_mlp, ffn.shared_experts):
            shard_inplace(mlp.gate_proj, "all-to-sharded", group=group)
            shard_inplace(mlp.up_proj, "all-to-sharded", group=group)
            shard_inplace(mlp.down_proj, "sharded-to-all", group=group)
