"""The engine on the built-in demo model: prefix reuse cuts TTFT, output unchanged."""

import time

import pytest

from mlxserve.engine.build import adapter_for, materialize
from mlxserve.engine.engine import Engine, EngineConfig
from mlxserve.engine.request import GenerationRequest
from tests.engine.drive import run

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
        _, finish = run(engine, GenerationRequest(request_id, prompt, 1))[request_id]
        return time.perf_counter() - started, finish.usage.cached_tokens

    timing = fresh_engine()
    cold, cold_cached = first_token_time(timing, "cold")
    warm, warm_cached = first_token_time(timing, "warm")
    assert (cold_cached, warm_cached) == (0, len(prompt) - 1)
    # Generous: measured ~0.01-0.05 on 2 CPU cores (the repeat only runs its last token).
    assert warm < 0.5 * cold

    outputs = fresh_engine()
    cold_tokens, _ = run(outputs, GenerationRequest("a", prompt, 24))["a"]
    warm_tokens, finish = run(outputs, GenerationRequest("b", prompt, 24))["b"]
    assert finish.usage.cached_tokens == len(prompt) - 1
    assert warm_tokens == cold_tokens
