"""The Sinkhorn normalisation of DeepSeek's hyper-connections, in one launch per call.

Every hyper-connection (two per layer, and two per MTP block) makes its 4 x 4
stream-mixing matrix doubly stochastic with 20 Sinkhorn iterations. Written as MLX
ops that is about 80 tiny kernels (a sum, an add and a divide per half-iteration),
which on a GPU is mostly launch overhead: on an H200 a 43-layer DeepSeek-V4-Flash
shaped decode step spent ~40 % of its ~13,000 launches there. mlx-lm runs the loop
as one Metal kernel on a Mac; this module gives CUDA the same: one thread per
matrix, the loop's operations in the loop's order, so the result is the loop's up
to the order of a 4-term float32 sum. Other devices (CPU, Metal) keep mlx-lm's
path.

CI has no GPU, so the kernel checks itself where it runs: on its first use in a
process it is compared with the loop on random matrices, and if it fails to build
or disagrees the loop is used from then on, with a warning (a slower step, never a
wrong one).
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import mlx.core as mx
from mlx_lm.models.deepseek_v41 import _sinkhorn as mlx_lm_sinkhorn

log = logging.getLogger(__name__)

THREADS_PER_BLOCK = 128
SELF_CHECK_MATRICES = 37  # not a multiple of the block: the bound check is exercised
SELF_CHECK_ATOL = 1e-5

# One thread per matrix: columns first, then rows and columns ITERS - 1 more times,
# each a division by (sum + eps), as the reference loop does.
_SOURCE = """
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= comb_shape[0]) {
        return;
    }
    const float* src = comb + (size_t)n * HC * HC;
    float m[HC][HC];
    for (int i = 0; i < HC; ++i) {
        for (int j = 0; j < HC; ++j) {
            m[i][j] = src[i * HC + j];
        }
    }
    const float e = eps[0];
    for (int it = 0; it < ITERS; ++it) {
        if (it > 0) {
            for (int i = 0; i < HC; ++i) {
                float s = 0.0f;
                for (int j = 0; j < HC; ++j) {
                    s += m[i][j];
                }
                const float d = s + e;
                for (int j = 0; j < HC; ++j) {
                    m[i][j] = m[i][j] / d;
                }
            }
        }
        for (int j = 0; j < HC; ++j) {
            float s = 0.0f;
            for (int i = 0; i < HC; ++i) {
                s += m[i][j];
            }
            const float d = s + e;
            for (int i = 0; i < HC; ++i) {
                m[i][j] = m[i][j] / d;
            }
        }
    }
    float* dst = out + (size_t)n * HC * HC;
    for (int i = 0; i < HC; ++i) {
        for (int j = 0; j < HC; ++j) {
            dst[i * HC + j] = m[i][j];
        }
    }
"""


@cache
def _cuda_kernel() -> Any:
    """Built on first use: nothing is compiled at import, nor on a machine without CUDA."""
    return mx.fast.cuda_kernel(
        name="mlxserve_sinkhorn",
        input_names=["comb", "eps"],
        output_names=["out"],
        source=_SOURCE,
    )


def on_cuda() -> bool:
    """Whether the default device is a CUDA GPU (where the one-launch kernel runs)."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def sinkhorn_cuda(comb: mx.array, *, iters: int, eps: mx.array) -> mx.array:
    """The loop of `sinkhorn` as one CUDA kernel over the matrices of `comb` [..., hc, hc]."""
    hc = comb.shape[-1]
    flat = comb.astype(mx.float32).reshape(-1, hc, hc)
    count = flat.shape[0]
    outputs: list[mx.array] = _cuda_kernel()(
        inputs=[flat, eps.astype(mx.float32)],
        template=[("HC", hc), ("ITERS", iters)],
        grid=(count, 1, 1),
        threadgroup=(min(count, THREADS_PER_BLOCK), 1, 1),
        output_shapes=[flat.shape],
        output_dtypes=[mx.float32],
    )
    return outputs[0].reshape(comb.shape)


@cache
def cuda_kernel_agrees(hc: int, iters: int) -> bool:
    """Whether the kernel builds and matches the loop here (checked once per shape)."""
    comb = mx.random.uniform(shape=(SELF_CHECK_MATRICES, hc, hc), key=mx.random.key(0)) + 0.05
    eps = mx.array([1e-6], dtype=mx.float32)
    try:
        ours = sinkhorn_cuda(comb, iters=iters, eps=eps)
        loop = mlx_lm_sinkhorn(comb, iters=iters, eps=eps)
        worst = float(mx.abs(ours - loop).max())
    except (RuntimeError, ValueError) as exc:  # NVRTC or launch failure
        log.warning("the CUDA Sinkhorn kernel failed (%s): using the op loop", exc)
        return False
    if not worst <= SELF_CHECK_ATOL:
        log.warning("the CUDA Sinkhorn kernel differs from the loop by %g: using the loop", worst)
        return False
    return True


def sinkhorn(comb: mx.array, *, iters: int, eps: mx.array) -> mx.array:
    """Normalise the columns of each [hc, hc] matrix, then its rows and columns
    `iters - 1` more times (dividing by sum + eps): one launch on CUDA (once it has
    checked itself), mlx-lm's path elsewhere (its Metal kernel on a Mac, the op loop
    on a CPU)."""
    if iters >= 1 and comb.size and on_cuda() and cuda_kernel_agrees(comb.shape[-1], iters):
        return sinkhorn_cuda(comb, iters=iters, eps=eps)
    out: mx.array = mlx_lm_sinkhorn(comb, iters=iters, eps=eps)
    return out
