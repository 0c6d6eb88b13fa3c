"""The hyper-connections' Sinkhorn: mlxserve's module is v41's maths on every device.

The one-launch CUDA kernel cannot run here (CI has no GPU); `benchmarks/sinkhorn.py`
checks it against the op loop on a CUDA machine. What is checked here is what every
device shares: the dispatch, and that the model's `HyperConnection` equals mlx-lm's.
"""

import logging

import mlx.core as mx
import pytest
from mlx_lm.models.deepseek_v41 import HyperConnection as V41HyperConnection
from mlx_lm.models.deepseek_v41 import _sinkhorn

from mlxserve.kernels.sinkhorn import cuda_kernel_agrees, on_cuda, sinkhorn
from mlxserve.models.deepseek_v4 import ModelArgs
from mlxserve.models.deepseek_v4.hyper_connections import HyperConnection


def random_comb(shape: tuple[int, ...], seed: int = 0) -> mx.array:
    return mx.softmax(mx.random.normal(shape, key=mx.random.key(seed)), axis=-1) + 1e-6


def test_off_cuda_it_is_mlx_lms_loop_and_doubly_stochastic() -> None:
    assert not on_cuda()  # this machine: the CUDA kernel is not chosen
    comb = random_comb((2, 3, 4, 4))
    eps = mx.array([1e-6], dtype=mx.float32)
    out = sinkhorn(comb, iters=20, eps=eps)
    assert mx.array_equal(out, _sinkhorn(comb, iters=20, eps=eps))
    assert mx.allclose(out.sum(axis=-2), mx.ones((2, 3, 4)), atol=1e-5)
    assert mx.allclose(out.sum(axis=-1), mx.ones((2, 3, 4)), atol=1e-3)


def test_the_models_hyper_connection_equals_v41s() -> None:
    args = ModelArgs.from_dict(
        {"hidden_size": 32, "hc_mult": 4, "vocab_size": 64, "num_hidden_layers": 1}
    )
    ours, theirs = HyperConnection(args), V41HyperConnection(args)  # type: ignore[arg-type]
    key = mx.random.key(1)
    params = {
        "fn": mx.random.normal(ours.fn.shape, key=key) * 0.1,
        "base": mx.random.normal(ours.base.shape, key=mx.random.key(2)) * 0.1,
        "scale": mx.array([0.5, 1.0, 2.0]),
    }
    ours.update(params)
    theirs.update(params)
    streams = mx.random.normal((2, 5, 4, 32), key=mx.random.key(3))
    for mine, reference in zip(ours(streams), theirs(streams), strict=True):
        assert mx.array_equal(mine, reference)


def test_a_kernel_that_cannot_run_is_not_used(caplog: pytest.LogCaptureFixture) -> None:
    """The self-check behind the CUDA dispatch: here the kernel cannot even be
    built (no CUDA back-end), so it reports False, with a warning, and is not used."""
    cuda_kernel_agrees.cache_clear()
    with caplog.at_level(logging.WARNING, logger="mlxserve.kernels.sinkhorn"):
        assert not cuda_kernel_agrees(4, 20)
    assert "using the op loop" in caplog.text
