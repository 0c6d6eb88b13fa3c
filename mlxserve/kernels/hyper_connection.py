"""A DeepSeek hyper-connection's entry as one CUDA kernel, and the exit before it.

Entering a block (``HyperConnection.enter``) and normalising its input is, as MLX
ops, the RMSNorm of the flattened streams, the mix's matmul, the element-wise
strings of ``pre``, ``post`` and the comb, the Sinkhorn and the block's RMSNorm:
six kernels at the least, two of them a matmul and a Sinkhorn of a handful of
values each. On a GPU a small decode step is bound by such launches (issue #31).
Every one of them works on one row of the streams at a time (a row: one token of
one sequence). The dot products read the mix's weights (1.6 MB at hidden 4096), so
a wide row's channels are split between `blocks_per_row` blocks, and the last of them
to finish does the rest of the row (a narrow row has one block):

1. each block's channels of the row: the stream values (with ``leave_enter``: first
   the previous block's exit, ``post_i * out + sum_j comb_ji * stream_j``, written
   out as the new streams);
2. their sum of squares and their dot products with each of the mix's columns,
   reduced over the block and written as the block's partial sums; a counter per
   row (zeroed at launch) tells the last block that the others' sums are written;
3. in the last block, the partial sums added in block order (so the result does not
   depend on which block came last), then on one thread the mix (the RMSNorm's
   scale applied to the dot products), its scale and base, ``pre`` and ``post``
   (sigmoids), the comb's softmax and the Sinkhorn iterations, in the order of the
   ops;
4. the collapse ``sum_i pre_i * stream_i`` in the streams' dtype, its sum of
   squares reduced over the block, and the block's RMSNorm with its weight.

Only the order of float32 sums differs from the ops (the dot products, the sums of
squares), and the RMSNorm's scale applied after the dot products instead of before.
The model checks the kernel once per process and shape against the ops
(``hyper_connections.cuda_agrees``) and uses it only where it agrees; nothing here
is built on a machine without CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import mlx.core as mx

from mlxserve.hardware.device import on_cuda

#: Threads of each block; a row's channels are split between blocks of this many.
THREADS = 128

#: The most blocks one row's dot products are split between.
MAX_BLOCKS_PER_ROW = 64

#: Rows narrower than this keep one block (`blocks_per_row`).
SPLIT_FROM_DIM = 2048

_REDUCE = """
    // Sum ``vals[0 .. COUNT)`` over the block; the totals end up in ``vals`` on
    // thread 0 (``red``: [32][COUNT] floats of shared memory).
    for (int c = 0; c < COUNT; ++c) {
        float v = vals[c];
        for (int o = 16; o > 0; o >>= 1) {
            v += __shfl_down_sync(0xffffffff, v, o);
        }
        vals[c] = v;
    }
    __syncthreads();
    if ((tid & 31) == 0) {
        for (int c = 0; c < COUNT; ++c) {
            red[tid >> 5][c] = vals[c];
        }
    }
    __syncthreads();
    if (tid == 0) {
        for (int c = 0; c < COUNT; ++c) {
            float v = 0.0f;
            for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
                v += red[w][c];
            }
            vals[c] = v;
        }
    }
"""

_HEADER = (
    """
template <int COUNT>
__device__ void block_sum(float* vals, float (*red)[COUNT], int tid) {
"""
    + _REDUCE
    + """
}

