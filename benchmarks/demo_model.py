"""Benchmark the built-in demo model; prints one JSON object.

* prefill and decode tokens/s of the (expert-quantised) demo with a plain greedy loop;
* MTP acceptance per depth 1..5: chained greedy drafts vs the main model's greedy
  continuation on held-out prompts (plus the mean accepted prefix per draft step);
* overhead check: our forward time over ``mlx_lm``'s ``deepseek_v41`` forward for
  random float32 models of the demo's size (same layer mix where v41 has it), both
  timed in this run. A sanity check, not a target: the architectures differ.

Run: ``python benchmarks/demo_model.py`` (on x86 CPUs, preload OpenBLAS as for
training). The runtime is bounded by fixed, small amounts of work (well under 2 min).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map

from mlxserve.models.deepseek_v4 import Model, ModelArgs
from mlxserve.models.demo.build import build_demo_model
from mlxserve.models.demo.spec import MODEL_CONFIG
from mlxserve.models.loader import load
from training.demo.corpus import split
from training.demo.evaluate import (
    Acceptance,
    chained_acceptance,
    encode,
    eval_samples,
    greedy_continue,
    heldout_distinct_ngrams,
    prompt_text,
)

PREFILL_TOKENS = 256
DECODE_TOKENS = 64
DEPTH = 5
PROMPTS = 6
NEW_TOKENS = 32


def best_of(fn: Callable[[], Any], repeats: int = 3) -> float:
    """Fastest wall time of ``repeats`` runs (after one warm-up)."""
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def decode_seconds(model: Any, prompt: mx.array, steps: int) -> float:
    cache = model.make_cache()
    token = mx.argmax(model(prompt, cache)[:, -1:], axis=-1)
    mx.eval(token)
    start = time.perf_counter()
    for _ in range(steps):
        token = mx.argmax(model(token, cache)[:, -1:], axis=-1)
        mx.eval(token)
    return time.perf_counter() - start


def v41_model() -> Any:
    """mlx-lm's deepseek_v41 at the demo's dimensions (its own kv per compressed layer)."""
    from mlx_lm.models import deepseek_v41

    ratios = {"sliding_attention": 0, "compressed_sparse_attention": 4}
    ratios["heavily_compressed_attention"] = 16
    layer_ratios = tuple(ratios[t] for t in MODEL_CONFIG["layer_types"])
    args = deepseek_v41.ModelArgs(
        vocab_size=MODEL_CONFIG["vocab_size"],
        hidden_size=MODEL_CONFIG["hidden_size"],
        num_hidden_layers=MODEL_CONFIG["num_hidden_layers"],
        num_attention_heads=MODEL_CONFIG["num_attention_heads"],
        head_dim=MODEL_CONFIG["head_dim"],
        q_lora_rank=MODEL_CONFIG["q_lora_rank"],
        qk_rope_head_dim=8,
        o_groups=MODEL_CONFIG["o_groups"],
        o_lora_rank=MODEL_CONFIG["o_lora_rank"],
        moe_intermediate_size=MODEL_CONFIG["moe_intermediate_size"],
        n_routed_experts=MODEL_CONFIG["n_routed_experts"],
        num_experts_per_tok=MODEL_CONFIG["num_experts_per_tok"],
        rms_norm_eps=1e-6,
        sliding_window=MODEL_CONFIG["sliding_window"],
        compress_ratios=layer_ratios,
        kv_source_layer_ids=tuple(i for i, r in enumerate(layer_ratios) if r),
        index_source_layer_ids=tuple(i for i, r in enumerate(layer_ratios) if r == 4),
        index_n_heads=MODEL_CONFIG["index_n_heads"],
        index_head_dim=MODEL_CONFIG["index_head_dim"],
        index_topk=MODEL_CONFIG["index_topk"],
        hc_mult=MODEL_CONFIG["hc_mult"],
    )
    return _randomised(deepseek_v41.Model(args))


def _randomised(model: Any) -> Any:
    mx.random.seed(0)
    model.update(
        tree_map(
            lambda p: mx.random.normal(p.shape) * 0.02 if p.dtype == mx.float32 else p,
            model.parameters(),
        )
    )
    mx.eval(model.parameters())
    return model


def forward_times(model: Any, prompt: mx.array) -> dict[str, float]:
    prefill = best_of(lambda: model(prompt, model.make_cache()))
    decode = decode_seconds(model, prompt, 16) / 16
    return {"prefill_s": prefill, "decode_step_s": decode}


def main() -> None:
    started = time.perf_counter()
    model, tokenizer = load(build_demo_model(progress=False))
    heldout = split()[1]
    text = "".join(s.render() for s in heldout[:20])
    ids = encode(tokenizer, text)[:PREFILL_TOKENS]
    prompt = mx.array([ids])

    prefill = best_of(lambda: model(prompt, model.make_cache()))
    decode = decode_seconds(model, prompt[:, :32], DECODE_TOKENS)

    acceptance = Acceptance([0] * DEPTH, [0] * DEPTH)
    for sample in eval_samples(heldout, PROMPTS):
        p = encode(tokenizer, prompt_text(sample))
        new = greedy_continue(model, p, NEW_TOKENS, tokenizer.eos_token_id)
        acceptance.merge(chained_acceptance(model, p + new, len(p), DEPTH))

    ours = forward_times(_randomised(Model(ModelArgs.from_dict(MODEL_CONFIG))), prompt)
    try:
        theirs: dict[str, float] | None = forward_times(v41_model(), prompt)
    except Exception as error:  # pragma: no cover - depends on the mlx-lm version
        theirs, v41_error = None, repr(error)
    else:
        v41_error = None

    report: dict[str, Any] = {
        "model": "demo (4-bit experts, group 32)",
        "prefill_tokens": len(ids),
        "prefill_tok_per_s": round(len(ids) / prefill, 1),
        "decode_tok_per_s": round(DECODE_TOKENS / decode, 1),
        "mtp_acceptance_per_depth": [round(r, 3) for r in acceptance.rates],
        "mtp_trials_per_depth": acceptance.trials,
        "mtp_mean_accepted_per_step": round(acceptance.accepted_tokens / acceptance.steps, 3),
        "heldout_prompts": PROMPTS,
        "heldout_distinct_4grams": round(
            heldout_distinct_ngrams(model, tokenizer, eval_samples(heldout, PROMPTS)), 3
        ),
        "ours_vs_deepseek_v41": None,
    }
    if theirs is not None:
        report["ours_vs_deepseek_v41"] = {
            "prefill_time_ratio": round(ours["prefill_s"] / theirs["prefill_s"], 2),
            "decode_step_time_ratio": round(ours["decode_step_s"] / theirs["decode_step_s"], 2),
            "ours": ours,
            "deepseek_v41": theirs,
            "note": "random float32 models of the demo's size; both timed in this run",
        }
    else:
        report["ours_vs_deepseek_v41_error"] = v41_error
    report["benchmark_seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
