"""What a small matmul costs by its number of rows, as a chain of lazy launches; one JSON.

A verify forward multiplies 2-6 rows where a decode step multiplies one. On an NVIDIA
H200 a verify of 2 tokens cost 1.3-1.5 decode steps of the DeepSeek-V4-Flash-shaped
model although its graph had only 3 % more nodes, so this asks whether a matmul's
cost jumps past one row (one row is a matrix-vector product; more may take another
kernel). For each weight shape and row count it builds `--chain` dependent
products (each input the last output's first columns), evaluates them, and reports
the median microseconds per product: dense float32 as `x @ w.T`, the same as a
batch of one-row products (`x[:, None] @ w.T`), and 4-bit `quantized_matmul`.

Run: python benchmarks/matmul_rows.py [--rows 1,2,3,4,6] [--chain 400] [--trials 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import mlx.core as mx

from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device

SHAPES = ((512, 512), (512, 2048), (512, 8192))  # (in, out); each output is cut back to `in`


def chain_us(
    product: Callable[[mx.array], mx.array], x: mx.array, chain: int, trials: int
) -> float:
    """Median microseconds per product of a chain of `chain` dependent products."""
    times = []
    for trial in range(trials + 1):
        start = time.perf_counter()
        current = x
        for _ in range(chain):
            out = product(current)
            current = out.reshape(x.shape[0], -1)[:, : x.shape[1]]
        mx.eval(current)
        elapsed = time.perf_counter() - start
        if trial:
            times.append(elapsed / chain * 1e6)
    return statistics.median(times)


def products(
    w: mx.array, wq: mx.array, scales: mx.array, biases: mx.array
) -> dict[str, Callable[[mx.array], mx.array]]:
    """The three forms of one weight's product."""
    return {
        "dense": lambda a: a @ w.T,
        "dense_row_batch": lambda a: a[:, None, :] @ w.T,
        "quantized": lambda a: mx.quantized_matmul(a, wq, scales, biases, group_size=64, bits=4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,3,4,6")
    parser.add_argument("--chain", type=int, default=400)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    configure_cuda_graphs()
    results = []
    for dim_in, dim_out in SHAPES:
        w = mx.random.normal((dim_out, dim_in)) / dim_in**0.5
        wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
        mx.eval(w, wq, scales, biases)
        for rows in (int(r) for r in args.rows.split(",")):
            x = mx.random.normal((rows, dim_in))
            mx.eval(x)
            forms = products(w, wq, scales, biases)
            row: dict[str, float] = {"in": dim_in, "out": dim_out, "rows": rows}
            for name, product in forms.items():
                row[f"{name}_us"] = chain_us(product, x, args.chain, args.trials)
            results.append(row)
    print(
        json.dumps(
            {
                "benchmark": "matmul_rows",
                "device": benchmark_device(),
                "chain": args.chain,
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