__device__ float mlxserve_sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}
"""
)

# The body of both kernels. {streams} loads a row's stream values sv[HC] at channel
# d (and, leaving, first computes them and writes them out as the new streams);
# {streams_again} loads them again in the row's last block without writing.
_BODY = """
    constexpr int M = (2 + HC) * HC;
    constexpr int K = HC * D;
    constexpr int CHUNK = (D + SPLIT - 1) / SPLIT;
    __shared__ float red[32][M + 1];
    __shared__ float total[M + 1];
    __shared__ float pre_s[HC];
    __shared__ float scal[2];
    const int row = blockIdx.x / SPLIT;
    const int part = blockIdx.x % SPLIT;
    const int tid = threadIdx.x;
    const T* s_in = streams + (size_t)row * K;
    const int first = part * CHUNK;
    const int stop = min(D, first + CHUNK);

    // 1-2: this block's channels of the row: the stream values, their sum of
    // squares and dot products with fn, reduced over the block into the row's
    // partial sums.
    float acc[M + 1];
    for (int m = 0; m <= M; ++m) {
        acc[m] = 0.0f;
    }
    for (int d = first + tid; d < stop; d += blockDim.x) {
        float sv[HC];
        {streams}
        for (int i = 0; i < HC; ++i) {
            const int k = i * D + d;
            acc[0] += sv[i] * sv[i];
            for (int m = 0; m < M; ++m) {
                acc[1 + m] += sv[i] * fn[(size_t)m * K + k];
            }
        }
    }
    block_sum<M + 1>(acc, red, tid);
{gather}
    // 3: the mix, pre, post and the comb with its Sinkhorn, on one thread.
    if (tid == 0) {
        const float norm_eps = consts[0];
        const float hc_eps = consts[1];
        const float r = rsqrtf(total[0] / (float)K + norm_eps);
        float mix[M];
        for (int m = 0; m < M; ++m) {
            const float s = scale[m < HC ? 0 : (m < 2 * HC ? 1 : 2)];
            mix[m] = (total[1 + m] * r) * s + base[m];
        }
        for (int i = 0; i < HC; ++i) {
            pre_s[i] = mlxserve_sigmoid(mix[i]) + hc_eps;
            post[(size_t)row * HC + i] = 2.0f * mlxserve_sigmoid(mix[HC + i]);
        }
        float c[HC][HC];
        for (int i = 0; i < HC; ++i) {
            float top = mix[2 * HC + i * HC];
            for (int j = 1; j < HC; ++j) {
                top = fmaxf(top, mix[2 * HC + i * HC + j]);
            }
            float sum = 0.0f;
            for (int j = 0; j < HC; ++j) {
                c[i][j] = expf(mix[2 * HC + i * HC + j] - top);
                sum += c[i][j];
            }
            for (int j = 0; j < HC; ++j) {
                c[i][j] = c[i][j] / sum + hc_eps;
            }
        }
        for (int it = 0; it < ITERS; ++it) {
            if (it > 0) {
                for (int i = 0; i < HC; ++i) {
                    float s = 0.0f;
                    for (int j = 0; j < HC; ++j) {
                        s += c[i][j];
                    }
                    const float den = s + hc_eps;
                    for (int j = 0; j < HC; ++j) {
                        c[i][j] = c[i][j] / den;
                    }
                }
            }
            for (int j = 0; j < HC; ++j) {
                float s = 0.0f;
                for (int i = 0; i < HC; ++i) {
                    s += c[i][j];
                }
                const float den = s + hc_eps;
                for (int i = 0; i < HC; ++i) {
                    c[i][j] = c[i][j] / den;
                }
            }
        }
        for (int i = 0; i < HC; ++i) {
            for (int j = 0; j < HC; ++j) {
                comb[(size_t)row * HC * HC + i * HC + j] = c[i][j];
            }
        }
    }
    __syncthreads();

    // 4: the collapse in the streams' dtype over the whole row, then the block's
    // RMSNorm.
    float sq[1] = {0.0f};
    for (int d = tid; d < D; d += blockDim.x) {
        float sv[HC];
        {streams_again}
        float x = pre_s[0] * sv[0];
        for (int i = 1; i < HC; ++i) {
            x = x + pre_s[i] * sv[i];
        }
        const float xo = (float)(Y)(T)x;
        sq[0] += xo * xo;
    }
    block_sum<1>(sq, (float (*)[1])red, tid);
    if (tid == 0) {
        scal[0] = rsqrtf(sq[0] / (float)D + consts[2]);
    }
    __syncthreads();
    const float normalizer = scal[0];
    for (int d = tid; d < D; d += blockDim.x) {
        float sv[HC];
        {streams_again}
        float x = pre_s[0] * sv[0];
        for (int i = 1; i < HC; ++i) {
            x = x + pre_s[i] * sv[i];
        }
        const float xo = (float)(Y)(T)x;
        const float xn = xo * normalizer;
        // MLX's norm rounds the normalised value to its output's dtype before the
        // weight when the weight has that dtype; a wider weight (the model's float32
        // weights, cast back: deepseek_v4/norm.py) is applied in float32 first.
        y[(size_t)row * D + d] = ROUND_TWICE ? (Y)((float)(Y)weight[d] * (float)(Y)xn)
                                             : (Y)((float)weight[d] * xn);
    }
"""

# The row's sums into ``total``, one block per row: thread 0 holds them.
_GATHER_ONE = """
    if (tid == 0) {
        for (int m = 0; m <= M; ++m) {
            total[m] = acc[m];
        }
    }
    __syncthreads();
