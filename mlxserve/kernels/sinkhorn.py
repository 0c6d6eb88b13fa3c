"""The Sinkhorn normalisation of DeepSeek's hyper-connections, without ~80 ops per call.

Every hyper-connection (two per layer, and two per MTP block) makes its 4 x 4
stream-mixing matrix doubly stochastic with 20 Sinkhorn iterations. Written as MLX
ops that is about 80 tiny kernels (a sum, an add and a divide per half-iteration):
in the lazy graph of a 43-layer DeepSeek-V4-Flash shaped decode step, more than
half of the nodes that are not views. A GPU step is bound by those launches, and a
CPU step pays each op's dispatch. Per device:

- Metal: mlx-lm's own one-launch kernel (its ``_sinkhorn``).
- CUDA: the same as one CUDA kernel here: one thread per matrix, the loop's
  operations in the loop's order, so the result is the loop's up to the order of
  a 4-term float32 sum.
- CPU: the loop under ``mx.compile`` (shapeless, for matrices of 2 x 2 and up, up
  to a prefill chunk's worth), which fuses each half-iteration's add and divide:
  the demo's decode step took 15-30 % less CPU time.

Both fast paths check themselves where they run, once per process and shape: on
random matrices against the plain loop. One that fails to build (no CUDA back-end,
no C++ compiler for MLX's CPU JIT) or disagrees is not used again, with a warning:
a slower step, never a wrong one. CI has no GPU, so this is also what stands
between an untested CUDA build and a user's answers.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import mlx.core as mx
from mlx_lm.models.deepseek_v41 import _sinkhorn as mlx_lm_sinkhorn

from mlxserve.hardware.device import on_cpu, on_cuda

log = logging.getLogger(__name__)

THREADS_PER_BLOCK = 128
SELF_CHECK_MATRICES = 37  # not a multiple of the block: the bound check is exercised
SELF_CHECK_ATOL = 1e-5
#: Above this many matrices (a long prefill chunk) the CPU's compiled loop lost to the
#: op loop (docs/engine.md#tuning); decode steps and verify forwards have a few dozen.
COMPILED_MAX_MATRICES = 512

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
def _compiled_loop(iters: int, hc: int) -> Any:
    """The loop compiled for [N, hc, hc] inputs, any N. Shapeless compilation keeps
    the traced broadcasts, so the rank and hc are fixed per compilation; and hc >= 2:
    MLX 0.32's shapeless CPU compilation of the 1 x 1 case crashes the process."""

    def loop(comb: mx.array, eps: mx.array) -> mx.array:
        out: mx.array = mlx_lm_sinkhorn(comb, iters=iters, eps=eps)
        return out

    return mx.compile(loop, shapeless=True)


def sinkhorn_compiled(comb: mx.array, *, iters: int, eps: mx.array) -> mx.array:
    """The loop of `sinkhorn` under ``mx.compile`` (one compilation per iteration
    count and matrix size)."""
    hc = comb.shape[-1]
    flat = comb.reshape(-1, hc, hc)
    out: mx.array = _compiled_loop(iters, hc)(flat, eps)
    return out.reshape(comb.shape)


FAST_PATHS = {"cuda": sinkhorn_cuda, "compiled": sinkhorn_compiled}


@cache
def fast_path_agrees(path: str, hc: int, iters: int) -> bool:
    """Whether fast path `path` builds and matches the loop here (checked once per
    process and shape)."""
    comb = mx.random.uniform(shape=(SELF_CHECK_MATRICES, hc, hc), key=mx.random.key(0)) + 0.05
    eps = mx.array([1e-6], dtype=mx.float32)
    try:
        ours = FAST_PATHS[path](comb, iters=iters, eps=eps)
        loop = mlx_lm_sinkhorn(comb, iters=iters, eps=eps)
        worst = float(mx.abs(ours - loop).max())
    except (RuntimeError, ValueError) as exc:  # NVRTC, the CPU JIT's compiler, a launch
        log.warning("the %s Sinkhorn failed (%s): using the op loop", path, exc)
        return False
    if not worst <= SELF_CHECK_ATOL:
        log.warning("the %s Sinkhorn differs from the loop by %g: using the loop", path, worst)
        return False
    return True


def sinkhorn(comb: mx.array, *, iters: int, eps: mx.array) -> mx.array:
    """Normalise the columns of each [hc, hc] matrix, then its rows and columns
    `iters - 1` more times (dividing by sum + eps): one launch on CUDA, the compiled
    loop on a CPU (each once it has checked itself), mlx-lm's path otherwise (its
    Metal kernel on a Mac)."""
    if iters >= 1 and comb.size:
        hc = comb.shape[-1]
        if on_cuda() and fast_path_agrees("cuda", hc, iters):
            return sinkhorn_cuda(comb, iters=iters, eps=eps)
        small = comb.size // (hc * hc) <= COMPILED_MAX_MATRICES
        if on_cpu() and hc >= 2 and small and fast_path_agrees("compiled", hc, iters):
            return sinkhorn_compiled(comb, iters=iters, eps=eps)
    out: mx.array = mlx_lm_sinkhorn(comb, iters=iters, eps=eps)
    return out
