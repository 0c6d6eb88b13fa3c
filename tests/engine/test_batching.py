"""Continuous batching of plain decoding: one forward for every decoding request.

Requests join the batch when their prompt is done and leave it when they finish or
are cancelled, between any two steps; every one of them gets exactly the tokens it
gets alone (greedy) or with the same seed (sampled).
"""

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx_lm.models.cache import QuantizedKVCache

from mlxserve.engine.adapter import ModelState, PlainAdapter, PlainState
from mlxserve.engine.engine import Engine, EngineConfig
from mlxserve.engine.request import GenerationRequest, SamplingParams
from mlxserve.engine.runner import length_groups
from mlxserve.engine.sampling import KeyStream
from mlxserve.engine.sequence import Sequence
from mlxserve.engine.step_plan import StepPlan
from tests.engine.drive import collect, run
from tests.engine.test_engine_plain import reference_greedy


class CountingAdapter(PlainAdapter):
    """Records the size of every batched forward."""

    def __init__(self, model: Module, fail: bool = False) -> None:
        super().__init__(model)
        self.batches: list[int] = []
        self.fail = fail

    def step_batch(self, states: list[ModelState], tokens: mx.array) -> mx.array:
        self.batches.append(len(states))
        if self.fail:
            raise RuntimeError("injected batch failure")
        return super().step_batch(states, tokens)


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
    adapter = CountingAdapter(llama_model)
    engine = Engine(adapter, EngineConfig(prefill_step=16, max_running=4), before_step=steps.append)
    prompts = {rid: PROMPTS[rid] for rid in ("a", "b", "d")} | {"e": tuple(range(20, 60))}
    requests = [GenerationRequest(rid, prompt, max_tokens=20) for rid, prompt in prompts.items()]
    results = run(engine, *requests)
    for rid, prompt in prompts.items():
        assert results[rid][0] == reference_greedy(llama_model, prompt, 20), rid
    assert max(len(s.request_ids) for s in steps if s.kind == "decode") == 4
    # Real batched forwards happened, with every request in one of them at some step.
    assert max(adapter.batches) >= 3 and sum(adapter.batches) >= 40


def test_requests_join_and_leave_the_batch(llama_model: Module) -> None:
    adapter = CountingAdapter(llama_model)
    engine = Engine(adapter, EngineConfig(prefill_step=16, max_running=4))
    short = engine.submit(GenerationRequest("short", PROMPTS["c"], max_tokens=12))
    long = engine.submit(GenerationRequest("long", PROMPTS["a"], max_tokens=40))
    for _ in range(8):
        engine.run_once()
    late = GenerationRequest("late", tuple(range(30, 62)), max_tokens=10)
    cancelled = GenerationRequest("gone", tuple(range(40, 75)), max_tokens=30)
    late_stream = engine.submit(late)
    gone_stream = engine.submit(cancelled)
    for _ in range(200):
        engine.run_once()
        gone = engine.scheduler.find("gone")
        if gone is not None and len(gone.generated) >= 4:
            break
    assert 3 in adapter.batches  # "gone" decoded inside a batch before leaving it
    engine.cancel("gone")
    for _ in range(500):
        if not engine.run_once():
            break
    collected = {s.request_id: collect(s) for s in (short, long, late_stream, gone_stream)}
    assert collected["short"][0] == reference_greedy(llama_model, PROMPTS["c"], 12)
    assert collected["long"][0] == reference_greedy(llama_model, PROMPTS["a"], 40)
    assert collected["late"][0] == reference_greedy(llama_model, late.prompt_ids, 10)
    gone_tokens, gone_finish = collected["gone"]
    assert gone_finish.finish_reason == "cancelled" and len(gone_tokens) >= 4
    assert gone_tokens == reference_greedy(llama_model, cancelled.prompt_ids, len(gone_tokens))


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


def _sequence(rid: str, offset: int) -> Sequence:
    state = PlainState([])
    sequence = Sequence(GenerationRequest(rid, (1, 2), 8), KeyStream(0), depth=0, state=state)
    sequence.state = type("S", (), {"offset": offset})()  # type: ignore[assignment]
    return sequence


def test_length_groups_bound_the_padding() -> None:
    sequences = [_sequence(str(n), n) for n in (100, 90, 110, 5000, 6, 8)]
    groups = [[int(s.request_id) for s in group] for group in length_groups(sequences)]
    assert groups == [[6, 8], [90, 100, 110], [5000]]


def test_a_failing_batch_falls_back_to_one_by_one(llama_model: Module) -> None:
    adapter = CountingAdapter(llama_model, fail=True)
    engine = Engine(adapter, EngineConfig(prefill_step=16, max_running=4))
    requests = [GenerationRequest(rid, PROMPTS[rid], max_tokens=10) for rid in ("a", "b")]
    results = run(engine, *requests)
    assert adapter.batches  # the batch was tried
    for request in requests:
        tokens, finish = results[request.request_id]
        assert finish.finish_reason == "length"
        assert tokens == reference_greedy(llama_model, request.prompt_ids, 10)
