"""Uneven tensor-parallel splits of DeepSeek-V4, on one process (no distributed).

Each rank's slice of a tiny model is cut by ``slice_for_rank``; its attention and MoE
then give that rank's partial outputs, and the partials of all ranks must sum to the
unsharded layer's output (what ``all_sum`` does between real ranks).
"""

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.nn.layers.quantized import quantize
from mlx_lm.models.switch_layers import SwitchLinear

from mlxserve.models.deepseek_v4 import Model
from mlxserve.models.deepseek_v4.memory import weight_bytes
from mlxserve.models.deepseek_v4.sharding import (
    check_shardable,
    shard_model,
    share,
    slice_for_rank,
)
from mlxserve.models.safetensors_header import TensorInfo
from tests.engine.v4_models import tiny_v4
from tests.models.tp_worker import TP_SIZES


def _model(quantized: bool = False, **overrides: Any) -> Model:
    model = tiny_v4(seed=0, **{**TP_SIZES, **overrides})
    if quantized:
        quantize(model, 32, 4, class_predicate=lambda p, m: isinstance(m, SwitchLinear))
    mx.eval(model.parameters())  # type: ignore[no-untyped-call]
    return model


def _layer_outputs(model: Model, x: mx.array, tokens: mx.array) -> list[np.ndarray]:
    """Every layer's attention (with a fresh cache) and MoE output for ``x``."""
    outs = []
    for layer in model.layers:
        outs.append(layer.attn(x, layer.attn.make_cache()))
        outs.append(layer.ffn(x, tokens))
    mx.eval(outs)
    return [np.asarray(o.astype(mx.float32)) for o in outs]


@pytest.mark.parametrize(
    ("split", "quantized"),
    [([3, 1], False), ([1, 3], True), ([2, 1, 1], False), ([1, 1], True)],
    ids=["3+1", "1+3-quantized", "2+1+1", "even-quantized"],
)
def test_rank_partials_sum_to_the_whole_layer(split: list[int], quantized: bool) -> None:
    hidden = TP_SIZES["hidden_size"]
    x = mx.random.normal((1, 12, hidden), key=mx.random.key(1))
    tokens = mx.array([[(5 * i + 2) % TP_SIZES["vocab_size"] for i in range(12)]])
    whole = _layer_outputs(_model(quantized), x, tokens)
    check_shardable(_model(quantized), len(split), split)
    totals = [np.zeros_like(w) for w in whole]
    for rank in range(len(split)):
        part = _model(quantized)
        slice_for_rank(part, split, rank)
        attn = part.layers[0].attn
        first, end, parts = share(split, rank)
        assert attn.num_heads == TP_SIZES["num_attention_heads"] * (end - first) // parts
        assert attn.attn_sink.shape == (attn.num_heads,)
        for total, partial in zip(totals, _layer_outputs(part, x, tokens), strict=True):
            total += partial
    for got, want in zip(totals, whole, strict=True):
        assert np.abs(got - want).max() <= 1e-4 * max(np.abs(want).max(), 1.0)


def test_the_shares_hold_whole_groups_in_proportion() -> None:
    model = _model(quantized=True)
    slice_for_rank(model, [3, 1], 0)
    attn, experts = model.layers[1].attn, model.layers[1].ffn.switch_mlp
    assert attn.o_groups == 3 and attn.wo_a.weight.shape[0] == 3
    assert attn.wq_b.weight.shape[0] == 6 * attn.head_dim
    assert attn.wo_b.weight.shape[1] == 3 * TP_SIZES["o_lora_rank"]
    # 128 intermediate columns in 4 parts: 96 of them, i.e. 3 whole groups of 32.
    assert experts.gate_proj.weight.shape[1] == 96
    assert experts.down_proj.scales.shape[-1] == 3


class _Group:
    """Stands in for a group of ``size`` ranks: ``shard_model`` validates before any
    collective is needed."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


@pytest.mark.parametrize(
    ("split", "quantized", "overrides", "named"),
    [
        ([2, 1], False, {}, r"as 2\+1 \(3 parts\): 3 must divide the .*o_groups\) = 4"),
        ([1, 1, 1], False, {}, r"over 3 ranks: 3 must divide"),
        (
            [3, 1],
            True,
            {"moe_intermediate_size": 160},
            r"expert quantisation groups \(moe_intermediate_size / group_size 32\) = 5",
        ),
        ([4, 0], False, {}, r"shares are whole numbers >= 1, not 0"),
        ([3, 1, 1], False, {}, r"one share per rank: 2 ranks, 3 shares"),
    ],
    ids=["parts-vs-groups", "even-3", "quant-groups", "zero", "length"],
)
def test_a_split_that_cannot_be_honoured_is_refused_by_name(
    split: list[int], quantized: bool, overrides: dict[str, int], named: str
) -> None:
    model = _model(quantized, **overrides)
    size = 3 if split == [1, 1, 1] else 2
    with pytest.raises(ValueError, match=named):
        shard_model(model, _Group(size), split)  # type: ignore[arg-type]


def test_the_memory_count_follows_the_split() -> None:
    names = {"layers.0.ffn.experts.0.w1.weight": (128, 64), "layers.0.attn.wkv.weight": (16, 64)}
    tensors = {name: TensorInfo(name, "BF16", shape, Path("x")) for name, shape in names.items()}
    sharded, whole = 128 * 64 * 2, 16 * 64 * 2
    assert weight_bytes(tensors, 2) == sharded // 2 + whole
    assert weight_bytes(tensors, 2, split=[3, 1], rank=0) == sharded * 3 // 4 + whole
    assert weight_bytes(tensors, 2, split=[3, 1], rank=1) == sharded // 4 + whole


def test_the_plan_reads_the_split_granularity_and_bytes_from_the_headers(
    tmp_path: Path,
) -> None:
    """``model_shape``: 4 output groups and 4 quantisation groups per expert column range
    (``wo_b`` not quantised) give 4 parts; the bytes add up to what the loader counts."""
    from mlxserve.models.loader import model_shape
    from mlxserve.models.safetensors_header import read_checkpoint
    from tests.models.tp_worker import save_checkpoint

    path = save_checkpoint(_model(True), tmp_path / "m", {"group_size": 32, "bits": 4})
    shape = model_shape(path)
    assert shape is not None and shape["granularity"] == 4
    check_shardable(_model(True), 2, [3, 1])  # what 4 parts allow, the model takes
    tensors = read_checkpoint(path)
    assert shape["replicated_bytes"] + shape["sharded_bytes"] == weight_bytes(tensors)
    assert shape["replicated_bytes"] + shape["sharded_bytes"] // 2 == weight_bytes(tensors, 2)
    assert 0 < shape["sharded_read"] < shape["sharded_bytes"]
    assert model_shape("demo") is None
