"""Continuous batching of plain decoding: one forward for every decoding request.

Requests join the batch when their prompt is done and leave it when they finish or
are cancelled, between any two steps; every one of them gets exactly the tokens it
gets alone (greedy) or with the same seed (sampled).
"""

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx_lm.models.cache import QuantizedKVCache

from mlxserve.engine.adapter import PlainAdapter, PlainState
from mlxserve.engine.engine import Engine, EngineConfig
from mlxserve.engine.request import GenerationRequest, SamplingParams
from mlxserve.engine.step_plan import StepPlan
from tests.engine.drive import run
from tests.engine.test_engine_plain import reference_greedy

PROMPTS = {
    "a": tuple(range(3, 40)),
    "b": tuple(range(50, 60)),
    "c": (7, 8),
    "d": tuple(i % 90 + 1 for i in range(75)),
}


def test_step_batch_equals_single_steps(llama_model: Module) -> None:
    adapter = PlainAdapter(llama_model)
    singles, batched = [], []
    for prompt in PROMPTS.values():
        for states in (singles, batched):
            state = adapter.new_state(0)
            adapter.prefill(state, list(prompt[:-1]))
            states.append(state)
    last = mx.array([prompt[-1] for prompt in PROMPTS.values()])
    for _ in range(3):
        alone = mx.stack([adapter.step(s, last[i : i + 1]) for i, s in enumerate(singles)])
        together = adapter.step_batch(batched, last)
        assert mx.allclose(alone, together, atol=1e-4), mx.abs(alone - together).max()
        last = mx.argmax(alone, axis=-1)
    # Each sequence got its own cache back, at its own length.
    for state, prompt in zip(batched, PROMPTS.values(), strict=True):
        assert isinstance(state, PlainState) and state.offset == len(prompt) + 2


def test_concurrent_greedy_requests_share_decode_steps(llama_model: Module) -> None:
    steps: list[StepPlan] = []
    engine = Engine(
        PlainAdapter(llama_model),
        EngineConfig(prefill_step=16, max_running=4),
        before_step=steps.append,
    )
    requests = [GenerationRequest(rid, prompt, max_tokens=20) for rid, prompt in PROMPTS.items()]
    results = run(engine, *requests)
    for rid, prompt in PROMPTS.items():
        assert results[rid][0] == reference_greedy(llama_model, prompt, 20), rid
    decode_sizes = [len(s.request_ids) for s in steps if s.kind == "decode"]
    assert max(decode_sizes) == 4
    # Batching is what makes the step count small: far fewer than 4 x 20 decode steps.
    assert len(decode_sizes) < 40


def test_requests_join_and_leave_the_batch(llama_model: Module) -> None:
    engine = Engine(PlainAdapter(llama_model), EngineConfig(prefill_step=16, max_running=4))
    short = engine.submit(GenerationRequest("short", PROMPTS["c"], max_tokens=3))
    long = engine.submit(GenerationRequest("long", PROMPTS["a"], max_tokens=30))
    for _ in range(8):
        engine.run_once()
    late = GenerationRequest("late", PROMPTS["b"], max_tokens=10)
    cancelled = GenerationRequest("gone", PROMPTS["d"], max_tokens=30)
    late_stream = engine.submit(late)
    gone_stream = engine.submit(cancelled)
    for _ in range(12):
        engine.run_once()
    engine.cancel("gone")
    for _ in range(500):
        if not engine.run_once():
            break
    collected = {}
    for stream in (short, long, late_stream, gone_stream):
        tokens: list[int] = []
        while True:
            event = stream.get(timeout=1)
            if hasattr(event, "token_ids"):
                tokens.extend(event.token_ids)
            else:
                collected[stream.request_id] = (tokens, event)
                break
    assert collected["short"][0] == reference_greedy(llama_model, PROMPTS["c"], 3)
    assert collected["long"][0] == reference_greedy(llama_model, PROMPTS["a"], 30)
    assert collected["late"][0] == reference_greedy(llama_model, PROMPTS["b"], 10)
    gone_tokens, gone_finish = collected["gone"]
    assert gone_finish.finish_reason == "cancelled"
    assert gone_tokens == reference_greedy(llama_model, PROMPTS["d"], len(gone_tokens))


def test_sampled_requests_are_reproducible_in_a_batch(llama_model: Module) -> None:
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    alone = run(
        Engine(PlainAdapter(llama_model), EngineConfig(max_running=1)),
        GenerationRequest("s", PROMPTS["a"], 16, sampling),
    )["s"][0]
    crowd = run(
        Engine(PlainAdapter(llama_model), EngineConfig(max_running=4)),
        GenerationRequest("s", PROMPTS["a"], 16, sampling),
        GenerationRequest("x", PROMPTS["b"], 16, SamplingParams(1.0, 0.9, 3)),
        GenerationRequest("y", PROMPTS["c"], 16),
    )["s"][0]
    assert crowd == alone


def test_caches_without_merge_decode_one_by_one(llama_model: Module) -> None:
    adapter = PlainAdapter(llama_model)
    quantized = PlainState([QuantizedKVCache() for _ in range(2)])
    assert adapter.can_batch([adapter.new_state(0), adapter.new_state(0)])
    assert not adapter.can_batch([adapter.new_state(0), quantized])