"""

# The row's sums into ``total``, the row split between SPLIT blocks: each block writes
# its partial sums and counts itself; the last one to finish adds them all up (in the
# order of the parts, so the sums do not depend on which block came last) and goes on.
_GATHER_SPLIT = """
    __shared__ int is_last;
    if (tid == 0) {
        for (int m = 0; m <= M; ++m) {
            partials[((size_t)row * SPLIT + part) * (M + 1) + m] = acc[m];
        }
        __threadfence();
        is_last = atomicAdd(&counter[row], 1) == SPLIT - 1;
    }
    __syncthreads();
    if (!is_last) {
        return;
    }
    // The other blocks fenced their sums before counting themselves: read them past
    // the L1 cache.
    __threadfence();
    for (int m = tid; m <= M; m += blockDim.x) {
        float v = 0.0f;
        for (int p = 0; p < SPLIT; ++p) {
            v += __ldcg(&partials[((size_t)row * SPLIT + p) * (M + 1) + m]);
        }
        total[m] = v;
    }
    __syncthreads();
"""

_ENTER_STREAMS = """
        for (int i = 0; i < HC; ++i) {
            sv[i] = (float)s_in[i * D + d];
        }
"""

_LEAVE_STREAMS = """
        const float b = (float)block_out[(size_t)row * D + d];
        for (int i = 0; i < HC; ++i) {
            float v = post_in[(size_t)row * HC + i] * b;
            for (int j = 0; j < HC; ++j) {
                v = v + comb_in[(size_t)row * HC * HC + j * HC + i] * (float)s_in[j * D + d];
            }
            const T t = (T)v;
            {write}
            sv[i] = (float)t;
        }
"""

_WRITE = "new_streams[(size_t)row * K + i * D + d] = t;"

_PARAMETERS = ["fn", "scale", "base", "weight", "consts"]


def available() -> bool:
    """Whether the kernels can run here: the default device is a CUDA GPU."""
    return on_cuda()


def blocks_per_row(dim: int) -> int:
    """How many thread blocks share one row's dot products: one channel per thread, at
    most `MAX_BLOCKS_PER_ROW`, from `SPLIT_FROM_DIM` channels. One block per row left
    a real width's kernel (hidden 4096: the mix's 1.6 MB) on one of the GPU's SMs;
    split, it took 70-103 µs a call against 125 (H100, `hc_kernel_h100_stop32.json`).
    A split kernel pays for its row counters: MLX zeroes every output of a kernel that
    needs any zeroed, a fill kernel each. At hidden 512 that costs more than the split
    gains (56 µs a call split, 58 in one block with the same fills), so narrower rows
    keep one block and no fills."""
    if dim < SPLIT_FROM_DIM:
        return 1
    return max(1, min(MAX_BLOCKS_PER_ROW, -(-dim // THREADS)))


@cache
def _kernel(leave: bool, split: bool) -> Any:
    """Built on first use: nothing is compiled at import, nor on a machine without CUDA.
    ``split``: a row's dot products split between blocks (`_GATHER_SPLIT`)."""
    if leave:
        inputs = ["block_out", "streams", "post_in", "comb_in", *_PARAMETERS]
        outputs = ["new_streams", "y", "post", "comb"]
        body = _BODY.replace("{streams}", _LEAVE_STREAMS.replace("{write}", _WRITE))
        body = body.replace("{streams_again}", _LEAVE_STREAMS.replace("{write}", ""))
    else:
        inputs = ["streams", *_PARAMETERS]
        outputs = ["y", "post", "comb"]
        body = _BODY.replace("{streams}", _ENTER_STREAMS)
        body = body.replace("{streams_again}", _ENTER_STREAMS)
    body = body.replace("{gather}", _GATHER_SPLIT if split else _GATHER_ONE)
    name = "mlxserve_hc_leave_enter" if leave else "mlxserve_hc_enter"
    return mx.fast.cuda_kernel(
        name=name + ("_split" if split else ""),
        input_names=inputs,
        output_names=[*outputs, "partials", "counter"] if split else outputs,
        source=body,
        header=_HEADER,
    )


