"""The hyper-connection kernel (``mlxserve.kernels.hyper_connection``) and the model
paths around it.

The kernel is CUDA's alone and CI has no GPU: here it is shown not to be chosen, its
self-check to refuse a kernel that cannot run (with a warning, the ops then in use),
and the paths it replaces to be the ops exactly: ``enter`` with a norm is the norm of
``enter``, ``leave_enter`` is ``leave`` then ``enter``. On a CUDA machine the model
checks the kernel against the ops itself (``hyper_connections.cuda_agrees``); the
GPU run of docs/engine.md ("Ops per decode step") shows its differences.
"""

import logging

import mlx.core as mx
import pytest
from mlx.nn.layers.normalization import RMSNorm

from mlxserve.hardware.tuning import default_tuning
from mlxserve.kernels import hyper_connection
from mlxserve.models.deepseek_v4 import ModelArgs
from mlxserve.models.deepseek_v4 import hyper_connections as hc
from tests.engine.v4_models import tiny_v4


def _block(rows: int) -> tuple[hc.HyperConnection, RMSNorm, mx.array]:
    args = ModelArgs.from_dict(
        {"hidden_size": 32, "hc_mult": 4, "vocab_size": 8, "num_hidden_layers": 1}
    )
    block = hc.HyperConnection(args)  # type: ignore[arg-type]
    keys = iter(mx.random.split(mx.random.key(7), 5))
    block.fn = mx.random.normal(block.fn.shape, key=next(keys)) * 0.1
    block.base = mx.random.normal(block.base.shape, key=next(keys)) * 0.1
    block.scale = mx.array([0.5, 1.0, 2.0])
    norm = RMSNorm(32)
    norm.weight = 1 + 0.1 * mx.random.normal((32,), key=next(keys))
    streams = mx.random.normal((1, rows, 4, 32), key=next(keys))
    return block, norm, streams


def test_the_kernel_is_not_chosen_without_cuda() -> None:
    assert not hyper_connection.available()  # this machine: MLX's CPU back-end
    block, norm, streams = _block(1)
    assert not block._kernel_fuses(streams, norm)


def test_a_kernel_that_cannot_run_is_refused_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hc.cuda_agrees.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert not hc.cuda_agrees(
                hc.MixConstants(4, 1e-6, 1e-6), 20, 32, mx.float32, mx.float32
            )
        assert "hyper-connection kernel failed" in caplog.text
    finally:
        hc.cuda_agrees.cache_clear()


@pytest.mark.parametrize("compiled", [True, False])
def test_entering_with_a_norm_is_the_norm_of_entering(compiled: bool) -> None:
    block, norm, streams = _block(3)
    block.compiled_max_rows = 64 if compiled else 0
    x, post, comb = block.enter(streams)
    normed, post2, comb2 = block.enter(streams, norm)
    assert mx.array_equal(normed, norm(x))
    assert mx.array_equal(post, post2) and mx.array_equal(comb, comb2)


@pytest.mark.parametrize("compiled", [True, False])
def test_leave_enter_is_leave_then_enter(compiled: bool) -> None:
    block, norm, streams = _block(2)
    after, _, _ = _block(2)
    after.fn = after.fn * 0.5
    for module in (block, after):
        module.compiled_max_rows = 64 if compiled else 0
    out = mx.random.normal((1, 2, 32), key=mx.random.key(11))
    _, post, comb = block.enter(streams, norm)
    ours = block.leave_enter(out, streams, post, comb, after, norm)
    new = block.leave(out, streams, post, comb)
    theirs = (new, *after.enter(new, norm))
    for a, b in zip(ours, theirs, strict=True):
        assert mx.array_equal(a, b)


def test_a_decoder_layer_is_unchanged_by_the_norms_moving_into_enter() -> None:
    """The layer's forward (norms applied by `enter`, the attention's exit joined to
    the FFN's entry) against the same blocks called one by one, as before."""
    model = tiny_v4(seed=2, hc_mult=4)
    model.tune(default_tuning())
    layer = model.layers[1]
    cache_a, cache_b = layer.attn.make_cache(), layer.attn.make_cache()
    tokens = mx.array([[3, 5, 7, 9, 11]])
    h = model.model.embed_tokens(tokens)
    streams = mx.broadcast_to(h[:, :, None, :], (1, 5, 4, h.shape[-1]))
    ours = layer(streams, tokens, cache_a)
    x, post, comb = layer.hc_attn.enter(streams)
    out = layer.attn(layer.attn_norm(x), cache_b)
    mid = layer.hc_attn.leave(out, streams, post, comb)
    x, post, comb = layer.hc_ffn.enter(mid)
    out = layer.ffn(layer.ffn_norm(x), tokens)
    theirs = layer.hc_ffn.leave(out, mid, post, comb)
    assert mx.array_equal(ours, theirs)


def test_wide_rows_are_split_one_channel_per_thread_between_bounded_blocks() -> None:
    blocks = hyper_connection.blocks_per_row
    assert hyper_connection.THREADS == 128 and hyper_connection.MAX_BLOCKS_PER_ROW == 64
    assert blocks(32) == blocks(512) == blocks(hyper_connection.SPLIT_FROM_DIM - 1) == 1
    assert blocks(4096) == 32  # V4-Flash's hidden size
    assert blocks(7168) == 56
    assert blocks(128 * 64 * 4) == 64
