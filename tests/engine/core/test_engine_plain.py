"""The engine on a plain mlx-lm model: same tokens as mlx-lm, stops, cancellation."""

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx_lm.generate import generate_step

from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.engine.core.request import FinishEvent, GenerationRequest, TokensEvent
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.runner.adapter import PlainAdapter
from tests.engine.drive import run

PROMPT = tuple(range(3, 40))


def reference_greedy(model: Module, prompt: tuple[int, ...], n: int) -> list[int]:
    tokens = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        tokens.append(int(token))
    return tokens


def test_greedy_matches_mlx_lm(llama_model: Module) -> None:
    expected = reference_greedy(llama_model, PROMPT, 24)
    engine = Engine(PlainAdapter(llama_model), EngineConfig(prefill_step=8))
    tokens, finish = run(engine, GenerationRequest("a", GenerationParams(PROMPT, 24)))["a"]
    assert tokens == expected
    assert finish.finish_reason == "length"
    assert finish.usage.completion_tokens == 24 and finish.usage.prompt_tokens == len(PROMPT)


def test_concurrent_requests_interleave_and_match(llama_model: Module) -> None:
    other = tuple(range(50, 60))
    engine = Engine(PlainAdapter(llama_model), EngineConfig(prefill_step=4, max_running=4))
    results = run(
        engine,
        GenerationRequest("a", GenerationParams(PROMPT, 12)),
        GenerationRequest("b", GenerationParams(other, 12)),
    )
    assert results["a"][0] == reference_greedy(llama_model, PROMPT, 12)
    assert results["b"][0] == reference_greedy(llama_model, other, 12)


def test_stop_token_ends_with_stop(llama_model: Module) -> None:
    expected = reference_greedy(llama_model, PROMPT, 24)
    stop = expected[5]
    engine = Engine(PlainAdapter(llama_model), EngineConfig())
    request = GenerationRequest("a", GenerationParams(PROMPT, 24, stop_token_ids=(stop,)))
    tokens, finish = run(engine, request)["a"]
    assert tokens == expected[: expected.index(stop)]
    assert finish.finish_reason == "stop"


def test_seed_reproduces_sampling(llama_model: Module) -> None:
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    engine = Engine(PlainAdapter(llama_model), EngineConfig(prefix_cache_entries=0))
    first = run(engine, GenerationRequest("a", GenerationParams(PROMPT, 16, sampling)))["a"][0]
    second = run(engine, GenerationRequest("b", GenerationParams(PROMPT, 16, sampling)))["b"][0]
    other = run(
        engine, GenerationRequest("c", GenerationParams(PROMPT, 16, SamplingParams(1.0, 0.9, 8)))
    )["c"][0]
    assert first == second
    assert first != other


def test_cancel_between_steps(llama_model: Module) -> None:
    engine = Engine(PlainAdapter(llama_model), EngineConfig())
    stream = engine.submit(GenerationRequest("a", GenerationParams(PROMPT, 1000)))
    for _ in range(5):
        engine.run_once()
    engine.cancel("a")
    engine.run_once()
    events = []
    while not events or not isinstance(events[-1], FinishEvent):
        events.append(stream.get(timeout=1))
    finish = events[-1]
    assert isinstance(finish, FinishEvent) and finish.finish_reason == "cancelled"
    assert finish.usage.completion_tokens < 10
    assert engine.scheduler.idle


def test_prefix_cache_reuse_gives_identical_output(llama_model: Module) -> None:
    engine = Engine(PlainAdapter(llama_model), EngineConfig(prefill_step=8))
    cold, cold_finish = run(engine, GenerationRequest("a", GenerationParams(PROMPT, 10)))["a"]
    warm, warm_finish = run(engine, GenerationRequest("b", GenerationParams(PROMPT, 10)))["b"]
    longer = (*PROMPT, 5, 6, 7)
    extended, ext_finish = run(engine, GenerationRequest("c", GenerationParams(longer, 10)))["c"]
    assert warm == cold and cold_finish.usage.cached_tokens == 0
    assert warm_finish.usage.cached_tokens == len(PROMPT) - 1
    # The kept final state (prompt and answer) shares the whole prompt with
    # ``longer``: trimmed to it, one position more than the prompt's own entry.
    assert ext_finish.usage.cached_tokens == len(PROMPT)
    assert extended == reference_greedy(llama_model, longer, 10)


def test_the_final_state_is_kept_after_the_finish_goes_out(llama_model: Module) -> None:
    """A finished request's final state (prompt and reply) is stored for reuse at the
    engine's next turn, not inside the step that finished it: its finish is not held
    up by the store, and the next request (a conversation's next turn) still hits it."""
    engine = Engine(PlainAdapter(llama_model), EngineConfig(prefill_step=8))
    stream = engine.submit(GenerationRequest("a", GenerationParams(PROMPT, 6)))
    assert engine.prefix_cache is not None
    events: list[object] = []
    for _ in range(40):  # the prompt's steps, then one per token
        engine.run_once()
        events += stream.ready()
        if events and isinstance(events[-1], FinishEvent):
            break
    reply = [t for e in events if isinstance(e, TokensEvent) for t in e.token_ids]
    assert len(reply) == 6
    assert len(engine.prefix_cache) == 1  # the prompt's own, stored while it prefilled
    assert not engine.run_once()  # nothing to run: the turn stores what finished
    assert len(engine.prefix_cache) == 2
    turn = (*PROMPT, *reply, 9, 10)
    _, finish = run(engine, GenerationRequest("b", GenerationParams(turn, 4)))["b"]
    assert finish.usage.cached_tokens == len(PROMPT) + len(reply) - 1


def test_a_shared_system_prompt_is_prefilled_once(llama_model: Module) -> None:
    """Requests that share a long start and differ after it (one system prompt, other
    questions) reuse that start from the prefix cache, trimmed, and answer as from
    scratch."""
    engine = Engine(PlainAdapter(llama_model), EngineConfig(prefill_step=16))
    system = tuple((5 * i) % 60 + 2 for i in range(48))
    questions = [(*system, 9, 8, 7, 6), (*system, 31, 32, 33), (*system, 9, 8, 40)]
    for i, prompt in enumerate(questions):
        rid = f"q{i}"
        tokens, finish = run(engine, GenerationRequest(rid, GenerationParams(prompt, 8)))[rid]
        assert tokens == reference_greedy(llama_model, prompt, 8)
        if i == 0:
            assert finish.usage.cached_tokens == 0
        elif i == 1:
            assert finish.usage.cached_tokens == len(system)
        else:  # the first question's start is longer: 9, 8 shared too
            assert finish.usage.cached_tokens == len(system) + 2
