"""The hyper-connections' Sinkhorn: mlxserve's module is v41's maths on every device.

The CPU's compiled loop is checked here bit for bit. The one-launch CUDA kernel
cannot run here (CI has no GPU): `benchmarks/sinkhorn.py` checks it against the op
loop on a CUDA machine, and here its self-check is shown to refuse a kernel that
cannot build. And the model's `HyperConnection` equals mlx-lm's.
"""

import logging

import mlx.core as mx
import pytest
from mlx_lm.models.deepseek_v41 import HyperConnection as V41HyperConnection
from mlx_lm.models.deepseek_v41 import _sinkhorn

from mlxserve.hardware.device import on_cuda
from mlxserve.kernels.sinkhorn import fast_path_agrees, sinkhorn
from mlxserve.models.deepseek_v4 import ModelArgs
from mlxserve.models.deepseek_v4.hyper_connections import HyperConnection


def random_comb(shape: tuple[int, ...], seed: int = 0) -> mx.array:
    return mx.softmax(mx.random.normal(shape, key=mx.random.key(seed)), axis=-1) + 1e-6


def test_on_the_cpu_it_is_the_compiled_loop_bit_for_bit() -> None:
    assert not on_cuda()  # this machine: the CUDA kernel is not chosen
    assert fast_path_agrees("compiled", 4, 20)  # MLX's CPU JIT builds it here
    eps = mx.array([1e-6], dtype=mx.float32)
    # One compilation per matrix size, any batch; 1 x 1 matrices take the plain loop.
    for shape in ((2, 3, 4, 4), (1, 1, 4, 4), (1, 17, 4, 4), (2, 5, 1, 1), (3, 2, 2)):
        comb = random_comb(shape)
        out = sinkhorn(comb, iters=20, eps=eps)
        assert mx.array_equal(out, _sinkhorn(comb, iters=20, eps=eps))
    comb = random_comb((2, 3, 4, 4))
    out = sinkhorn(comb, iters=20, eps=eps)
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
    fast_path_agrees.cache_clear()
    with caplog.at_level(logging.WARNING, logger="mlxserve.kernels.sinkhorn"):
        assert not fast_path_agrees("cuda", 4, 20)
    assert "the cuda Sinkhorn failed" in caplog.text and "using the op loop" in caplog.text
