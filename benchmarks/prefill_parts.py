"""Where a real-width prefill chunk's time goes: one DeepSeek-V4-Flash layer, part by
part, against the device's matmul rate; one JSON.

`real_width.py` reports a whole prefill's share of the FLOP bound; when that share is
small, this says which part holds it back. One layer at the published widths
(`real_width.build`, random weights, MXFP4 experts, MXFP8 projections) runs one chunk
of `--chunk` tokens over a cache seeded with `context - chunk` tokens, and each part is
timed alone on the inputs it gets in the layer (median of `--repeats`, each evaluated):

- `layer`: the whole decoder layer (hyper-connections, attention, MoE);
- `attention`: the attention block (projections, compressor, indexer, attention);
- `moe`: the MoE block (gate, routed experts, shared expert, mixing);
- `gate`, `routed_experts` (mlx-lm's SwitchGLU over MXFP4), `shared_expert`;
- `hc_enter`: one hyper-connection entry with its norm.

Two references at the routed experts' shape say what the quantised kernel costs:
`gather_bf16` (the same gather matmuls over bf16 weights, `mx.gather_mm`) and
`dense_bf16` (one bf16 matmul of the same FLOPs). Each part's FLOPs are counted from
its weights (2 per weight per token; routed: top-k experts per token), and its rate is
given as a share of the measured bf16 matmul rate.

GPU: python benchmarks/prefill_parts.py --contexts 4096,32768 --chunk 2048
Decode (one token): python benchmarks/prefill_parts.py --contexts 1024 --chunk 1 --routed-tokens ""
CPU: python benchmarks/prefill_parts.py --contexts 1024 --chunk 256 --experts 16 --matmul 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

GB = 1e9


def median_seconds(run: Callable[[], Any], repeats: int, setup: Callable[[], Any]) -> float:
    """Median wall seconds of ``mx.eval(run())`` after one warm-up; ``setup`` runs
    untimed before each call (a fresh cache for parts that append to one)."""
    times = []
    for i in range(repeats + 1):
        setup()
        start = time.perf_counter()
        mx.eval(run())
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def parts(model: Any, context: int, chunk: int, repeats: int, rate: float) -> dict[str, Any]:
    """Each part's median seconds, FLOPs and share of ``rate`` for one chunk."""
    from prefill_attention import seed_cache  # beside this file
    from real_width import _block_input, _weight_flops, last_chunk_start  # beside this file

    layer = model.layers[0]
    args = model.args
    first = last_chunk_start(context, chunk)
    length = context - first
    rows_dtype = model.model.embed_tokens.weight.dtype
    dtype = _block_input(layer, rows_dtype)
    hc = args.hc_mult
    key = mx.random.key(11)
    streams = (mx.random.normal((1, length, hc, args.hidden_size), key=key) * 0.5).astype(
        rows_dtype
    )
    tokens = mx.random.randint(0, args.vocab_size, (1, length), key=mx.random.key(12))
    x = layer.attn_norm(mx.random.normal((1, length, args.hidden_size)).astype(dtype))
    flat = x.reshape(-1, args.hidden_size)
    chosen, _ = layer.ffn.gate(flat, tokens)
    mx.eval(streams, tokens, x, flat, chosen)
    holder: dict[str, Any] = {}

    def fresh() -> None:
        holder["cache"] = seed_cache(layer.attn, first, mx.random.key(7), dtype)

    def keep() -> None:
        return None

    experts = layer.ffn.switch_mlp

    def flops(module: Any, path: str) -> float:
        return _weight_flops(module, args, path) * length

    routed_flops = flops(experts, ".ffn.switch_mlp.")
    shared_flops = flops(layer.ffn.shared_experts, ".ffn.shared_experts.")
    timings: dict[str, tuple[Callable[[], Any], Callable[[], Any], float | None]] = {
        "layer": (lambda: layer(streams, tokens, holder["cache"]), fresh, None),
        "attention": (lambda: layer.attn(x, holder["cache"]), fresh, flops(layer.attn, ".attn.")),
        "moe": (lambda: layer.ffn(x, tokens), keep, routed_flops + shared_flops),
        # The gate's scoring matmul alone (a hash layer's lookup table multiplies nothing).
        "gate": (
            lambda: layer.ffn.gate(flat, tokens),
            keep,
            2.0 * layer.ffn.gate.weight.size * length,
        ),
        "routed_experts": (lambda: experts(flat, chosen), keep, routed_flops),
        "shared_expert": (lambda: layer.ffn.shared_experts(flat), keep, shared_flops),
        "hc_enter": (lambda: layer.hc_attn.enter(streams, layer.attn_norm), keep, None),
    }
    # References at the routed shape: the same gathers over bf16 weights, and one
    # dense bf16 matmul of the same FLOPs.
    width = args.moe_intermediate_size
    hidden = args.hidden_size
    up = (mx.random.normal((args.n_routed_experts, width, hidden)) * 0.02).astype(mx.bfloat16)
    down = (mx.random.normal((args.n_routed_experts, hidden, width)) * 0.02).astype(mx.bfloat16)
    xb = flat.astype(mx.bfloat16)[:, None, None, :]
    mx.eval(up, down, xb)

    def gathered() -> mx.array:
        a = mx.gather_mm(xb, up.swapaxes(-1, -2), rhs_indices=chosen)
        b = mx.gather_mm(xb, up.swapaxes(-1, -2), rhs_indices=chosen)
        h = (a * mx.sigmoid(a) * b).astype(mx.bfloat16)
        return mx.gather_mm(h, down.swapaxes(-1, -2), rhs_indices=chosen)

    picks = length * args.num_experts_per_tok
    dense_a = (mx.random.normal((picks, hidden)) * 0.5).astype(mx.bfloat16)
    dense_w = (mx.random.normal((hidden, 3 * width)) * 0.02).astype(mx.bfloat16)
    mx.eval(dense_a, dense_w)
    timings["gather_bf16"] = (gathered, keep, routed_flops)
    timings["dense_bf16"] = (lambda: dense_a @ dense_w, keep, routed_flops)
    out: dict[str, Any] = {"first_position": first, "tokens": length}
    for name, (run, setup, counted) in timings.items():
        try:
            seconds = median_seconds(run, repeats, setup)
        except RuntimeError as error:  # the CPU has no bf16 gather_mm: say so, go on
            out[name] = {"error": str(error)[:200]}
            continue
        row: dict[str, Any] = {"ms": seconds * 1e3}
        if counted is not None:
            row.update(gflops=counted / 1e9, share_of_rate=counted / seconds / rate)
        out[name] = row
        print(json.dumps({"context": context, "part": name, **row}), file=sys.stderr, flush=True)
    holder.clear()
    return out


