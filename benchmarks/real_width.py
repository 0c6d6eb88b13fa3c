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
- `decode`: at each batch of `--batches`, the step time against the weight-read
  bound, synced (each step alone) and pipelined (as the engine decodes: the next
  step queued before the current token is read back, `decode_steps`); the bound:
  the bytes one step reads (every dense weight, the lm_head, and per layer the
  distinct experts the batch's 6 picks each touch, expected under uniform routing)
  over the measured bandwidth;
- `prefill`: at each context of `--contexts` (skipped where the weights, the cache
  and the working set would not fit `--memory-gb`), tok/s against a FLOP bound (the
  layers' FLOPs over a measured bf16 matmul rate on this device; no head, as the
  engine's prefill), then the first decode step, and the peak memory of the two
  against what the docs predict a sequence peaks at (`memory.sequence_peak_bytes`:
  the weights, the cache the layer shapes give and a prefill chunk's bounded working
  set: `peak_over_predicted`, target within 10 %), the prefill's working set (its
  peak above what was held at the start) and the cache's bytes. `--seeded` times each
  context's last chunk alone over caches seeded as the earlier chunks leave them
  (the largest working set, without the prefill before it: 100K on a CPU);
  `--compare-dense` also runs each context with a prefill chunk's attention as one
  masked call and its index scores all at once (the code before blocked prefill
  attention), in the same process; `--moe full` runs the routed experts in
  expert-aligned 64-row tiles;
- `graph_nodes`: non-view nodes per decode layer by primitive, fused and plain
  (`graph_nodes.decode_layer_counts`; on a CPU the fast ops decompose, see there);
- `mtp`: the engine's own round costs (`measure_round_costs`) and, at oracle
  acceptances 0.7 and 0.85, the expected tokens per round over the round's cost
  (the bound `mtp_cost.py` checks real rounds against), in plain steps.

Run (GPU):  python benchmarks/real_width.py --layers 8
Prefill against the code before blocked attention (GPU):
    python benchmarks/real_width.py --layers 8 --skip decode,nodes,mtp \
        --contexts 4096,32768,102400 --compare-dense
CPU, short: python benchmarks/real_width.py --layers 1 --quick
CPU, 100K: python benchmarks/real_width.py --layer-types csa --experts 8 --seeded \
    --contexts 102400 --prefill-chunk 256 --skip decode,nodes,mtp --memory-gb 20
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
import numpy as np
from mlx.nn.layers.quantized import quantize
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import SwitchLinear

from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device
from mlxserve.hardware.tuning import default_tuning
from mlxserve.models.deepseek_v4.memory import cache_bytes, sequence_peak_bytes

#: Routed experts: MXFP4, one e8m0 scale per 32 inputs (as the checkpoint ships them).
EXPERT_MODE = ("mxfp4", 32, 4)
#: The projections the checkpoint ships in FP8: MXFP8 as mlxserve loads them.
DENSE_MODE = ("mxfp8", 32, 8)
#: Parameters the reference keeps in float32.
FLOAT32 = ("hc_", "attn_sink", "gate.bias", "ape", ".fn", ".base", ".scale")
GB = 1e9


#: `--layer-types`' short names.
LAYER_KINDS = {
    "csa": "compressed_sparse_attention",
    "hca": "heavily_compressed_attention",
    "sliding": "sliding_attention",
}


def flash_args(layers: int, experts: int, layer_types: list[str] | None = None) -> Any:
    """V4-Flash's published arguments at `layers` layers (and `experts` routed experts);
    `layer_types` (short names, one per layer) in place of the published pattern."""
    from mlxserve.models.deepseek_v4 import ModelArgs

    types = None if layer_types is None else [LAYER_KINDS[t] for t in layer_types]
    return ModelArgs(num_hidden_layers=layers, n_routed_experts=experts, layer_types=types)


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


def build(
    layers: int,
    experts: int = 256,
    seed: int = 0,
    layer_types: list[str] | None = None,
    norm_dtype: str = "float32",
) -> Any:
    """The model (module docstring), evaluated; its RMSNorm weights in ``norm_dtype``."""
    from mtp_cost import FP8_PROJECTIONS  # beside this file

    from mlxserve.engine.core.build import materialize
    from mlxserve.models.deepseek_v4 import Model
    from mlxserve.models.deepseek_v4.model import MTPBlock

    args = flash_args(layers, experts, layer_types)
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
            if name.endswith("norm.weight") and norm_dtype == "bfloat16":
                new = new.astype(mx.bfloat16)
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


def decode_steps(model: Any, rows: int, context: int, steps: int) -> tuple[float, float]:
    """Seconds of one decode step of `rows` rows at about `context` tokens each, two
    ways (stacked rows as the engine runs a batch): synced (built, run and waited for
    alone, median), and pipelined as the engine decodes: each step built from the
    previous step's lazy greedy tokens and queued before those are read back, so the
    host builds step n + 1 while the device runs step n (mean over `steps`)."""
    from graph_nodes import prefilled_rows
    from pipelined import pipelined_steps

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

    def greedy(previous: mx.array) -> mx.array:
        following = mx.argmax(model(previous, per_layer)[:, -1], axis=-1)[:, None]
        mx.async_eval(following, [c.state for c in per_layer])  # type: ignore[no-untyped-call]
        return following

    _, read = pipelined_steps(greedy, tokens, 2)  # the greedy graph compiled
    pipelined, _ = pipelined_steps(greedy, mx.array(read[-1]), steps)
    return statistics.median(times[1:]), pipelined


def _weight_flops(layer: Any, args: Any, path: str = ".") -> float:
    """2 per weight one token multiplies in ``layer`` (its picked experts' share);
    ``path``, the module's place in a decoder layer (``".ffn.switch_mlp."``), lets a
    part of a layer be counted alone."""
    params = 0
    flat: Any = tree_flatten(layer.parameters())
    for bare, value in flat:
        name = path + bare
        count = int(value.size)
        if value.dtype == mx.uint32:
            count *= 32 // (4 if ".switch_mlp." in name else 8)
        elif value.dtype == mx.uint8 or value.ndim < 2:
            continue
        if ".switch_mlp." in name:
            count = count * args.num_experts_per_tok // args.n_routed_experts
        params += count
    return 2.0 * params


def attention_flops(args: Any, kind: str, first: int, last: int) -> float:
    """FLOPs of the attention of the queries at positions ``first .. last - 1`` in one
    layer of ``kind``: 4 x heads x head_dim per key a query sees (its window, then its
    picks or every closed entry), and in CSA layers 2 x index heads x index dim per
    closed entry the indexer scores (once there are more than it picks)."""
    t = np.arange(first, last, dtype=np.float64)
    seen = np.minimum(args.sliding_window, t + 1)
    ratio = args.compress_ratio(kind)
    scored = np.zeros_like(t)
    if ratio:
        closed = np.floor((t + 1) / ratio)
        if kind == LAYER_KINDS["csa"]:
            scored = np.where(closed > args.index_topk, closed, 0.0)
            closed = np.minimum(closed, args.index_topk)
        seen = seen + closed
    total = 4.0 * args.num_attention_heads * args.head_dim * seen.sum()
    return float(total + 2.0 * args.index_n_heads * args.index_head_dim * scored.sum())


def chunk_flops(model: Any, first: int, last: int) -> float:
    """FLOPs of the layers' forward of positions ``first .. last - 1`` (a prefill chunk,
    or the whole prefill from 0): every layer's weights for each token (its picked
    experts, the dense ones) and its attention (`attention_flops`). The head is not
    part of a prefill (the engine never evaluates a prefill's logits)."""
    args = model.args
    total = 0.0
    for layer, kind in zip(model.layers, args.layer_types, strict=True):
        total += _weight_flops(layer, args) * (last - first)
        total += attention_flops(args, kind, first, last)
    return total


def activation_itemsize(model: Any) -> int:
    """Bytes of an activation: what the first layer's norm gives the embedding's dtype
    (the streams' dtype: the norms cast back, ``deepseek_v4/norm.py``)."""
    dtype = _block_input(model.layers[0], model.model.embed_tokens.weight.dtype)
    return int(dtype.size)


def last_chunk_start(context: int, chunk: int) -> int:
    """Where the last chunk of a prefill of ``context`` tokens in ``chunk``s starts."""
    return (context - 1) // chunk * chunk


def _block_input(layer: Any, dtype: mx.Dtype) -> mx.Dtype:
    """The dtype a layer's attention gets from residual streams of ``dtype``: its
    norm's output's."""
    width = layer.attn_norm.weight.shape[-1]
    out: mx.Dtype = layer.attn_norm(mx.zeros((1, 1, width), dtype=dtype)).dtype
    return out


def prefill(model: Any, context: int, chunk: int, seeded: bool = False) -> dict[str, Any]:
    """tok/s of a prefill of `context` tokens in chunks (queued per layer, and without
    the head, as the engine runs one), or, `seeded`, of its last chunk alone over
    caches holding the earlier tokens (`prefill_attention.seed_cache`: their shapes,
    random values; the chunk the context makes slowest and largest, without the
    prefill before it); then the first decode step (logits included). The peak memory
    (MLX's) of each, the prefill's working set (its peak above what was held at the
    start: the weights, and a seeded cache) and the cache's bytes."""
    first = last_chunk_start(context, chunk) if seeded else 0
    if seeded:
        from prefill_attention import seed_cache  # beside this file

        rows = model.model.embed_tokens.weight.dtype
        cache = [
            seed_cache(layer.attn, first, mx.random.key(7 + i), _block_input(layer, rows))
            for i, layer in enumerate(model.layers)
        ]
    else:
        cache = model.make_cache()
    length = context - first
    tokens = mx.random.randint(0, model.args.vocab_size, (1, length + 1), key=mx.random.key(3))
    mx.eval(tokens)
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    start = time.perf_counter()
    for lo in range(0, length, chunk):
        streams = model.forward_hidden(tokens[:, lo : min(lo + chunk, length)], cache, 1)
        mx.eval(streams, [c.state for c in cache])
    seconds = time.perf_counter() - start
    del streams
    cache_bytes = sum(c.nbytes for c in cache)
    prefill_peak = mx.get_peak_memory()
    mx.clear_cache()
    mx.reset_peak_memory()
    start = time.perf_counter()
    logits = model(tokens[:, length:], cache)
    mx.eval(logits, [c.state for c in cache])
    step_s = time.perf_counter() - start
    step_peak = mx.get_peak_memory()
    return {
        "logits": logits[0, -1],
        "first_position": first,
        "tokens": length,
        "seconds": seconds,
        "tok_s": length / seconds,
        "prefill_peak_gb": prefill_peak / GB,
        "working_set_gb": (prefill_peak - before) / GB,
        "first_step_s": step_s,
        "first_step_peak_gb": step_peak / GB,
        "peak_memory_gb": max(prefill_peak, step_peak) / GB,
        "cache_gb": cache_bytes / GB,
        "cache_dtype": str(cache[0].window.dtype) if cache[0].window is not None else None,
    }


def working_set_bytes(model: Any, context: int, chunk: int) -> float:
    """About the most a prefill chunk holds beside the weights and the cache with its
    whole scores at once (`--compare-dense`): every query of the chunk against every
    window row and entry (bfloat16, four copies) and the indexer's float32 scores of
    every entry (three), beside the chunk's activations (the blocked prefill's
    prediction is `memory.prefill_working_bytes`)."""
    args = model.args
    total = 40.0 * chunk * args.hidden_size * 4
    keys = chunk + args.sliding_window + context / 4
    total += 4 * 2 * args.num_attention_heads * chunk * keys
    return float(total + 3 * 4 * args.index_n_heads * chunk * context / 4)


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
    parser.add_argument(
        "--seeded",
        action="store_true",
        help="time each context's last prefill chunk alone, over seeded caches",
    )
    parser.add_argument(
        "--compare-dense",
        action="store_true",
        help="also prefill with the masked attention and all index scores at once",
    )
    parser.add_argument("--dense-max-context", type=int, default=32768)
    parser.add_argument(
        "--layer-types", default=None, help="one per layer: csa, hca or sliding (e.g. csa)"
    )
    parser.add_argument(
        "--norm-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="RMSNorm weights: float32 (as the reference keeps them) or bfloat16; "
        "the activations are bfloat16 either way (the norms cast back)",
    )
    parser.add_argument(
        "--moe",
        choices=("stock", "full"),
        default="stock",
        help="routed experts: mlx-lm's call, or the `full` variant's expert-aligned "
        "64-row tiles (mlxserve.kernels.moe)",
    )
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
    types = None
    if args.layer_types:
        types = args.layer_types.split(",")
        unknown = [t for t in types if t not in LAYER_KINDS]
        if unknown:
            parser.error(f"--layer-types: {unknown[0]!r} is not one of {', '.join(LAYER_KINDS)}")
        args.layers = len(types)
    configure_cuda_graphs()
    started = time.perf_counter()
    model = _timed(
        "build", lambda: build(args.layers, experts, layer_types=types, norm_dtype=args.norm_dtype)
    )
    if args.moe == "full":
        from mlxserve.kernels.apply import swap_switch_layers

        swap_switch_layers(model, "full")
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
            "moe_variant": args.moe,
            "norm_dtype": args.norm_dtype,
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

            def step(rows: int = rows) -> tuple[float, float]:
                return decode_steps(model, rows, args.decode_context, args.steps)

            seconds, pipelined = _timed(f"decode {rows}", step)
            read = step_bytes(model, rows)
            bound = read["bytes"] / (bandwidth * GB)
            decode[str(rows)] = {
                "step_ms": seconds * 1e3,
                "tok_s": rows / seconds,
                "pipelined_step_ms": pipelined * 1e3,
                "pipelined_tok_s": rows / pipelined,
                **read,
                "bound_ms": bound * 1e3,
                "step_over_bound": seconds / bound,
                "pipelined_over_bound": pipelined / bound,
            }
        result["decode"] = {"context_per_row": args.decode_context, "batches": decode}
    if "prefill" not in skip:
        from prefill_attention import set_blocked  # beside this file

        rate = _timed("matmul", lambda: matmul_rate(args.matmul))
        weights = _nbytes(model)
        prefills: dict[str, Any] = {
            "matmul_flop_s": rate,
            "chunk": args.prefill_chunk,
            "seeded": args.seeded,
            "weights_gb": weights / GB,
        }
        itemsize = activation_itemsize(model)
        for context in (int(c) for c in args.contexts.split(",")):
            predicted = cache_bytes(model.args, context, itemsize)
            # What the docs predict one sequence peaks at: the weights, its cache and a
            # prefill chunk's working set (`memory.sequence_peak_bytes`).
            peak = sequence_peak_bytes(weights, model.args, context, args.prefill_chunk, itemsize)
            sides = ["blocked"]
            if args.compare_dense and context <= args.dense_max_context:
                sides.append("dense")
            row: dict[str, Any] = {}
            for side in sides:
                dense = side == "dense"
                need = (
                    peak
                    if not dense
                    else weights + predicted + working_set_bytes(model, context, args.prefill_chunk)
                )
                if need / GB > args.memory_gb:
                    row[side] = {"skipped": f"over --memory-gb {args.memory_gb}"}
                    continue
                set_blocked(model, not dense)

                def fill(context: int = context) -> dict[str, Any]:
                    return prefill(model, context, args.prefill_chunk, args.seeded)

                run = _timed(f"prefill {context} {side}", fill)
                set_blocked(model, True)
                flops = chunk_flops(model, run["first_position"], context)
                run.update(
                    flops=flops,
                    bound_s=flops / rate,
                    share_of_flop_bound=flops / rate / run["seconds"],
                    predicted_cache_gb=predicted / GB,
                    predicted_working_set_gb=(peak - weights - predicted) / GB,
                    predicted_gb=peak / GB,
                    peak_over_predicted=run["peak_memory_gb"] * GB / peak,
                )
                row[side] = run
            blocked, dense_run = row.get("blocked", {}), row.get("dense", {})
            if "seconds" in blocked and "seconds" in dense_run:
                row["speedup_over_dense"] = dense_run["seconds"] / blocked["seconds"]
                # The first step's logits after each prefill (the same tokens and seeds).
                ours, theirs = (r["logits"].astype(mx.float32) for r in (blocked, dense_run))
                row["first_logits_max_abs_diff"] = float(mx.abs(ours - theirs).max())
                row["first_logits_abs_max"] = float(mx.abs(theirs).max())
                row["first_token_same"] = bool(mx.argmax(ours) == mx.argmax(theirs))
            for run in (blocked, dense_run):
                run.pop("logits", None)
            prefills[str(context)] = row
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
