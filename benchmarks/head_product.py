"""The CUDA head-product kernel against the ops, on the GPU; one JSON.

`mlxserve.kernels.head_product` multiplies float32 activations by a bfloat16
vocabulary head in one kernel; the ops (`deepseek_v4/head.py`'s `sliced_product`)
cast the head to float32 a slice at a time first. At V4-Flash's head (129,280 x
4,096, random bfloat16) and 1, 4, 16 and 64 activation rows this prints each path's
latency (median of calls evaluated one at a time, so launches included), the bytes
the head is over that time, the kernel's and the ops' largest differences from the
CPU's float32 product (relative to the largest logit; the GPU's float32 matmul of
several rows runs as TF32), and the model's own check. For scale, the
same rows through a plain bfloat16 matmul (bfloat16 logits: what the float32 path
avoids) are timed too. It needs CUDA; elsewhere it says so and exits 2.

Run: python benchmarks/head_product.py [--calls 50]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
from hc_kernel import latency_us  # beside this file

from mlxserve.hardware.probe import benchmark_device
from mlxserve.kernels import head_product as kernel
from mlxserve.models.deepseek_v4.head import SLICE_BYTES, sliced_product

VOCAB, DIM = 129_280, 4_096


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50, help="calls timed per latency")
    args = parser.parse_args()
    if not kernel.available():
        print("head_product: the kernel needs a CUDA GPU as MLX's default device", file=sys.stderr)
        raise SystemExit(2)
    keys = iter(mx.random.split(mx.random.key(3), 8))
    weight = (mx.random.normal((VOCAB, DIM), key=next(keys)) * DIM**-0.5).astype(mx.bfloat16)
    mx.eval(weight)
    head_gb = weight.nbytes / 1e9
    result: dict[str, Any] = {
        "benchmark": "head_product",
        "head": [VOCAB, DIM],
        "head_gb": head_gb,
        "model_check_agrees": kernel.agrees(mx.bfloat16, DIM),
    }
    for rows in (1, 4, 16, 64):
        h = mx.random.normal((1, rows, DIM), key=next(keys)) * 4.0
        mx.eval(h)
        ours, theirs = kernel.product(h, weight), sliced_product(h, weight, SLICE_BYTES)
        exact = mx.matmul(h, weight.astype(mx.float32).T, stream=mx.cpu)  # no TF32
        mx.eval(ours, theirs, exact)
        scale = float(mx.abs(exact).max())
        paths: dict[str, Callable[[mx.array], mx.array]] = {
            "kernel_ms": lambda x: kernel.product(x, weight),
            "sliced_ops_ms": lambda x: sliced_product(x, weight, SLICE_BYTES),
            "bf16_matmul_ms": lambda x: x.astype(mx.bfloat16) @ weight.T,
        }
        timed = {
            name: latency_us(partial(path, h), args.calls) / 1e3 for name, path in paths.items()
        }
        result[f"rows{rows}"] = {
            **timed,
            "kernel_head_gb_s": head_gb / (timed["kernel_ms"] / 1e3),
            "kernel_over_ops": timed["kernel_ms"] / timed["sliced_ops_ms"],
            "max_difference_of_top_logit": float(mx.abs(ours - exact).max()) / scale,
            "ops_max_difference_of_top_logit": float(mx.abs(theirs - exact).max()) / scale,
            "same_argmax": bool(mx.array_equal(mx.argmax(ours, -1), mx.argmax(theirs, -1))),
        }
    result["device"] = benchmark_device()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
