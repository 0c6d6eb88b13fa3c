"""One DeepSeek-V4-Flash attention layer, one prefill chunk deep into a context: by blocks
against the one masked call; one JSON.

A layer's attention at V4-Flash's widths (64 heads of 512, window 128, CSA ratio 4
with a 64 x 128 indexer picking 512, HCA ratio 128), random weights (bfloat16
projections, or MXFP8 as real_width.py builds them with `--mxfp8`), runs one chunk of
`--chunk` tokens whose cache holds `context - chunk` tokens already (`seed_cache`:
the shapes and dtypes a prefill leaves, random values), so a chunk at 100K costs one
chunk, not a 100K prefill. Per context and layer kind, in turn in one process:

- `blocked`: as shipped (`Attention.blocked_prefill`, `Indexer.grouped_scores`):
  each query over its own window rows and entries, the index scores a query group
  at a time, `wo_a` one matmul per output group;
- `dense`: the masked call of a verify forward over every window row and entry, all
  index scores at once, `wo_a` per row (what a prefill chunk ran before).

Each reports the median seconds, tok/s, the counted FLOPs over a measured bf16 matmul
rate, and the peak memory above the layer and its cache (MLX's peak), and the two
outputs' largest difference. The dense side is skipped above `--dense-max-context`.

CPU: python benchmarks/prefill_attention.py --contexts 8192,32768 --chunk 256
GPU: python benchmarks/prefill_attention.py --contexts 4096,32768,102400 --chunk 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import mlx.core as mx
from mlx.nn.layers.quantized import quantize
from mlx.utils import tree_flatten, tree_unflatten

from mlxserve.models.deepseek_v4 import ModelArgs
from mlxserve.models.deepseek_v4.attention import Attention
from mlxserve.models.deepseek_v4.cache import LayerCache
from mlxserve.models.deepseek_v4.config import CSA, HCA
from mlxserve.models.deepseek_v4.indexer import Indexer

GB = 1e9
KINDS = {"csa": CSA, "hca": HCA}


def seed_cache(
    attn: Attention, context: int, key: mx.array, dtype: mx.Dtype = mx.bfloat16
) -> LayerCache:
    """The cache ``attn`` has after a prefill of ``context`` tokens whose input rows
    are ``dtype``: the same arrays in shapes and dtypes (each made by the layer's own
    projections of a zero row), with random values; evaluated."""
    cache = attn.make_cache()
    keys = iter(mx.random.split(key, 8))
    zero = mx.zeros((1, 1, attn.wkv.weight.shape[-1] * _packing(attn.wkv)), dtype=dtype)
    if context:
        rows = min(attn.sliding_window - 1, context)
        kind = attn.norm(attn.wkv(zero)).dtype
        window = mx.random.normal((1, rows, attn.head_dim), key=next(keys))
        cache.window = window.astype(kind)
    cache.offset = context
    for name, state in cache.compressors.items():
        compressor = attn.compressor if name == "compressor" else attn.indexer.compressor
        count = context // state.ratio
        if count:
            shape = (1, count, compressor.head_dim)
            state.entries = mx.random.normal(shape, key=next(keys))
        state.raw_start = state.first_needed(context)
        width = compressor.head_dim * (2 if state.overlap else 1)
        held = (1, context - state.raw_start, width)
        raw = compressor.wkv(zero).dtype
        state.raw_kv = mx.random.normal(held, key=next(keys)).astype(raw)
        state.raw_gate = mx.random.normal(held, key=next(keys)).astype(raw)
    mx.eval(cache.state)
    return cache


def _packing(layer: Any) -> int:
    """Inputs per stored column of a linear layer's weight (32 / bits when quantised)."""
    bits = getattr(layer, "bits", None)
    return 32 // int(bits) if bits and layer.weight.dtype == mx.uint32 else 1


def set_blocked(module: Any, on: bool) -> None:
    """Every attention and indexer in ``module`` blocked (as shipped) or dense."""
    for part in module.modules():
        if isinstance(part, Attention):
            part.blocked_prefill = on
        elif isinstance(part, Indexer):
            part.grouped_scores = on


