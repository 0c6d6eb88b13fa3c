"""Tensor parallelism for DeepSeek-V4, over an even or uneven split.

Each rank keeps a share of the query heads (``wq_b`` rows, ``attn_sink``), the matching
whole output groups of ``wo_a`` and the matching columns of ``wo_b`` (whose output is
summed over ranks), plus a share of every expert's intermediate dim (routed and
shared; the MoE sums its output over ranks). The single K=V head, the compressors, the
indexer, the routers and the hyper-connections are small and stay replicated, so
every rank computes the same indexer picks and routing.

The split is a parameter: ``split[r]`` is rank ``r``'s share in whole parts, and every
sharded dim is cut into ``sum(split)`` equal parts, rank ``r`` taking ``split[r]``
neighbouring ones. Why parts of one size for every dim: a rank's share of the work and
of the memory is then the same fraction everywhere, which is what a policy balancing
ranks of different speed and memory reasons about. The default, one part each, is
the even split. A part must hold whole output groups (so whole heads) and whole
quantisation groups of every sliced tensor; ``split_problems`` names what does not.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.utils import tree_flatten, tree_map_with_path

if TYPE_CHECKING:
    from .model import Model


#: Tensors ``shard_model`` splits over the ranks (DeepSeek or MLX names, weights and
#: scales alike); every other tensor is replicated on each rank.
_SHARDED = re.compile(
    r"\.attn\.(wq_b|wo_a|wo_b)\.|\.attn\.attn_sink$|\.ffn\.(experts|shared_experts|switch_mlp)\."
)

#: The axis a parameter is cut along, from its path and array (None: kept whole).
AxisOf = Callable[[str, mx.array], int | None]


def is_sharded(name: str) -> bool:
    """Whether each rank holds only its share of tensor ``name`` (see the module docstring)."""
    return _SHARDED.search(name) is not None


def even_split(size: int) -> list[int]:
    """One part per rank: today's even split."""
    return [1] * size


def share(split: Sequence[int], rank: int) -> tuple[int, int, int]:
    """``(first part, end part, parts)`` of rank ``rank``: it holds parts [first, end)."""
    first = sum(split[:rank])
    return first, first + split[rank], sum(split)


def describe_split(split: Sequence[int]) -> str:
    """``3+1 (4 parts)``: how errors and logs name a split."""
    return "+".join(str(s) for s in split) + f" ({sum(split)} parts)"


def check_split_shape(split: Sequence[int], size: int) -> list[int]:
    """``split`` as a list, or ``ValueError`` unless it is one whole share >= 1 per rank."""
    if len(split) != size:
        raise ValueError(f"a split needs one share per rank: {size} ranks, {len(split)} shares")
    for value in split:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"a split's shares are whole numbers >= 1, not {value!r}")
    return list(split)


def _rows(path: str, weight: mx.array) -> int | None:
    """An "all-to-sharded" layer: output rows (a bias along its only axis)."""
    return -1 if path.endswith("bias") else max(weight.ndim - 2, 0)


def _columns(path: str, weight: mx.array) -> int | None:
    """A "sharded-to-all" layer: input columns (packed weight, scales, biases); no bias."""
    return None if path.endswith("bias") else -1


def _groups(path: str, weight: mx.array) -> int | None:
    """``wo_a``'s stacked output groups (axis 0 of every parameter)."""
    return 0