def routed_variants(model: Any, tokens: int, repeats: int, rate: float) -> dict[str, Any]:
    """One routed projection (``up_proj``, MXFP4) over ``tokens`` x top-k sorted rows,
    as each candidate kernel runs it: the stock sorted ``gather_qmm`` (M = 1 rows),
    expert-aligned tiles of 64 / 128 / 256 rows (`kernels.moe.full_matmul`), and the
    experts dequantised to bf16 first (counted in), then gathered by rows or by tiles."""
    from mlx_lm.models.switch_layers import _gather_sort

    from mlxserve.kernels.moe import QuantizedExperts, full_matmul

    args = model.args
    layer = model.layers[0].ffn.switch_mlp.up_proj
    experts = QuantizedExperts.of(layer)
    k = args.num_experts_per_tok
    x = (mx.random.normal((tokens, args.hidden_size)) * 0.5).astype(mx.bfloat16)
    chosen = mx.random.randint(0, args.n_routed_experts, (tokens, k)).astype(mx.uint32)
    xs, idx, _ = _gather_sort(x[:, None, None, :], chosen)  # type: ignore[no-untyped-call]
    mx.eval(xs, idx)
    flops = 2.0 * tokens * k * layer["weight"].shape[1] * args.hidden_size

    def dequantized() -> mx.array:
        return mx.dequantize(
            experts.weight,
            experts.scales,
            experts.biases,
            group_size=experts.group_size,
            bits=experts.bits,
            mode=experts.mode,
            dtype=mx.bfloat16,
        )

    def tiled_bf16(tile: int) -> mx.array:
        from mlxserve.kernels.tiles import expert_tiles

        w = dequantized()
        tiles = expert_tiles(idx, experts.num_experts, tile)
        flat = xs.reshape(-1, args.hidden_size)
        tx = flat[tiles.slot_row].reshape(tiles.num_tiles, tile, args.hidden_size)
        ty = mx.gather_mm(tx, w.swapaxes(-1, -2), rhs_indices=tiles.tile_expert)
        return ty.reshape(tiles.slots, -1)[tiles.row_slot]

    runs: dict[str, Callable[[], Any]] = {
        "stock_sorted": lambda: experts.gather(xs, idx, sorted_indices=True),
        "tiles_64": lambda: full_matmul(experts, xs, idx, sorted_indices=True, tile_rows=64),
        "tiles_128": lambda: full_matmul(experts, xs, idx, sorted_indices=True, tile_rows=128),
        "tiles_256": lambda: full_matmul(experts, xs, idx, sorted_indices=True, tile_rows=256),
        "dequantize_only": dequantized,
        "bf16_sorted_rows": lambda: mx.gather_mm(
            xs, dequantized().swapaxes(-1, -2), rhs_indices=idx, sorted_indices=True
        ),
        "bf16_tiles_64": lambda: tiled_bf16(64),
        "bf16_tiles_128": lambda: tiled_bf16(128),
    }
    out: dict[str, Any] = {"tokens": tokens, "gflops": flops / 1e9}
    reference = None
    for name, run in runs.items():
        try:
            seconds = median_seconds(run, repeats, lambda: None)
        except Exception as error:  # a kernel this device lacks: say so, go on
            out[name] = {"error": str(error)[:200]}
            continue
        row: dict[str, Any] = {"ms": seconds * 1e3, "share_of_rate": flops / seconds / rate}
        if name != "dequantize_only":
            y = run().reshape(tokens * k, -1).astype(mx.float32)
            if reference is None:
                reference = y
            row["max_abs_diff_vs_stock"] = float(mx.abs(y - reference).max())
        out[name] = row
        print(
            json.dumps({"routed_tokens": tokens, "variant": name, **row}),
            file=sys.stderr,
            flush=True,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--matmul", type=int, default=8192)
    parser.add_argument(
        "--routed-tokens", default="2048,8192", help="tokens of the routed-kernel variants"
    )
    parser.add_argument(
        "--norm-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="RMSNorm weights (real_width.py's flag): float32 gives float32 activations",
    )
    parser.add_argument("--skip-parts", action="store_true", help="the routed variants alone")
    args = parser.parse_args()
    from real_width import build, matmul_rate  # beside this file

    from mlxserve.hardware.probe import benchmark_device

    model = build(1, args.experts, layer_types=["csa"], norm_dtype=args.norm_dtype)
    rate = matmul_rate(args.matmul)
    result: dict[str, Any] = {
        "benchmark": "prefill_parts",
        "device": benchmark_device(),
        "chunk": args.chunk,
        "experts": args.experts,
        "norm_dtype": args.norm_dtype,
        "matmul_flop_s": rate,
        "contexts": {},
    }
    if not args.skip_parts:
        for context in (int(c) for c in args.contexts.split(",")):
            result["contexts"][str(context)] = parts(model, context, args.chunk, args.repeats, rate)
    result["routed_variants"] = [
        routed_variants(model, int(t), args.repeats, rate)
        for t in args.routed_tokens.split(",")
        if t
    ]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
