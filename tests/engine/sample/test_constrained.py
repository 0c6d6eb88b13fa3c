"""Requests with a grammar, penalties, logit_bias or logprobs on the demo model's engine.

They speculate at the engine's depth and decode in batches (`mlxserve.engine.sample.logits`;
exactness against depth 0: test_draft_choice.py); their final states serve
speculative requests through the prefix cache.
"""

import json
from collections.abc import Iterator
from typing import Any

import pytest
from llguidance import LLMatcher

from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.engine.core.build import LoadedModel, adapter_for, grammars_for, materialize
from mlxserve.engine.core.drive import drain
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.stepper import Engine, EngineConfig
from tests.engine.drive import run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo() -> Iterator[tuple[Any, Any]]:
    from mlxserve.models import load

    model, tokenizer = load("demo")
    materialize(model)
    yield model, tokenizer


def engine(demo: tuple[Any, Any]) -> Engine:
    model, tokenizer = demo
    loaded = LoadedModel(model, tokenizer, adapter_for(model, 3), 3)
    config = EngineConfig(speculative_depth=3, prefill_step=64)
    return Engine(loaded.adapter, config, grammars=grammars_for(loaded))


def prompt(demo: tuple[Any, Any], text: str) -> tuple[int, ...]:
    return tuple(demo[1].encode(f"<|user|>{text}<|end|><|assistant|>"))


def test_a_schema_grammar_shapes_the_answer_and_ends_it(demo: tuple[Any, Any]) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["red", "green"]}},
        "required": ["ok", "pick"],
        "additionalProperties": False,
    }
    options: Any = {"whitespace_flexible": False}
    grammar = LLMatcher.grammar_from_json_schema(schema, defaults=options)
    stops = tuple(demo[1].eos_token_ids)
    for seed in (None, 1, 2):
        sampling = SamplingParams(temperature=0 if seed is None else 1.0, seed=seed)
        request = GenerationRequest(
            "g", GenerationParams(prompt(demo, "JSON please"), 64, sampling, stops, grammar=grammar)
        )
        tokens, finish = run(engine(demo), request)["g"]
        assert finish.finish_reason == "stop" and finish.speculative is not None
        value = json.loads(demo[1].decode(tokens))
        assert isinstance(value["ok"], bool) and value["pick"] in ("red", "green")


def test_logprobs_bias_and_seeded_filters(demo: tuple[Any, Any]) -> None:
    ask = prompt(demo, "Python reference: for")
    one = engine(demo)
    plain, _ = run(one, GenerationRequest("p", GenerationParams(ask, 8)))["p"]
    sampling = SamplingParams(logprobs=2)
    stream = one.submit(GenerationRequest("l", GenerationParams(ask, 8, sampling)))
    for _ in range(200):
        if not one.run_once():
            break
    records = [r for event in drain(stream) for r in getattr(event, "logprobs", None) or ()]
    assert [r.token for r in records] == plain  # greedy with logprobs: the same tokens
    assert all(r.top[0] == (r.token, r.logprob) and len(r.top) == 2 for r in records)
    banned = SamplingParams(logit_bias=((plain[0], -100.0),))
    biased, _ = run(one, GenerationRequest("b", GenerationParams(ask, 8, banned)))["b"]
    assert biased[0] != plain[0]
    shaped = SamplingParams(temperature=0.9, seed=5, top_k=4, min_p=0.05, presence_penalty=1.0)
    first, _ = run(one, GenerationRequest("s1", GenerationParams(ask, 12, shaped)))["s1"]
    again, _ = run(engine(demo), GenerationRequest("s2", GenerationParams(ask, 12, shaped)))["s2"]
    assert first == again  # a seed reproduces the answer under every filter


def test_a_speculative_request_reuses_a_constrained_requests_state(
    demo: tuple[Any, Any],
) -> None:
    """A speculative request starting from a constrained request's cached final state
    can reject drafts: the state keeps the engine's rollback margin."""
    one = engine(demo)
    ask = prompt(demo, "Python reference: for")
    tokens, _ = run(
        one, GenerationRequest("c", GenerationParams(ask, 24, SamplingParams(top_k=3)))
    )["c"]
    follow = (*ask, *tokens, *demo[1].encode("<|end|><|user|>more<|end|><|assistant|>"))
    _, finish = run(one, GenerationRequest("s", GenerationParams(follow, 24)))["s"]
    assert finish.finish_reason in ("stop", "length"), finish.error
    assert finish.usage.cached_tokens > len(ask)
    assert finish.speculative and finish.speculative["drafted"] > 0


def test_json_is_closed_before_the_budget_ends(demo: tuple[Any, Any]) -> None:
    """Sampled at temperature 1 the demo writes long strings; near the end of its budget
    the tokens that close the grammar are reserved, so the answer still parses
    (`mlxserve.engine.sample.ending`)."""
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string"},
            "b": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["a", "b"],
    }
    options: Any = {"whitespace_flexible": False}
    grammar = LLMatcher.grammar_from_json_schema(schema, defaults=options)
    one = engine(demo)
    stops = tuple(demo[1].eos_token_ids)
    for seed in range(6):
        request = GenerationRequest(
            f"j{seed}",
            GenerationParams(
                prompt(demo, "Give me JSON"),
                24,
                SamplingParams(temperature=1.0, seed=seed),
                stops,
                grammar=grammar,
            ),
        )
        tokens, _ = run(one, request)[f"j{seed}"]
        value = json.loads(demo[1].decode(tokens))
        assert isinstance(value["a"], str) and isinstance(value["b"], list)
