"""What one DeepSeek-V4 sequence is predicted to hold (``deepseek_v4/memory.py``).

The docs predict a long sequence's peak as the weights, its cache and one prefill
chunk's bounded working set. The cache part must be the bytes a real prefill leaves,
in one piece or in chunks, with float32 or bfloat16 activations; the working set
must be bounded by the grouped stages' budgets (a smaller budget holds less), and
the peak is the sum of the three.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlxserve.models.deepseek_v4.memory import (
    cache_bytes,
    prefill_working_bytes,
    sequence_peak_bytes,
)
from tests.engine.v4_models import tiny_v4

#: One CSA layer wide enough that its query groups and index scores are the working set.
WIDE = {
    "hidden_size": 128,
    "num_attention_heads": 8,
    "head_dim": 64,
    "q_lora_rank": 64,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 8,
    "sliding_window": 16,
    "vocab_size": 128,
    "layer_types": ["compressed_sparse_attention"],
    "mlp_layer_types": ["moe"],
    "num_hidden_layers": 1,
}


def _tokens(length: int) -> mx.array:
    return mx.array([[(5 * i) % 61 for i in range(length)]])


@pytest.mark.parametrize("context", [3, 8, 19, 40, 75, 130])
def test_the_cache_is_the_bytes_a_prefill_leaves(context: int) -> None:
    model = tiny_v4(seed=2)
    whole = model.make_cache()
    mx.eval(model(_tokens(context), whole))
    chunked = model.make_cache()
    for lo in range(0, context, 16):
        mx.eval(model(_tokens(context)[:, lo : lo + 16], chunked))
    predicted = cache_bytes(model.args, context, itemsize=4)  # float32 norms: float32 rows
    assert sum(c.nbytes for c in whole) == predicted
    assert sum(c.nbytes for c in chunked) == predicted


def test_bfloat16_activations_halve_the_rows_not_the_entries() -> None:
    model = tiny_v4(seed=3)
    # Cast as a bfloat16 load does (``cast_predicate``), norms included; MLX's CPU
    # gathers float32 experts only, so those stay.
    keep = model.cast_predicate
    cast = [
        (name, value.astype(mx.bfloat16) if keep(name) and "switch_mlp" not in name else value)
        for name, value in tree_flatten(model.parameters())
    ]
    model.update(tree_unflatten(cast))
    cache = model.make_cache()
    mx.eval(model(_tokens(75), cache))
    assert cache[0].window is not None and cache[0].window.dtype == mx.bfloat16
    assert sum(c.nbytes for c in cache) == cache_bytes(model.args, 75, itemsize=2)


def _working_set(model: object, context: int, chunk: int, budget: int) -> int:
    """Peak bytes above the weights and a cache of ``context - chunk`` tokens while one
    chunk of ``chunk`` tokens runs with both grouped stages' budgets at ``budget``."""
    attn = model.layers[0].attn  # type: ignore[attr-defined]
    attn.prefill_working_bytes = budget
    attn.indexer.score_bytes = budget
    cache = model.make_cache()  # type: ignore[attr-defined]
    mx.eval(model.forward_hidden(_tokens(context - chunk), cache), [c.state for c in cache])  # type: ignore[attr-defined]
    tokens = _tokens(context)[:, context - chunk :]
    mx.eval(tokens)
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(model.forward_hidden(tokens, cache), [c.state for c in cache])  # type: ignore[attr-defined]
    return int(mx.get_peak_memory() - before)


def test_a_smaller_budget_holds_a_smaller_working_set() -> None:
    model = tiny_v4(seed=4, **WIDE)
    whole = _working_set(model, 1024, 256, 1 << 30)  # every group at once
    grouped = _working_set(model, 1024, 256, 1 << 16)
    # The chunk's scores and gathered entries at once, against a 64 KiB group of them
    # (the chunk's activations, the rest of both, are the same).
    assert grouped < 0.75 * whole


def test_the_peak_is_weights_cache_and_working_set() -> None:
    args = tiny_v4(seed=5, **WIDE).args
    weights, context, chunk = 10**9, 4096, 512
    peak = sequence_peak_bytes(weights, args, context, chunk, itemsize=4)
    work = prefill_working_bytes(args, chunk, itemsize=4)
    assert peak == weights + cache_bytes(args, context, 4) + work
    # Linear in the chunk (the activations), the larger budget on top.
    per_token = prefill_working_bytes(args, chunk + 1, 4) - work
    assert per_token == 3 * args.num_attention_heads * args.head_dim * 4
    small = prefill_working_bytes(args, chunk, 4, attention_budget=1 << 20, score_budget=1 << 22)
    assert small == work - prefill_working_bytes(args, 0, 4) + (1 << 22)
