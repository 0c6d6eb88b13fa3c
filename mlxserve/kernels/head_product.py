"""The vocabulary head's float32 product over a bfloat16 head, as one CUDA kernel.

DeepSeek-V4 computes its logits in float32 from a bfloat16 head (``deepseek_v4/
head.py``). MLX has no matmul of a bfloat16 weight with a float32 result, so the ops
cast the head to float32 a slice at a time and multiply: per decode step the head's
bytes are read, written again as float32 (twice as many) and read once more, in two
kernels per slice (128 for V4-Flash's 129,280 x 4,096 head). At V4-Flash's width that
is about 5.3 GB of traffic a step where the head itself is 1.06 GB, the largest
single read of an 8-layer real-width decode step (issue #31).

Here one warp takes one row of the head: it reads the row once, eight bfloat16
values a load, multiplies them in float32 with each of the (at most ``MAX_ROWS``)
activation rows, sums over its lanes and writes the float32 logits. Every logit is
the same float32 dot product as the ops'; only the order of its sum differs. The
model checks the kernel once per process and shape against the CPU's float32 product
(``agrees``) and uses it only where it agrees; nothing here is built on a machine
without CUDA.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import mlx.core as mx

from mlxserve.hardware.device import on_cuda

log = logging.getLogger(__name__)

#: Most activation rows (a decode batch, or a verify's rows) the kernel takes: each
#: row re-reads its activations for every head row, so its time grows with the rows
#: (H100, V4-Flash's head: 0.43 ms at 1 row, 0.65 at 4, 2.2 at 16, 8.8 at 64,
#: against 2.6-3.4 ms for the ops: ``results/head_product_h100_stop30.json``).
MAX_ROWS = 16

#: Warps (head rows) of a thread block.
WARPS = 8

_SOURCE = """
    struct alignas(16) Pack {
        T v[8];
    };
    const int lane = threadIdx.x & 31;
    const long vrow = ((long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (vrow >= V) {
        return;
    }
    const Pack* wr = reinterpret_cast<const Pack*>(weight + vrow * D);
    float acc[R];
    for (int r = 0; r < R; ++r) {
        acc[r] = 0.0f;
    }
    for (int i = lane; i < D / 8; i += 32) {
        const Pack p = wr[i];
        float wv[8];
        for (int j = 0; j < 8; ++j) {
            wv[j] = (float)p.v[j];
        }
        for (int r = 0; r < R; ++r) {
            const float4* hr = reinterpret_cast<const float4*>(h + (long)r * D + 8 * i);
            const float4 a = hr[0];
            const float4 b = hr[1];
            acc[r] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w
                    + wv[4] * b.x + wv[5] * b.y + wv[6] * b.z + wv[7] * b.w;
        }
    }
    for (int r = 0; r < R; ++r) {
        float v = acc[r];
        for (int o = 16; o > 0; o >>= 1) {
            v += __shfl_xor_sync(0xffffffff, v, o);
        }
        if (lane == 0) {
            out[(long)r * V + vrow] = v;
        }
    }
"""


def available() -> bool:
    """Whether the kernel can run here: the default device is a CUDA GPU."""
    return on_cuda()


def fits(h: mx.array, weight: mx.array) -> bool:
    """Whether the kernel takes this product: at most ``MAX_ROWS`` rows of float32
    activations, a 2-byte float head [V, D] with D a multiple of 8 (its rows are read
    16 bytes at a time)."""
    return (
        h.dtype == mx.float32
        and h.size // max(h.shape[-1], 1) <= MAX_ROWS
        and weight.ndim == 2
        and weight.dtype in (mx.bfloat16, mx.float16)
        and weight.shape[-1] % 8 == 0
        and h.shape[-1] == weight.shape[-1]
    )


@cache
def _kernel() -> Any:
    """Built on first use: nothing is compiled at import, nor on a machine without CUDA."""
    return mx.fast.cuda_kernel(
        name="mlxserve_head_product",
        input_names=["h", "weight"],
        output_names=["out"],
        source=_SOURCE,
    )


def _launch(h: mx.array, weight: mx.array) -> mx.array:
    """``h`` [R, D] times ``weight`` [V, D] transposed, float32 [R, V] (one template
    instance per R: the model passes at most ``MAX_ROWS``)."""
    rows, dim = h.shape
    vocab = weight.shape[0]
    threads = 32 * WARPS
    blocks = -(-vocab // WARPS)
    (out,) = _kernel()(
        inputs=[h, weight],
        template=[("T", weight.dtype), ("R", rows), ("D", dim), ("V", vocab)],
        grid=(blocks * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(rows, vocab)],
        output_dtypes=[mx.float32],
    )
    result: mx.array = out
    return result


def product(h: mx.array, weight: mx.array) -> mx.array:
    """``h @ weight.T`` in float32 for ``h`` [..., D] float32 and a 2-byte ``weight``
    [V, D] (`fits`): the logits [..., V], one launch."""
    flat = h.reshape(-1, h.shape[-1])  # the kernel's inputs are made row-contiguous
    return _launch(flat, weight).reshape(*h.shape[:-1], weight.shape[0])


@cache
def agrees(dtype: Any, dim: int) -> bool:
    """Whether the kernel builds and gives the float32 product ``h @
    weight.astype(float32).T`` for a head of ``dtype`` and width ``dim`` (once per
    process and shape): random rows, 1, 3 and ``MAX_ROWS`` activation rows, a
    vocabulary that is not a multiple of the block's warps. The reference is the
    CPU's product: a GPU's float32 matmul of several rows runs as TF32 (2e-4 of the
    largest logit off on an H100), which the kernel is not. Within 1e-5 of the
    largest logit: the same float32 dot products summed in another order. A failure
    or a difference leaves the ops in use, with a warning."""
    keys = iter(mx.random.split(mx.random.key(31), 4))
    weight = (mx.random.normal((1003, dim), key=next(keys)) * dim**-0.5).astype(dtype)
    try:
        worst = 0.0
        for rows in (1, 3, MAX_ROWS):
            h = mx.random.normal((rows, dim), key=next(keys)) * 4.0
            ours = product(h, weight)
            theirs = mx.matmul(h, weight.astype(mx.float32).T, stream=mx.cpu)
            mx.eval(ours, theirs)
            scale = float(mx.abs(theirs).max())
            worst = max(worst, float(mx.abs(ours - theirs).max()) / scale)
    except (RuntimeError, ValueError) as exc:
        log.warning("the head-product kernel failed (%s): using the ops", exc)
        return False
    if not worst <= 1e-5:
        log.warning("the head-product kernel is %g of the top logit off: using the ops", worst)
        return False
    return True


__all__ = ["MAX_ROWS", "agrees", "available", "fits", "product"]
