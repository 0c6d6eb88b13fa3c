"""The CUDA hyper-connection kernel against the ops, on the GPU; one JSON.

`mlxserve.kernels.hyper_connection` runs a DeepSeek-V4 hyper-connection's entry with
its block's RMSNorm (`enter`), and a block's exit with the next block's entry
(`leave_enter`), as one kernel each. The model checks it once per process against the
ops (``hyper_connections.cuda_agrees``) and only says yes or no; this prints what
the check compares, output by output: the largest absolute difference of each of the
kernel's outputs from the ops' (random rows, hc 4 or 2, hidden 32 to 4096, float32 and
bfloat16), whether the model's check accepts it, and the latency of one call of each
(evaluated per call, so launch and synchronisation included; and chained, as a step
queues them) against the ops' fused path and the block norm, with each row's dot
products split between blocks as the kernel chooses and in one block (before stop
32). It needs CUDA; elsewhere it says so and exits 2.

Run: python benchmarks/hc_kernel.py [--calls 300]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxserve.hardware.probe import benchmark_device
from mlxserve.kernels import hyper_connection as kernel
from mlxserve.models.deepseek_v4 import ModelArgs
from mlxserve.models.deepseek_v4 import hyper_connections as hc
from mlxserve.models.deepseek_v4.norm import InputDtypeRMSNorm

#: (hc, hidden, streams' dtype, the norm weight's dtype) of the comparisons
CASES = [
    (4, 512, mx.float32, mx.float32),
    (4, 512, mx.bfloat16, mx.bfloat16),
    (4, 512, mx.bfloat16, mx.float32),
    (4, 4096, mx.float32, mx.float32),
    (4, 4096, mx.bfloat16, mx.bfloat16),
    (4, 4096, mx.bfloat16, mx.float32),
    (2, 32, mx.float32, mx.float32),
    (4, 64, mx.float32, mx.float32),
    (4, 200, mx.bfloat16, mx.float32),  # a row's last block holds fewer channels
]
ITERS = 20
OUTPUTS = ["y", "post", "comb", "new_streams", "y2", "post2", "comb2"]


def make(
    hc_mult: int, dim: int, dtype: Any, weight_dtype: Any, rows: int = 3
) -> tuple[hc.HyperConnection, InputDtypeRMSNorm, mx.array, mx.array]:
    """A hyper-connection with random weights, a block norm, streams and a block's output."""
    args = ModelArgs.from_dict(
        {
            "hidden_size": dim,
            "hc_mult": hc_mult,
            "hc_sinkhorn_iters": ITERS,
            "vocab_size": 8,
            "num_hidden_layers": 1,
        }
    )
    block = hc.HyperConnection(args)  # type: ignore[arg-type]
    keys = iter(mx.random.split(mx.random.key(5), 8))
    streams = mx.random.normal((1, rows, hc_mult, dim), key=next(keys)).astype(dtype)
    block.fn = mx.random.normal(block.fn.shape, key=next(keys)) * (hc_mult * dim) ** -0.5
    block.base = mx.random.normal(block.base.shape, key=next(keys)) * 0.1
    block.scale = mx.random.uniform(0.5, 1.5, (3,), key=next(keys))
    norm = InputDtypeRMSNorm(dim, eps=1e-6)  # the model's block norm
    norm.weight = (1 + 0.1 * mx.random.normal((dim,), key=next(keys))).astype(weight_dtype)
    out = mx.random.normal((1, rows, dim), key=next(keys)).astype(dtype)
    return block, norm, streams, out


def differences(
    hc_mult: int, dim: int, dtype: Any, weight_dtype: Any, split: int | None = None
) -> dict[str, Any]:
    """Each output's largest difference from the ops, and the model's verdict; the
    kernel's rows split between ``split`` blocks (the kernel's own choice if None)."""
    block, norm, streams, out = make(hc_mult, dim, dtype, weight_dtype)
    block.compiled_max_rows = 0  # the ops
    mix, weight, consts, out_dtype = block._kernel_parts(norm, streams)
    ours = kernel.enter(streams, mix, weight, consts, out_dtype, ITERS, split)
    theirs = block.enter(streams, norm)
    ours_next = kernel.leave_enter(
        out, streams, theirs[1], theirs[2], mix, weight, consts, out_dtype, ITERS, split
    )
    theirs_next = block.leave_enter(out, streams, theirs[1], theirs[2], block, norm)
    worst = {
        name: float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())
        for name, a, b in zip(OUTPUTS, (*ours, *ours_next), (*theirs, *theirs_next), strict=True)
    }
    hc.cuda_agrees.cache_clear()
    agrees = hc.cuda_agrees(block.constants, ITERS, dim, dtype, weight_dtype)
    return {
        "blocks_per_row": kernel.blocks_per_row(dim) if split is None else split,
        "max_abs_difference": worst,
        "model_check_agrees": agrees,
    }