def _launch(
    leave: bool, inputs: list[mx.array], out_dtype: mx.Dtype, iters: int, split: int | None
) -> list[mx.array]:
    """The kernel over ``inputs``, through `_compiled_launch`: MLX's Python binding of a
    custom kernel rebuilds the kernel's source and arguments on every call (about 30 us
    of host time a call on an H100's host, two calls a layer), where a compiled
    function replays the traced call."""
    outputs: list[mx.array] = _compiled_launch(leave, out_dtype, iters, split)(*inputs)
    return outputs


@cache
def _compiled_launch(leave: bool, out_dtype: mx.Dtype, iters: int, split: int | None) -> Any:
    """`_launcher` under ``mx.compile`` (traced once per input shapes and dtypes)."""
    return mx.compile(_launcher(leave, out_dtype, iters, split))


def _launcher(
    leave: bool, out_dtype: mx.Dtype, iters: int, split: int | None
) -> Callable[..., list[mx.array]]:
    """The kernel's call on its inputs (the streams are the first, or the second when
    ``leave``), as a function of the inputs alone."""

    def launch(*inputs: mx.array) -> list[mx.array]:
        streams = inputs[1] if leave else inputs[0]
        return _launch_now(leave, list(inputs), streams, out_dtype, iters, split)

    return launch


def _launch_now(
    leave: bool,
    inputs: list[mx.array],
    streams: mx.array,
    out_dtype: mx.Dtype,
    iters: int,
    split: int | None,
) -> list[mx.array]:
    batch, length, hc, dim = streams.shape
    rows = batch * length
    split = blocks_per_row(dim) if split is None else split
    shapes: list[tuple[int, ...]] = [
        (batch, length, dim),
        (batch, length, hc),
        (batch, length, hc, hc),
    ]
    dtypes = [out_dtype, mx.float32, mx.float32]
    if leave:
        shapes.insert(0, tuple(streams.shape))
        dtypes.insert(0, streams.dtype)
    if split > 1:  # each block's partial sums, and how many of a row's blocks wrote theirs
        shapes += [(rows * split * ((2 + hc) * hc + 1),), (rows,)]
        dtypes += [mx.float32, mx.int32]
    outputs: list[mx.array] = _kernel(leave, split > 1)(
        inputs=inputs,
        template=[
            ("T", streams.dtype),
            ("Y", out_dtype),
            ("HC", hc),
            ("D", dim),
            ("ITERS", iters),
            ("SPLIT", split),
            # inputs end with the block norm's weight and the epsilons (`_PARAMETERS`)
            ("ROUND_TWICE", inputs[-2].dtype == out_dtype),
        ],
        grid=(rows * split * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=shapes,
        output_dtypes=dtypes,
        init_value=0 if split > 1 else None,  # the row counters start at 0
    )
    return outputs[:-2] if split > 1 else outputs


def enter(
    streams: mx.array,
    mix: tuple[mx.array, mx.array, mx.array],
    weight: mx.array,
    consts: mx.array,
    out_dtype: mx.Dtype,
    iters: int,
    split: int | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """(the block's normalised input [B, S, D], post [B, S, hc], comb [B, S, hc, hc])
    from the streams [B, S, hc, D]; ``mix`` the hyper-connection's (fn, scale, base),
    ``weight`` the block norm's, ``consts`` float32 [the flat RMSNorm's eps, hc_eps,
    the block norm's eps], ``out_dtype`` the block norm's output dtype; ``split`` the
    blocks per row (`blocks_per_row` unless given: the benchmark compares)."""
    fn, scale, base = mix
    inputs = [streams, fn, scale, base, weight, consts]
    y, post, comb = _launch(False, inputs, out_dtype, iters, split)
    return y, post, comb


def leave_enter(
    block_out: mx.array,
    streams: mx.array,
    post: mx.array,
    comb: mx.array,
    mix: tuple[mx.array, mx.array, mx.array],
    weight: mx.array,
    consts: mx.array,
    out_dtype: mx.Dtype,
    iters: int,
    split: int | None = None,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """A block's exit (``post``, ``comb`` its entry's) and the next one's `enter`:
    (the new streams, the next block's normalised input, its post, its comb)."""
    fn, scale, base = mix
    inputs = [block_out, streams, post, comb, fn, scale, base, weight, consts]
    new, y, post2, comb2 = _launch(True, inputs, out_dtype, iters, split)
    return new, y, post2, comb2


__all__ = [
    "MAX_BLOCKS_PER_ROW",
    "SPLIT_FROM_DIM",
    "THREADS",
    "available",
    "blocks_per_row",
    "enter",
    "leave_enter",
]
