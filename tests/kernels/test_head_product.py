"""The head-product kernel (``mlxserve.kernels.head_product``) and the head around it.

The kernel is CUDA's alone and CI has no GPU: here it is shown not to be chosen,
which products it would take, its self-check to refuse a kernel that cannot run
(with a warning, the ops then in use), and the head to give the ops' float32 product
without it. On a CUDA machine the model checks the kernel against the ops itself
(``head_product.agrees``); ``benchmarks/head_product.py`` shows its differences.
"""

import logging

import mlx.core as mx
import pytest
from mlx.nn.layers.linear import Linear

from mlxserve.kernels import head_product
from mlxserve.models.deepseek_v4.head import head_logits


def test_the_kernel_is_not_chosen_without_cuda() -> None:
    assert not head_product.available()  # this machine: MLX's CPU back-end
    layer = Linear(64, 100, bias=False)
    layer.weight = (mx.random.normal((100, 64), key=mx.random.key(1)) * 0.125).astype(mx.bfloat16)
    h = mx.random.normal((2, 3, 64), key=mx.random.key(2))
    logits = head_logits(layer, h)
    reference = h @ layer.weight.astype(mx.float32).T
    assert logits.dtype == mx.float32
    assert float(mx.abs(logits - reference).max()) <= 1e-6 * float(mx.abs(reference).max())


def test_what_the_kernel_takes() -> None:
    h = mx.zeros((1, 2, 64))
    head = mx.zeros((100, 64), dtype=mx.bfloat16)
    assert head_product.fits(h, head)
    assert head_product.fits(h, head.astype(mx.float16))
    assert not head_product.fits(h.astype(mx.bfloat16), head)  # bfloat16 activations
    assert not head_product.fits(h, head.astype(mx.float32))  # nothing to cast
    assert not head_product.fits(mx.zeros((1, 2, 60)), mx.zeros((100, 60), dtype=mx.bfloat16))
    rows = head_product.MAX_ROWS
    assert head_product.fits(mx.zeros((2, rows // 2, 64)), head)
    assert not head_product.fits(mx.zeros((2, rows // 2 + 1, 64)), head)  # the ops are faster


def test_a_kernel_that_cannot_run_is_refused_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    head_product.agrees.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert not head_product.agrees(mx.bfloat16, 64)
        assert "head-product kernel failed" in caplog.text
    finally:
        head_product.agrees.cache_clear()
