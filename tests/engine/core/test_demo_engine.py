"""The engine on the built-in demo model: prefix reuse cuts TTFT, output unchanged."""

import time

import pytest

from mlxserve.channel.request import GenerationParams
from mlxserve.engine.core.build import adapter_for, materialize
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.stepper import Engine, EngineConfig
from tests.engine.drive import collect, run

pytestmark = pytest.mark.slow


def test_prefix_reuse_ttft_is_a_small_fraction_of_cold() -> None:
    from mlxserve.models import load

    model, tokenizer = load("demo")
    materialize(model)
    text = "The assert statement is a convenient way to insert debugging assertions. " * 24
    prompt = tuple(tokenizer.encode(text))
    assert len(prompt) > 400

    def fresh_engine() -> Engine:
        return Engine(adapter_for(model, 3), EngineConfig(speculative_depth=3))

    def first_token_time(engine: Engine, request_id: str) -> tuple[float, int]:
        """With max_tokens=1 the request ends at its first token: its time is the TTFT."""
        started = time.perf_counter()
        request = GenerationRequest(request_id, GenerationParams(prompt, 1))
        _, finish = run(engine, request)[request_id]
        return time.perf_counter() - started, finish.usage.cached_tokens

    timing = fresh_engine()
    cold, cold_cached = first_token_time(timing, "cold")
    warm, warm_cached = first_token_time(timing, "warm")
    assert (cold_cached, warm_cached) == (0, len(prompt) - 1)
    # Generous: measured ~0.01-0.05 on 2 CPU cores (the repeat only runs its last token).
    assert warm < 0.5 * cold

    outputs = fresh_engine()
    cold_tokens, _ = run(outputs, GenerationRequest("a", GenerationParams(prompt, 24)))["a"]
    warm_tokens, finish = run(outputs, GenerationRequest("b", GenerationParams(prompt, 24)))["b"]
    assert finish.usage.cached_tokens == len(prompt) - 1
    assert warm_tokens == cold_tokens


def test_demo_requests_in_a_batch_equal_alone() -> None:
    """Four demo requests of different lengths, two joining mid-generation: each gets
    its tokens alone (the batch holds MTP rows; the last one speculates alone again)."""
    from mlxserve.models import load

    model, tokenizer = load("demo")
    materialize(model)
    texts = {
        "a": "Python reference: the for statement.",
        "b": "Explain how iteration works in Python, with an example of a generator.",
        "c": "What does the with statement do?",
        "d": "The assert statement is a convenient way to insert debugging assertions. " * 3,
    }
    prompts = {rid: tuple(tokenizer.encode(text)) for rid, text in texts.items()}
    budget = {"a": 40, "b": 16, "c": 24, "d": 12}
    alone = {}
    for rid, prompt in prompts.items():
        engine = Engine(adapter_for(model, 3), EngineConfig(speculative_depth=3))
        request = GenerationRequest(rid, GenerationParams(prompt, budget[rid]))
        alone[rid] = run(engine, request)[rid][0]

    engine = Engine(adapter_for(model, 3), EngineConfig(speculative_depth=3, prefill_step=16))
    streams = [
        engine.submit(GenerationRequest(r, GenerationParams(prompts[r], budget[r])))
        for r in ("a", "b")
    ]
    biggest = 0
    for _ in range(10):
        engine.run_once()
    streams += [
        engine.submit(GenerationRequest(r, GenerationParams(prompts[r], budget[r])))
        for r in ("c", "d")
    ]
    for _ in range(2000):
        biggest = max([biggest, *(len(b.rows) for b in engine.runner.batches)])
        if not engine.run_once():
            break
    together = {stream.request_id: collect(stream)[0] for stream in streams}
    assert together == alone
    assert biggest >= 3
