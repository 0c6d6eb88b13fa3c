"""Prefill tok/s of a DeepSeek-V4-Flash-shaped MoE: calibrated policy vs the stock path.

One run, on whatever device MLX picks (an NVIDIA GPU under ``mlx[cuda13]``):

1. builds a DeepSeek-V4 model (mlxserve's own class) with V4-Flash's MoE layers:
   hidden 4096, 256 routed experts of 2048, top-6, 4-bit affine experts in groups
   of 32 (as the demo build quantises them), random weights, ``--layers`` deep;
2. calibrates it as ``mlxserve policy calibrate`` does (skip and full at this
   model's expert shape, at each ``--chunk`` and one decode step);
3. plans twice with the shipped rules: with that calibration, and without it
   (today's rules);
4. times the prefill of one ``--prompt``-token prompt at each chunk size with the
   stock layers and with ``full``'s (interleaved rounds, medians; the calibrated
   plan and today's rules each run one of the two), and decodes ``--decode``
   greedy tokens with each to check they are the same.

The JSON says which variant each plan chose and why, tok/s per chunk and variant,
the calibrated plan's speedup over the stock path and over today's rules, and
whether the greedy tokens agree. A variant that raises is recorded and skipped.

    python3 benchmarks/prefill_policy.py                  # V4-Flash shapes (GPU)
    python3 benchmarks/prefill_policy.py --size tiny      # small shapes, for a CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, cast

import mlx.core as mx

from mlxserve.commands.calibrate import calibrate, expert_shapes
from mlxserve.hardware.composition import Cluster
from mlxserve.hardware.probe import benchmark_device, probe_local
from mlxserve.kernels.apply import swap_switch_layers
from mlxserve.kernels.moe import MoeVariant
from mlxserve.kernels.tiles import forget_tiles
from mlxserve.models.deepseek_v4 import Model, ModelArgs
from mlxserve.policy.evaluate import evaluate
from mlxserve.policy.rules import load_rules

FLASH = {
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
}
"""DeepSeek-V4-Flash's MoE; attention and the rest keep ``ModelArgs``' (V4) defaults."""

TINY = {
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "num_attention_heads": 4,
    "head_dim": 64,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 64,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 64,
    "hc_mult": 2,
}
"""The same structure at sizes a CPU runs in seconds."""

GROUP_SIZE, BITS = 32, 4
STOCK: MoeVariant = "skip"


def build_model(size: str, layers: int, vocab: int, dtype: mx.Dtype, seed: int) -> Model:
    """Random weights in ``dtype``, experts quantised layer by layer (bounded memory)."""
    from mlx.nn.layers.quantized import quantize
    from mlx_lm.models.switch_layers import SwitchLinear

    params: dict[str, Any] = {
        **(FLASH if size == "flash" else TINY),
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "mlp_layer_types": ["moe"] * layers,
        "num_nextn_predict_layers": 0,
    }
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(params))
    model.set_dtype(dtype)
    for layer in model.layers:
        quantize(
            layer,
            GROUP_SIZE,
            BITS,
            class_predicate=lambda _, module: isinstance(module, SwitchLinear),
        )
        mx.eval(layer.parameters())  # type: ignore[no-untyped-call]
    mx.eval(model.parameters())  # type: ignore[no-untyped-call]
    return model


def clock() -> tuple[str, Any]:
    """Wall time on a GPU; on a CPU device this process's CPU time, which other
    processes on the machine do not inflate (MLX computes in this process)."""
    if mx.default_device() == mx.cpu:
        return "process", time.process_time
    return "wall", time.perf_counter


def prefill(model: Model, prompt: mx.array, chunk: int) -> float:
    """Seconds to prefill ``prompt`` ([1, P]) from an empty cache in ``chunk``-token steps."""
    cache = model.make_cache()
    forget_tiles()
    now = clock()[1]
    began = now()
    for start in range(0, prompt.shape[1], chunk):
        streams = model.forward_hidden(prompt[:, start : start + chunk], cache)
        mx.eval(streams, [c.state for c in cache])
    return float(now() - began)


def greedy(model: Model, prompt: mx.array, chunk: int, count: int) -> list[int]:
    """Prefill, then ``count`` greedy tokens."""
    cache = model.make_cache()
    forget_tiles()
    logits = None
    for start in range(0, prompt.shape[1], chunk):
        logits = model(prompt[:, start : start + chunk], cache)
    assert logits is not None
    tokens: list[int] = []
    for _ in range(count):
        token = mx.argmax(logits[0, -1].astype(mx.float32))
        tokens.append(cast(int, token.item()))
        logits = model(token.reshape(1, 1), cache)
    return tokens


def error_text(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=["flash", "tiny"], default="flash")
    parser.add_argument("--layers", type=int, default=2, help="MoE layers (default 2)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=4096, help="prompt tokens (default 4096)")
    parser.add_argument(
        "--chunk", type=int, action="append", help="prefill chunk (default: 512 and 2048)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--decode", type=int, default=16, help="greedy tokens compared")
    parser.add_argument("--calibration-budget", type=float, default=60.0)
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default="bfloat16",
        help="weights and activations (float32 on a CPU: its bfloat16 matmuls are slow)",
    )
    args = parser.parse_args(argv)
    chunks = sorted(set(args.chunk or [512, 2048]))
    began = time.perf_counter()

    model = build_model(args.size, args.layers, args.vocab, getattr(mx, args.dtype), seed=0)
    built_s = time.perf_counter() - began
    shapes, _ = expert_shapes(model, {"num_experts_per_tok": model.args.num_experts_per_tok}, "")
    profile = probe_local()
    record = calibrate(
        shapes,
        chunks,
        decode_tokens=8,
        device={
            "device_type": profile.device_type,
            "chip": profile.chip,
            "mlx_version": profile.mlx_version,
        },
        model=f"v4-{args.size}-{args.layers}-layers",
        dtype_name=args.dtype,
        repeats=args.repeats,
        budget_s=args.calibration_budget,
    )
    calibrated_s = time.perf_counter() - began - built_s
    verdict = record.verdict()
    cluster = Cluster(ranks=[profile], backend="none")
    rules = load_rules()
    with_calibration = evaluate(cluster, rules, [], [verdict] if verdict else [])
    rules_only = evaluate(cluster, rules, [], [])
    chosen = {
        "calibrated": with_calibration.ranks[0].decisions["nax_moe"],
        "rules": rules_only.ranks[0].decisions["nax_moe"],
    }
    # skip and off are the same stock layers: each layer class is timed once, and
    # both always are, so the JSON shows what calibration chose against.
    layers_of = {k: "full" if d.value == "full" else STOCK for k, d in chosen.items()}
    layers_of["stock"] = STOCK
    distinct: list[MoeVariant] = [STOCK, "full"]

    prompt = mx.random.randint(0, args.vocab, (1, args.prompt), key=mx.random.key(1))
    failures: list[dict[str, Any]] = []
    per_chunk = []
    for chunk in chunks:
        times: dict[MoeVariant, list[float]] = {v: [] for v in distinct}
        for round_ in range(args.repeats + 1):  # round 0 warms up
            for variant in list(times):
                swap_switch_layers(model, variant)
                try:
                    seconds = prefill(model, prompt, chunk)
                except Exception as exc:  # a variant that fails is a result
                    failures.append({"variant": variant, "chunk": chunk, "error": error_text(exc)})
                    del times[variant]
                    continue
                if round_:
                    times[variant].append(seconds)
        tok_s = {v: args.prompt / statistics.median(t) for v, t in times.items() if t}
        row: dict[str, Any] = {
            "chunk": chunk,
            "tok_s": {v: round(r, 1) for v, r in tok_s.items()},
        }
        calibrated, stock, today = (
            tok_s.get(layers_of[k]) for k in ("calibrated", "stock", "rules")
        )
        if calibrated and stock:
            row["calibrated_over_stock"] = round(calibrated / stock, 3)
        if calibrated and today:
            row["calibrated_over_rules"] = round(calibrated / today, 3)
        per_chunk.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    tokens: dict[str, list[int]] = {}
    for variant in distinct:
        swap_switch_layers(model, variant)
        try:
            tokens[variant] = greedy(model, prompt, chunks[0], args.decode)
        except Exception as exc:
            failures.append({"variant": variant, "greedy": True, "error": error_text(exc)})
    swap_switch_layers(model, STOCK)
    same_tokens = len({tuple(t) for t in tokens.values()}) == 1 and len(tokens) == len(distinct)
    document = {
        "device": benchmark_device(),
        "model": {
            "size": args.size,
            "layers": args.layers,
            "expert_shapes": [vars(s) for s in shapes],
            "bits": BITS,
            "group_size": GROUP_SIZE,
            "dtype": args.dtype,
        },
        "prompt_tokens": args.prompt,
        "clock": clock()[0],
        "chunks": chunks,
        "repeats": args.repeats,
        "calibration": {
            "verdict": None if verdict is None else verdict.model_dump(),
            "record": record.model_dump(),
        },
        "decisions": {
            k: {"nax_moe": d.value, "rule": d.rule, "reason": d.reason, "layers": layers_of[k]}
            for k, d in chosen.items()
        },
        "prefill": per_chunk,
        # Within 5% (timing noise) of the faster layers at every chunk.
        "calibrated_not_slower_than_rules": all(
            row.get("calibrated_over_rules", 0.0) >= 0.95 for row in per_chunk
        ),
        "calibrated_is_fastest_measured": all(
            row["tok_s"].get(layers_of["calibrated"], 0.0) >= 0.95 * max(row["tok_s"].values())
            for row in per_chunk
            if row["tok_s"]
        ),
        "greedy_tokens": {v: t for v, t in tokens.items()},
        "same_greedy_tokens": same_tokens,
        "failures": failures,
        "seconds": {
            "build": round(built_s, 1),
            "calibrate": round(calibrated_s, 1),
            "total": round(time.perf_counter() - began, 1),
        },
    }
    print(json.dumps(document, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
