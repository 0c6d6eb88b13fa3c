"""The vocabulary head's float32 product over a bfloat16 head (``deepseek_v4/head.py``).

The final norm's float32 weights make the head's input float32; MLX's mixed matmul
would cast the whole bfloat16 head to float32 each call. The sliced product must give
the float32 product's logits (the same dot products) and greedy tokens, hold far less
than a float32 copy of the head at once, and leave quantised heads to their own call;
V4 (and its MTP head, which shares ``output_head``) and V4.1 both take it.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.nn.layers.quantized import QuantizedLinear

from mlxserve.models.deepseek_v4.head import head_logits, sliced_product
from tests.engine.v4_models import tiny_v4
from tests.models.v41_fixtures import random_v41


def _head(vocab: int, dim: int, seed: int) -> tuple[mx.array, mx.array]:
    """A bfloat16 head [vocab, dim] and float32 activations like a final norm's."""
    key_w, key_h = mx.random.split(mx.random.key(seed))
    weight = (mx.random.normal((vocab, dim), key=key_w) * dim**-0.5).astype(mx.bfloat16)
    h = mx.random.normal((1, 3, dim), key=key_h) * 4.0
    mx.eval(weight, h)
    return weight, h


@pytest.mark.parametrize("slice_bytes", [4 * 256 * 7, 4 * 256 * 64, 1 << 30])
def test_the_sliced_product_is_the_float32_product(slice_bytes: int) -> None:
    weight, h = _head(1000, 256, seed=1)  # 1000 rows: the last slice is a short one
    reference = h @ weight.astype(mx.float32).T
    sliced = sliced_product(h, weight, slice_bytes)
    assert sliced.dtype == mx.float32 and sliced.shape == reference.shape
    # The same float32 dot products; only the order of a sum may differ.
    scale = float(mx.abs(reference).max())
    assert float(mx.abs(sliced - reference).max()) <= 1e-6 * scale
    assert mx.array_equal(mx.argmax(sliced, axis=-1), mx.argmax(reference, axis=-1))


def _extra_peak(run: object) -> int:
    """Bytes MLX held at its peak while evaluating ``run()``, above what it held before."""
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(run())  # type: ignore[operator]
    return int(mx.get_peak_memory() - before)


def test_no_float32_copy_of_the_whole_head_exists() -> None:
    weight, h = _head(16384, 256, seed=2)
    copy = 4 * weight.size  # what MLX's mixed matmul casts the head to
    # The mixed matmul's peak holds the copy (so this measure sees one).
    assert _extra_peak(lambda: h @ weight.T) >= copy
    # 64 rows a slice: the backend runs a few slices ahead, far from the whole head.
    assert _extra_peak(lambda: sliced_product(h, weight, 4 * 256 * 64)) < copy // 4


def _bf16_head(model: object) -> mx.array:
    """Cast the model's ``lm_head`` to bfloat16 (its norms stay float32); return it."""
    head = model.lm_head  # type: ignore[attr-defined]
    head.weight = head.weight.astype(mx.bfloat16)
    mx.eval(head.weight)
    weight: mx.array = head.weight
    return weight


def test_v4_logits_and_mtp_logits_match_the_float32_head() -> None:
    model = tiny_v4(seed=3)
    weight = _bf16_head(model)
    model.head_slice_bytes = 4 * model.args.hidden_size * 8  # 8 rows a slice
    tokens = mx.array([[3, 14, 15, 9, 26, 5, 35, 8, 9, 7]])
    streams = model.forward_hidden(tokens)
    h = model.model.norm(model.model.hc_head(streams))
    assert h.dtype == mx.float32  # the float32 norm weight: the case the head is for
    logits = model.head_from_streams(streams)
    reference = h @ weight.astype(mx.float32).T
    assert logits.dtype == mx.float32
    assert float(mx.abs(logits - reference).max()) <= 1e-6 * float(mx.abs(reference).max())
    assert mx.array_equal(mx.argmax(logits, axis=-1), mx.argmax(reference, axis=-1))
    # The MTP block's logits go through the same head.
    cache = model.make_mtp_cache()[0]
    drafted, out_streams = model.mtp_forward(streams, tokens, cache)
    mtp = model.mtp[0]
    mtp_h = mtp.norm(mtp.hc_head(out_streams))
    mtp_reference = mtp_h @ weight.astype(mx.float32).T
    assert float(mx.abs(drafted - mtp_reference).max()) <= 1e-6 * float(mx.abs(mtp_reference).max())


def test_a_quantised_head_keeps_its_own_call() -> None:
    model = tiny_v4(seed=4, vocab_size=64)
    model.lm_head = QuantizedLinear.from_linear(model.lm_head, group_size=32, bits=8)
    h = mx.random.normal((1, 2, model.args.hidden_size), key=mx.random.key(5))
    out = model.output_head(h)
    assert mx.array_equal(out, model.lm_head(h))
    assert out.shape == (1, 2, 64)


def test_a_tied_bfloat16_embedding_is_sliced_too() -> None:
    model = tiny_v4(seed=6, tie_word_embeddings=True)
    embed = model.model.embed_tokens
    embed.weight = embed.weight.astype(mx.bfloat16)
    h = mx.random.normal((1, 2, model.args.hidden_size), key=mx.random.key(7))
    reference = h @ embed.weight.astype(mx.float32).T
    out = head_logits(embed, h, 4 * model.args.hidden_size * 5)
    assert float(mx.abs(out - reference).max()) <= 1e-6 * float(mx.abs(reference).max())
    assert mx.allclose(model.output_head(h), reference, rtol=0, atol=1e-5)


def test_v41_logits_match_the_float32_head() -> None:
    model = random_v41(engram=False, seed=8)
    weight = _bf16_head(model)
    model.head_slice_bytes = 4 * model.args.hidden_size * 100  # 100 of 1,024 rows a slice
    tokens = mx.array([[5, 17, 256, 9, 33, 2, 700, 41]])
    hidden = model.forward_hidden(tokens)
    h = model.model.norm(hidden)
    assert h.dtype == mx.float32
    logits = model.head_from_streams(hidden)
    reference = h @ weight.astype(mx.float32).T
    assert float(mx.abs(logits - reference).max()) <= 1e-6 * float(mx.abs(reference).max())
    assert mx.array_equal(mx.argmax(logits, axis=-1), mx.argmax(reference, axis=-1))
