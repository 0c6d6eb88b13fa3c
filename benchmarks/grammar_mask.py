"""The cost of a grammar's token mask per token, against a demo decode step; prints JSON.

Three numbers, measured in one run on the same machine:

- ``decode_step_ms``: one plain decode forward of the demo model (median);
- ``mask_ms``: what a constrained request adds per token in `TokenChooser` (median):
  llguidance's bitmask, its unpacking into an MLX bool array, the ``where`` on the
  logits and the grammar reading the chosen token, replayed over real answers;
- ``engine_ratio``: constrained over plain generation time per token through the
  engine, which also pays for decoding alone and unpipelined (`engine.logits`).

``mask_over_step`` is the target ratio (<= 0.10 on the CPU).

Run: python benchmarks/grammar_mask.py [--tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import mlx.core as mx

from mlxserve.engine.build import LoadedModel, adapter_for, grammars_for, materialize
from mlxserve.engine.drive import run_to_completion
from mlxserve.engine.engine import Engine, EngineConfig
from mlxserve.engine.request import GenerationRequest, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
    },
    "required": ["name", "tags", "score"],
}


def decode_step_ms(loaded: LoadedModel, prompt: list[int], steps: int) -> float:
    adapter = loaded.adapter
    state = adapter.new_state(max_rollback=0)
    adapter.prefill(state, prompt[:-1])
    token = mx.array(prompt[-1:])
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        logits = adapter.step(state, token)
        token = mx.argmax(logits, axis=-1).reshape(1)
        mx.eval(token)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times[2:])


def mask_ms(loaded: LoadedModel, grammar_text: str, answers: list[list[int]]) -> float:
    grammars = grammars_for(loaded)
    vocab = grammars.vocab_size
    logits = mx.random.normal((1, vocab))
    mx.eval(logits)
    times = []
    for tokens in answers:
        grammar = grammars.compile(grammar_text)
        for token in tokens:
            started = time.perf_counter()
            masked = mx.where(grammar.mask(), logits, -float("inf"))
            mx.eval(masked)
            grammar.accept(token)
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def engine_ratio(
    loaded: LoadedModel, prompt: tuple[int, ...], grammar_text: str, tokens: int, repeats: int
) -> tuple[float, list[list[int]]]:
    engine = Engine(
        adapter_for(loaded.model, 0),
        EngineConfig(prefix_cache_entries=0),
        grammars=grammars_for(loaded),
    )
    stops = frozenset(loaded.tokenizer.eos_token_ids)
    plain, constrained, answers = [], [], []
    for repeat in range(repeats):
        sampling = SamplingParams(temperature=1.0, seed=repeat)
        done = run_to_completion(
            engine, GenerationRequest(f"p{repeat}", prompt, tokens, sampling, frozenset())
        )
        plain.append((done.total_s - done.ttft_s) / max(len(done.tokens) - 1, 1))
        done = run_to_completion(
            engine,
            GenerationRequest(f"g{repeat}", prompt, tokens, sampling, stops, grammar=grammar_text),
        )
        constrained.append((done.total_s - done.ttft_s) / max(len(done.tokens) - 1, 1))
        answers.append(done.tokens)
    return statistics.median(constrained) / statistics.median(plain), answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from llguidance import LLMatcher

    from mlxserve.models import load

    model, tokenizer = load("demo")
    materialize(model)
    loaded = LoadedModel(model, tokenizer, adapter_for(model, 0), 0)
    prompt = tokenizer.encode("<|user|>Describe a cat as JSON.<|end|><|assistant|>")
    options: Any = {"whitespace_flexible": False}
    grammar_text = LLMatcher.grammar_from_json_schema(SCHEMA, defaults=options)
    ratio, answers = engine_ratio(loaded, tuple(prompt), grammar_text, args.tokens, args.repeats)
    step = decode_step_ms(loaded, prompt, args.tokens)
    mask = mask_ms(loaded, grammar_text, answers)
    result = {
        "device": str(mx.default_device()),
        "vocab_size": grammars_for(loaded).vocab_size,
        "decode_step_ms": round(step, 4),
        "mask_ms": round(mask, 4),
        "mask_over_step": round(mask / step, 4),
        "target_mask_over_step": 0.10,
        "engine_ratio": round(ratio, 4),
        "tokens_per_answer": [len(a) for a in answers],
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
