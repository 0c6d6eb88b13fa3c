"""DeepSeek-V4-Flash at its published widths, random weights, against the hardware; one JSON.

The model is mlxserve's own (`mlxserve.models.deepseek_v4`) with V4-Flash's widths
(`ModelArgs`' defaults: hidden 4096, 64 heads of 512, q/o ranks 1024, 8 output
groups, 256 routed experts of width 2048 plus a shared one, top-6, sliding window
128, CSA ratio 4 with a 64 x 128 indexer picking 512, HCA ratio 128, hc 4, vocab
129,280) and one MTP block, at `--layers` layers of the published pattern. Its
weights are made where they lie, never through a float copy of the experts: the
routed experts as MXFP4 (random 4-bit codes, one e8m0 scale per 32), the projections
the checkpoint ships in FP8 as MXFP8 (random e4m3 codes, none of them NaN), the
other matrices as bfloat16 drawn bit by bit, so a layer (about 3.3 GB of experts)
builds in seconds.

It reports, on the default device:

- `bandwidth`: an `mx` copy (read + write) of `--copy-mb` MB, GB/s;
- `decode`: at each batch of `--batches`, the step time (synced, median) against the
  weight-read bound: the bytes one step reads (every dense weight, the lm_head, and
  per layer the distinct experts the batch's 6 picks each touch, expected under
  uniform routing) over the measured bandwidth;
- `prefill`: at each context of `--contexts` (skipped where the cache and
  activations would not fit `--memory-gb`), tok/s against a FLOP bound (the
  forward's FLOPs over a measured bf16 matmul rate on this device), with the peak
  memory and the cache's bytes, against the cache bytes the layer shapes predict;
- `graph_nodes`: non-view nodes per decode layer by primitive, fused and plain
  (`graph_nodes.decode_layer_counts`; on a CPU the fast ops decompose, see there);
- `mtp`: the engine's own round costs (`measure_round_costs`) and, at oracle
  acceptances 0.7 and 0.85, the expected tokens per round over the round's cost
  (the bound `mtp_cost.py` checks real rounds against), in plain steps.

Run (GPU):  python benchmarks/real_width.py --layers 8
CPU, short: python benchmarks/real_width.py --layers 1 --quick
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx.nn.layers.quantized import quantize
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import SwitchLinear

from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device
from mlxserve.hardware.tuning import default_tuning

#: Routed experts: MXFP4, one e8m0 scale per 32 inputs (as the checkpoint ships them).
EXPERT_MODE = ("mxfp4", 32, 4)
#: The projections the checkpoint ships in FP8: MXFP8 as mlxserve loads them.
DENSE_MODE = ("mxfp8", 32, 8)
#: Parameters the reference keeps in float32.
FLOAT32 = ("hc_", "attn_sink", "gate.bias", "ape", ".fn", ".base", ".scale")
GB = 1e9


def flash_args(layers: int, experts: int) -> Any:
    """V4-Flash's published arguments at `layers` layers (and `experts` routed experts)."""
    from mlxserve.models.deepseek_v4 import ModelArgs

    return ModelArgs(num_hidden_layers=layers, n_routed_experts=experts)