def latency_us(call: Callable[[], Any], calls: int) -> float:
    """Median microseconds of one call evaluated on its own."""
    mx.eval(call())
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        mx.eval(call())
        times.append(time.perf_counter() - began)
    times.sort()
    return times[len(times) // 2] * 1e6


def queued_us(step: Callable[[Any], Any], first: Any, calls: int) -> float:
    """Microseconds per call of ``calls`` calls chained (each fed the last one's
    outputs) and evaluated once, as a decode step queues them: the device's time
    per call without the host's wait for each (median of 5 chains)."""
    mx.eval(step(first))
    times = []
    for _ in range(5):
        state = first
        began = time.perf_counter()
        for _ in range(calls):
            state = step(state)
        mx.eval(state)
        times.append((time.perf_counter() - began) / calls)
    times.sort()
    return times[2] * 1e6


def latencies(dim: int, rows: int, calls: int) -> dict[str, float]:
    """The kernel's calls (its rows split as it chooses, and one block per row, as
    before stop 32) against the ops' fused path (bfloat16 streams and norm)."""
    block, norm, streams, out = make(4, dim, mx.bfloat16, mx.bfloat16, rows)
    block.compiled_max_rows = 64
    mix, weight, consts, dtype = block._kernel_parts(norm, streams)

    def kernel_both(split: int | None) -> Any:
        _, post, comb = kernel.enter(streams, mix, weight, consts, dtype, ITERS, split)
        return kernel.leave_enter(
            out, streams, post, comb, mix, weight, consts, dtype, ITERS, split
        )

    def chained(split: int | None) -> Callable[[Any], Any]:
        def step(state: Any) -> Any:
            now, _, post, comb = state
            return kernel.leave_enter(
                out, now, post, comb, mix, weight, consts, dtype, ITERS, split
            )

        return step

    def ops_enter() -> Any:
        x, post, comb = block.enter(streams)  # the fused ops, then the block norm
        return norm(x), post, comb

    def ops_both() -> Any:
        x, post, comb = block.enter(streams)
        new = block.leave(out, streams, post, comb)
        x, post, comb = block.enter(new)
        return new, norm(x), post, comb

    first = kernel_both(1)
    return {
        "blocks_per_row": kernel.blocks_per_row(dim),
        "kernel_enter": latency_us(
            lambda: kernel.enter(streams, mix, weight, consts, dtype, ITERS), calls
        ),
        "kernel_enter_one_block_per_row": latency_us(
            lambda: kernel.enter(streams, mix, weight, consts, dtype, ITERS, 1), calls
        ),
        "ops_enter_and_norm": latency_us(ops_enter, calls),
        "kernel_enter_then_leave_enter": latency_us(lambda: kernel_both(None), calls),
        "kernel_enter_then_leave_enter_one_block_per_row": latency_us(
            lambda: kernel_both(1), calls
        ),
        "ops_enter_leave_enter_and_norm": latency_us(ops_both, calls),
        "leave_enter_queued": queued_us(chained(None), first, 64),
        "leave_enter_queued_one_block_per_row": queued_us(chained(1), first, 64),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="calls timed per latency")
    args = parser.parse_args()
    if not kernel.available():
        print("hc_kernel: the kernel needs a CUDA GPU as MLX's default device", file=sys.stderr)
        raise SystemExit(2)
    result: dict[str, Any] = {"benchmark": "hc_kernel", "sinkhorn_iters": ITERS}
    for hc_mult, dim, dtype, weight_dtype in CASES:
        name = f"hc{hc_mult}_hidden{dim}_{dtype}_{weight_dtype}".replace("mlx.core.", "")
        result[name] = differences(hc_mult, dim, dtype, weight_dtype)
        if kernel.blocks_per_row(dim) > 1:
            result[name + "_one_block_per_row"] = differences(
                hc_mult, dim, dtype, weight_dtype, split=1
            )
    for dim in (512, 4096):
        for rows in (1, 4, 16):
            result[f"latency_us_hidden{dim}_rows{rows}"] = latencies(dim, rows, args.calls)
    result["device"] = benchmark_device()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