def _pieces(model: Model) -> Iterator[tuple[str, Module, AxisOf]]:
    """Every sharded module of ``model`` with its name and the axis it is cut along."""
    blocks = [(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]
    blocks += [(f"mtp.{i}", block) for i, block in enumerate(model.mtp)]
    for name, block in blocks:
        attn, ffn = block.attn, block.ffn
        yield f"{name}.attn.wq_b", attn.wq_b, _rows
        yield f"{name}.attn.wo_a", attn.wo_a, _groups
        yield f"{name}.attn.wo_b", attn.wo_b, _columns
        for mlp_name in ("switch_mlp", "shared_experts"):
            mlp = getattr(ffn, mlp_name)
            where = f"{name}.ffn.{mlp_name}"
            yield f"{where}.gate_proj", mlp.gate_proj, _rows
            yield f"{where}.up_proj", mlp.up_proj, _rows
            yield f"{where}.down_proj", mlp.down_proj, _columns


def split_problems(model: Model, split: Sequence[int]) -> list[str]:
    """What ``sum(split)`` equal parts would cut unevenly; empty when the split works.

    The model's named sizes come first (heads with their output groups, the experts'
    intermediate size and, for quantised experts, their quantisation groups), then any
    other sliced tensor whose length along its cut does not divide (e.g. a quantised
    ``wo_b`` whose parts would split a quantisation group).
    """
    parts = sum(split)
    args = model.args
    sizes: dict[str, int] = {
        "attention heads (num_attention_heads)": args.num_attention_heads,
        "output groups (o_groups)": args.o_groups,
        "expert intermediate size (moe_intermediate_size)": args.moe_intermediate_size,
    }
    down = model.layers[0].ffn.switch_mlp.down_proj if model.layers else None
    group_size = getattr(down, "group_size", None)
    if isinstance(group_size, int) and hasattr(down, "scales"):
        sizes[f"expert quantisation groups (moe_intermediate_size / group_size {group_size})"] = (
            args.moe_intermediate_size // group_size
        )
    bad = [f"{name} = {value}" for name, value in sizes.items() if value % parts]
    if bad:
        return bad
    for name, module, axis_of in _pieces(model):
        params = dict(tree_flatten(module.parameters()))  # type: ignore[no-untyped-call]
        for path, weight in params.items():
            axis = axis_of(path, weight)
            if axis is not None and weight.shape[axis] % parts:
                bad.append(f"{name}.{path} ({weight.shape[axis]} along axis {axis})")
    return bad


def check_shardable(model: Model, size: int, split: Sequence[int] | None = None) -> list[int]:
    """The split to use (``split``, default even); ``ValueError`` naming what does not
    divide when ``size`` ranks cannot split the model that way."""
    split = even_split(size) if split is None else check_split_shape(split, size)
    bad = split_problems(model, split)
    if bad:
        how = "" if split == even_split(size) else f" as {describe_split(split)}"
        raise ValueError(
            f"Cannot shard DeepSeek-V4 over {size} ranks{how}: {sum(split)} must divide the "
            + ", ".join(bad)
            + "."
        )
    return split


def _cut(module: Module, axis_of: AxisOf, first: int, end: int, parts: int) -> None:
    """Keep parts [first, end) of ``parts`` along each parameter's axis (lazily: an
    unread checkpoint tensor stays unread until the slice is evaluated)."""

    def cut(path: str, weight: Any) -> Any:
        if not isinstance(weight, mx.array):
            return weight
        axis = axis_of(path, weight)
        if axis is None:
            return weight
        step = weight.shape[axis] // parts
        index = [slice(None)] * weight.ndim
        index[axis] = slice(first * step, end * step)
        return mx.contiguous(weight[tuple(index)])

    module.update(tree_map_with_path(cut, module.parameters()))  # type: ignore[no-untyped-call]


def slice_for_rank(model: Model, split: Sequence[int], rank: int) -> None:
    """Keep only rank ``rank``'s share of every sharded tensor; no communication.

    The model then computes this rank's partial outputs of each attention output and
    MoE; ``shard_model`` adds the sums over the group. Call ``check_shardable`` first.
    """
    first, end, parts = share(split, rank)
    for _, module, axis_of in _pieces(model):
        _cut(module, axis_of, first, end, parts)
    for block in [*model.layers, *model.mtp]:
        attn = block.attn
        heads_per_part = attn.num_heads // parts
        groups_per_part = attn.o_groups // parts
        attn.attn_sink = attn.attn_sink[first * heads_per_part : end * heads_per_part]
        attn.num_heads = heads_per_part * (end - first)
        attn.o_groups = groups_per_part * (end - first)
        attn._group_ids = mx.arange(attn.o_groups)[None]


def shard_model(
    model: Model, group: mx.distributed.Group, split: Sequence[int] | None = None
) -> None:
    """Shard ``model`` in place over ``group`` by ``split`` (default: even; see the
    module docstring). Raises ``ValueError`` naming what the split does not divide."""
    size, rank = group.size(), group.rank()
    split = check_shardable(model, size, split)
    if size == 1:
        return
    slice_for_rank(model, split, rank)
    for block in [*model.layers, *model.mtp]:
        block.attn.sharding_group = group
        block.ffn.sharding_group = group