def build_attention(
    kind: str, mxfp8: bool, seed: int = 0, norm_dtype: mx.Dtype = mx.float32
) -> Attention:
    """One attention layer of ``kind`` at V4-Flash's widths, random weights (its RMSNorm
    weights ``norm_dtype``), evaluated."""
    from real_width import DENSE_MODE, FLOAT32, _random_bf16, _random_codes

    attn = Attention(ModelArgs(num_hidden_layers=1), KINDS[kind])
    if mxfp8:
        from mtp_cost import FP8_PROJECTIONS

        quantize(
            attn,
            DENSE_MODE[1],
            DENSE_MODE[2],
            mode=DENSE_MODE[0],
            class_predicate=lambda path, _: FP8_PROJECTIONS.search("attn." + path) is not None,
        )
    made = []
    flat: Any = tree_flatten(attn.parameters())  # type: ignore[no-untyped-call]
    for i, (name, value) in enumerate(flat):
        part = mx.random.key(seed * 1_000_003 + i)
        shape = tuple(value.shape)
        if value.dtype == mx.uint32:
            new = _random_codes(shape, True, part)
        elif value.dtype == mx.uint8:
            new = mx.full(shape, 122, dtype=mx.uint8)
        elif any(tag in name for tag in FLOAT32) or value.ndim < 2:
            new = mx.random.normal(shape, key=part) * (0.1 if value.ndim < 2 else 0.02)
            if name.endswith("norm.weight"):
                new = (new + 1.0).astype(norm_dtype)
        else:
            new = _random_bf16(shape, shape[-1], part)
        mx.eval(new)
        made.append((name, new))
    attn.update(tree_unflatten(made))
    return attn


def counted_flops(attn: Attention, context: int, chunk: int) -> float:
    """FLOPs of the chunk's queries at positions ``context - chunk ..``: 2 per projection
    weight per token, and the attention real_width.py counts (`attention_flops`)."""
    from real_width import attention_flops

    params = 0
    flat: Any = tree_flatten(attn.parameters())  # type: ignore[no-untyped-call]
    for _, value in flat:
        if value.dtype == mx.uint32:
            params += int(value.size) * 4
        elif value.dtype != mx.uint8 and value.ndim >= 2:
            params += int(value.size)
    args = ModelArgs(num_hidden_layers=1)
    return 2.0 * params * chunk + attention_flops(args, attn.layer_type, context - chunk, context)


def run_chunk(attn: Attention, context: int, x: mx.array, key: mx.array) -> dict[str, Any]:
    """One chunk ``x`` at ``context`` (its last token's position + 1): seconds, peak
    memory above the layer and the seeded cache, and the output."""
    cache = seed_cache(attn, context - x.shape[1], key)
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    start = time.perf_counter()
    out = attn(x, cache)
    mx.eval(out, cache.state)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_gb": (mx.get_peak_memory() - before) / GB, "out": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="8192,32768", help="positions after the chunk")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--kinds", default="csa,hca")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dense-max-context", type=int, default=32768)
    parser.add_argument("--mxfp8", action="store_true", help="MXFP8 projections")
    parser.add_argument(
        "--norm-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="RMSNorm weights (float32: float32 queries and keys, as real_width.py's)",
    )
    parser.add_argument("--matmul", type=int, default=1024, help="matmul size of the rate")
    args = parser.parse_args()
    from real_width import matmul_rate

    from mlxserve.hardware.probe import benchmark_device

    rate = matmul_rate(args.matmul)
    result: dict[str, Any] = {
        "benchmark": "prefill_attention",
        "device": benchmark_device(),
        "chunk": args.chunk,
        "projections": "mxfp8" if args.mxfp8 else "bfloat16",
        "norm_dtype": args.norm_dtype,
        "matmul_flop_s": rate,
        "layers": {},
    }
    x = mx.random.normal((1, args.chunk, 4096), key=mx.random.key(1)).astype(mx.bfloat16)
    for kind in args.kinds.split(","):
        attn = build_attention(kind, args.mxfp8, norm_dtype=getattr(mx, args.norm_dtype))
        rows: dict[str, Any] = {}
        for context in (int(c) for c in args.contexts.split(",")):
            sides = ["blocked"]
            if context <= args.dense_max_context:
                sides.append("dense")
            runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
            key = mx.random.key(context)
            for repeat in range(args.repeats):
                for side in sides if repeat % 2 == 0 else sides[::-1]:
                    set_blocked(attn, side == "blocked")
                    run = run_chunk(attn, context, x, key)
                    print(f"{kind} {context} {side}: {run['seconds']:.1f} s", file=sys.stderr)
                    runs[side].append(run)
            set_blocked(attn, True)
            flops = counted_flops(attn, context, args.chunk)
            row: dict[str, Any] = {"flops": flops}
            for side, done in runs.items():
                seconds = statistics.median(r["seconds"] for r in done)
                row[side] = {
                    "seconds": seconds,
                    "tok_s": args.chunk / seconds,
                    "share_of_flop_bound": flops / rate / seconds,
                    "peak_over_inputs_gb": max(r["peak_gb"] for r in done),
                }
            if "dense" in runs:
                blocked, dense = runs["blocked"][0]["out"], runs["dense"][0]["out"]
                diff = mx.abs(blocked.astype(mx.float32) - dense.astype(mx.float32))
                row["max_abs_diff"] = float(diff.max())
                row["dense_abs_max"] = float(mx.abs(dense.astype(mx.float32)).max())
                row["speedup"] = row["dense"]["seconds"] / row["blocked"]["seconds"]
            rows[str(context)] = row
        result["layers"][kind] = rows
        del attn
        mx.clear_cache()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