def _bits(shape: tuple[int, ...], width: int, key: mx.array) -> mx.array:
    """Random uint32 (`width` 4) or uint16 (`width` 2) words, every bit random: a block
    of 64 random rows repeated down the array, each row XOR-ed with a random word of
    its own (one pass over the array, not a random draw per word: a 1 GB table is made
    in well under a second)."""
    keys = mx.random.split(key, 4)
    lead = math.prod(shape[:-1])
    cols = shape[-1]

    def words(count: tuple[int, ...], a: mx.array, b: mx.array) -> mx.array:
        low = mx.random.randint(0, 1 << 16, count, dtype=mx.uint32, key=b)
        if width == 2:
            return low.astype(mx.uint16)
        top = mx.random.randint(0, 1 << 16, count, dtype=mx.uint32, key=a)
        return (top << 16) | low

    block = words((min(lead, 64), cols), keys[0], keys[1])
    rows = words((lead, 1), keys[2], keys[3])
    reps = -(-lead // block.shape[0])
    return (mx.tile(block, (reps, 1))[:lead] ^ rows).reshape(shape)


def _random_bf16(shape: tuple[int, ...], fan_in: int, key: mx.array) -> mx.array:
    """bfloat16 values of magnitude ~ 1/sqrt(fan_in), random sign and mantissa, drawn as
    bits (no float32 copy of a 1 GB table)."""
    exponent = 127 - max(round(math.log2(math.sqrt(fan_in))), 0)
    bits = _bits(shape, 2, key) & 0x807F
    return (bits | (exponent << 7)).view(mx.bfloat16)


def _random_codes(shape: tuple[int, ...], eight_bit: bool, key: mx.array) -> mx.array:
    """Packed uint32 codes: e2m1 (every code a number) or e4m3 (the exponent's top bit
    cleared, so no code is NaN and none exceeds 1.875)."""
    codes = _bits(shape, 4, key)
    return codes & 0xBFBFBFBF if eight_bit else codes


def build(layers: int, experts: int = 256, seed: int = 0) -> Any:
    """The model (module docstring), evaluated."""
    from mtp_cost import FP8_PROJECTIONS  # beside this file

    from mlxserve.engine.core.build import materialize
    from mlxserve.models.deepseek_v4 import Model
    from mlxserve.models.deepseek_v4.model import MTPBlock

    args = flash_args(layers, experts)
    model = Model(args)
    model.mtp = [MTPBlock(args, "sliding_attention")]
    # The quantised modules' shapes; their lazy initial values are never evaluated.
    quantize(
        model,
        EXPERT_MODE[1],
        EXPERT_MODE[2],
        mode=EXPERT_MODE[0],
        class_predicate=lambda path, module: (
            isinstance(module, SwitchLinear) and ".switch_mlp." in path
        ),
    )
    quantize(
        model,
        DENSE_MODE[1],
        DENSE_MODE[2],
        mode=DENSE_MODE[0],
        class_predicate=lambda path, _: FP8_PROJECTIONS.search(path) is not None,
    )
    made = []
    parameters = tree_flatten(model.parameters())  # type: ignore[no-untyped-call]
    assert isinstance(parameters, list)
    for i, (name, value) in enumerate(parameters):
        part = mx.random.key(seed * 1_000_003 + i)
        shape = tuple(value.shape)
        if value.dtype == mx.uint32:  # packed codes
            new = _random_codes(shape, ".switch_mlp." not in name, part)
        elif value.dtype == mx.uint8:  # e8m0 scales: 2^-5 (FP8) or 2^-7 (FP4)
            new = mx.full(shape, 120 if ".switch_mlp." in name else 122, dtype=mx.uint8)
        elif name.endswith("tid2eid"):
            new = mx.random.randint(0, experts, shape, key=part).astype(mx.int32)
        elif any(tag in name for tag in FLOAT32) or value.ndim < 2:
            new = mx.random.normal(shape, key=part) * (0.1 if value.ndim < 2 else 0.02)
            if name.endswith("norm.weight"):
                new = new + 1.0
            new = new.astype(mx.float32)
        else:
            new = _random_bf16(shape, shape[-1], part)
        mx.eval(new)  # one at a time: the peak is the model, not its graph
        made.append((name, new))
    model.update(tree_unflatten(made))
    materialize(model)
    mx.clear_cache()  # the draws' intermediates: MLX keeps freed buffers for reuse
    return model


def copy_bandwidth(megabytes: int, repeats: int = 5) -> float:
    """GB/s of an `mx` copy (each byte read once and written once), median."""
    source = _bits((megabytes * 1024 * 1024 // 4,), 4, mx.random.key(5))
    mx.eval(source)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        out = source * 1  # a copy through the device's own kernel
        mx.eval(out)
        times.append(time.perf_counter() - start)
        del out
    return 2 * source.nbytes / statistics.median(times[1:]) / GB


def matmul_rate(size: int, repeats: int = 5) -> float:
    """bf16 FLOP/s of a size^3 matmul on this device, median (the prefill's bound)."""
    a = mx.random.normal((size, size)).astype(mx.bfloat16)
    b = mx.random.normal((size, size)).astype(mx.bfloat16)
    mx.eval(a, b)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times[1:])


def _nbytes(module: Any) -> int:
    flat: Any = tree_flatten(module.parameters())
    return sum(int(v.nbytes) for _, v in flat)


def step_bytes(model: Any, rows: int) -> dict[str, float]:
    """Bytes one decode step of `rows` rows reads (module docstring), and per token."""
    args = model.args
    experts, picks = args.n_routed_experts, args.num_experts_per_tok
    touched = experts * (1 - (1 - picks / experts) ** rows)  # distinct, uniform routing
    dense = routed = 0.0
    for layer in model.layers:
        switch = _nbytes(layer.ffn.switch_mlp)
        routed += switch * touched / experts
        dense += _nbytes(layer) - switch
    dense += _nbytes(model.model.norm) + _nbytes(model.model.hc_head)
    dense += _nbytes(model.lm_head) + rows * _nbytes(model.model.embed_tokens) / args.vocab_size
    total = dense + routed
    return {"bytes": total, "dense_bytes": dense, "expert_bytes": routed, "per_token": total / rows}


def decode_steps(model: Any, rows: int, context: int, steps: int) -> float:
    """Seconds of one decode step of `rows` rows at about `context` tokens each (synced,
    median; stacked rows as the engine runs a batch)."""
    from graph_nodes import prefilled_rows

    caches = prefilled_rows(model, rows, context, margin=0)
    per_layer: list[Any] = caches[0]
    if rows > 1:
        per_layer = [
            type(caches[0][i]).stack([c[i] for c in caches]) for i in range(len(model.layers))
        ]
        mx.eval([c.state for c in per_layer])
    tokens = mx.array([[(17 * r + 5) % model.args.vocab_size] for r in range(rows)])
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        mx.eval(model(tokens, per_layer), [c.state for c in per_layer])
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def forward_flops(model: Any, context: int) -> float:
    """FLOPs of a prefill of `context` tokens: 2 per weight a token multiplies (its 6
    experts and the dense ones, the lm_head on the last token only), the attention
    over each query's window and entries, and the CSA indexer's scores."""
    args = model.args
    per_token = 0.0
    for layer, kind in zip(model.layers, args.layer_types, strict=True):
        params = 0
        flat: Any = tree_flatten(layer.parameters())
        for name, value in flat:
            count = int(value.size)
            if value.dtype == mx.uint32:
                count *= 32 // (4 if ".switch_mlp." in name else 8)
            elif value.dtype == mx.uint8 or value.ndim < 2:
                continue
            if ".switch_mlp." in name:
                count = count * args.num_experts_per_tok // args.n_routed_experts
            params += count
        per_token += 2 * params
        ratio = args.compress_ratio(kind)
        seen = min(args.sliding_window, context / 2)
        if ratio == 4:
            seen += min(args.index_topk, context / 2 / ratio)
            # the indexer scores every causal entry, with 64 heads of 128
            per_token += 2 * args.index_n_heads * args.index_head_dim * context / 2 / ratio
        elif ratio:
            seen += context / 2 / ratio
        per_token += 4 * args.num_attention_heads * args.head_dim * seen
    head = 2 * args.hidden_size * args.vocab_size
    return float(per_token * context + head)


def predicted_cache_bytes(model: Any, context: int) -> float:
    """The cache of one sequence of `context` tokens, from the layer shapes: per layer
    the window (bfloat16 K=V rows), and per compressor its entries (float32: pooled
    under a float32 softmax) and the raw (kv, gate) rows of its open window or two
    (bfloat16, twice as wide when windows overlap)."""
    args = model.args
    total = 0.0
    for kind in args.layer_types:
        total += 2 * (args.sliding_window - 1) * args.head_dim
        ratio = args.compress_ratio(kind)
        compressors = [(args.head_dim, ratio == 4)] if ratio else []
        if ratio == 4:
            compressors.append((args.index_head_dim, True))
        for dim, overlap in compressors:
            total += 4 * (context // ratio) * dim
            span, width = (2 * ratio, 2 * dim) if overlap else (ratio, dim)
            total += 2 * 2 * span * width
    return total


def prefill(model: Any, context: int, chunk: int) -> dict[str, Any]:
    """tok/s of a prefill of `context` tokens in chunks (queued per layer, as the
    engine does), its peak memory and its cache's bytes."""
    cache = model.make_cache()
    tokens = mx.random.randint(0, model.args.vocab_size, (1, context), key=mx.random.key(3))
    mx.eval(tokens)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    start = time.perf_counter()
    for lo in range(0, context, chunk):
        piece = tokens[:, lo : lo + chunk]
        streams = model.forward_hidden(piece, cache, queue_every=1)
        if lo + chunk >= context:
            streams = model.head_from_streams(streams[:, -1:])
        mx.eval(streams, [c.state for c in cache])
    seconds = time.perf_counter() - start
    cache_bytes = sum(c.nbytes for c in cache)
    return {
        "seconds": seconds,
        "tok_s": context / seconds,
        "peak_memory_gb": mx.get_peak_memory() / GB,
        "peak_over_weights_gb": (mx.get_peak_memory() - before) / GB,
        "cache_gb": cache_bytes / GB,
        "cache_dtype": str(cache[0].window.dtype) if cache[0].window is not None else None,
    }


def graph_nodes(model: Any, context: int) -> dict[str, Any]:
    """Non-view nodes per decode layer by primitive, fused and plain, batch 1."""
    from graph_nodes import per_layer_report

    tuning = default_tuning()
    out = {}
    for name, knobs in (("fused", {}), ("plain", {"compiled_decode_max_rows": 0})):
        out[name] = per_layer_report(model, [1], context, tuning.replace(**knobs))["1"]
    model.tune(tuning)
    return out


def mtp_costs(model: Any, context: int, acceptances: list[float], trials: int) -> dict[str, Any]:
    """The engine's round costs and the oracle bound at each acceptance, by depth."""
    from mlxserve.engine.spec.costs import measure_round_costs
    from mlxserve.engine.spec.mtp import MTPAdapter

    adapter = MTPAdapter(model)
    adapter.tune(default_tuning())
    costs = measure_round_costs(adapter, trials=trials, steps=4, context=context)
    step = costs.plain
    bounds = {
        str(a): {
            str(k): sum(a**j for j in range(k + 1)) * step / costs.parts(k)
            for k in sorted(costs.verify)
        }
        for a in acceptances
    }
    return {
        "plain_step_ms": step * 1e3,
        "verify_in_plain_steps": {str(k): v / step for k, v in costs.verify.items()},
        "draft_in_plain_steps": costs.draft / step,
        "round_in_plain_steps": {str(k): v / step for k, v in costs.rounds.items()},
        "expected_speedup_bound": bounds,
    }


def _timed(name: str, run: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    out = run()
    print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=None, help="routed experts (256)")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--contexts", default="4096,32768,102400", help="prefill lengths")
    parser.add_argument("--decode-context", type=int, default=1024, help="tokens per row")
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps")
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--memory-gb", type=float, default=70.0, help="skip what won't fit")
    parser.add_argument("--copy-mb", type=int, default=2048)
    parser.add_argument("--matmul", type=int, default=8192, help="matmul size of the rate")
    parser.add_argument("--acceptance", default="0.7,0.85")
    parser.add_argument("--skip", default="", help="parts to skip: decode,prefill,nodes,mtp")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a CPU smoke run: 32 routed experts unless --experts, batches 1,4, one "
        "128-token prefill, 32-token rows, small copy and matmul",
    )
    args = parser.parse_args()
    if args.quick:
        args.experts = args.experts or 32
        args.batches, args.contexts, args.decode_context = "1,4", "128", 32
        args.steps, args.copy_mb, args.matmul, args.prefill_chunk = 3, 256, 1024, 512
    experts = args.experts or 256
    skip = set(filter(None, args.skip.split(",")))
    configure_cuda_graphs()
    started = time.perf_counter()
    model = _timed("build", lambda: build(args.layers, experts))
    built_s = time.perf_counter() - started
    bandwidth = _timed("copy", lambda: copy_bandwidth(args.copy_mb))
    result: dict[str, Any] = {
        "benchmark": "real_width",
        "model": {
            "shape": "DeepSeek-V4-Flash, published widths",
            "layers": args.layers,
            "layer_types": model.args.layer_types,
            "mtp_blocks": 1,
            "hidden": model.args.hidden_size,
            "routed_experts": experts,
            "experts_per_token": model.args.num_experts_per_tok,
            "expert_width": model.args.moe_intermediate_size,
            "vocab": model.args.vocab_size,
            "experts_format": EXPERT_MODE[0],
            "fp8_projections_format": DENSE_MODE[0],
            "weights_gb": _nbytes(model) / GB,
            "build_s": built_s,
        },
        "quick": args.quick,
        "device": benchmark_device(),
        "bandwidth_gb_s": bandwidth,
    }
    if "decode" not in skip:
        decode = {}
        for rows in (int(b) for b in args.batches.split(",")):

            def step(rows: int = rows) -> float:
                return decode_steps(model, rows, args.decode_context, args.steps)

            seconds = _timed(f"decode {rows}", step)
            read = step_bytes(model, rows)
            bound = read["bytes"] / (bandwidth * GB)
            decode[str(rows)] = {
                "step_ms": seconds * 1e3,
                "tok_s": rows / seconds,
                **read,
                "bound_ms": bound * 1e3,
                "step_over_bound": seconds / bound,
            }
        result["decode"] = {"context_per_row": args.decode_context, "batches": decode}
    if "prefill" not in skip:
        rate = _timed("matmul", lambda: matmul_rate(args.matmul))
        prefills: dict[str, Any] = {"matmul_flop_s": rate, "chunk": args.prefill_chunk}
        weights = _nbytes(model)
        for context in (int(c) for c in args.contexts.split(",")):
            predicted = predicted_cache_bytes(model, context)
            activations = 40 * args.prefill_chunk * model.args.hidden_size * 4
            # the indexer's float32 scores of a chunk's queries, two copies
            activations += 2 * 4 * model.args.index_n_heads * args.prefill_chunk * context // 4
            if (weights + predicted + activations) / GB > args.memory_gb:
                prefills[str(context)] = {"skipped": f"over --memory-gb {args.memory_gb}"}
                continue

            def fill(context: int = context) -> dict[str, Any]:
                return prefill(model, context, args.prefill_chunk)

            run = _timed(f"prefill {context}", fill)
            flops = forward_flops(model, context)
            run.update(
                flops=flops,
                bound_s=flops / rate,
                share_of_flop_bound=flops / rate / run["seconds"],
                predicted_cache_gb=predicted / GB,
            )
            prefills[str(context)] = run
        result["prefill"] = prefills
    if "nodes" not in skip:
        result["graph_nodes"] = _timed("nodes", lambda: graph_nodes(model, args.decode_context))
    if "mtp" not in skip:
        acceptances = [float(a) for a in args.acceptance.split(",")]
        trials = 1 if args.quick else 5
        result["mtp"] = _timed(
            "mtp", lambda: mtp_costs(model, args.decode_context, acceptances, trials)
        )
    result["wall_s"] = time.perf_counter() - started
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
