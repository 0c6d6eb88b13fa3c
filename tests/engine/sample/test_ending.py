"""A request's ends in sight, on the demo's engine: the thinking budget and the closing.

At the thinking budget the reasoning's end marker is forced and the answer follows;
near ``max_tokens`` the tokens that finish a grammar are reserved, so a forced tool
call or a JSON answer parses however the budget falls, and an integer the model
would write on forever (its digits pushed by ``logit_bias``) is closed in time.
Each answer is the same at depth 0 and in speculative rounds (depth 3), greedy and
seeded (`mlxserve.engine.sample.ending`).
"""

import json
from collections.abc import Iterator
from typing import Any

import pytest
from llguidance import LLMatcher

from mlxserve.channel.request import GenerationParams, Reasoning, SamplingParams
from mlxserve.chat.call_grammar import COMPACT_JSON, tool_grammar
from mlxserve.chat.request import Function
from mlxserve.engine.core.build import materialize
from mlxserve.engine.core.request import FinishEvent, GenerationRequest
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.sample.grammar import Grammars
from mlxserve.engine.spec.mtp import MTPAdapter
from tests.engine.drive import run

pytestmark = pytest.mark.slow

WEATHER = Function(
    "get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
        "additionalProperties": False,
    },
)
SAMPLINGS = (SamplingParams(), SamplingParams(temperature=1.0, seed=2))
THINK_END = "</think>"


@pytest.fixture(scope="module")
def demo() -> Iterator[tuple[Any, Any, Grammars]]:
    from mlxserve.models import load

    model, tokenizer = load("demo")
    materialize(model)
    yield model, tokenizer, Grammars(tokenizer, int(model.args.vocab_size))


def at_depths(
    demo: tuple[Any, Any, Grammars], params: GenerationParams
) -> tuple[list[int], FinishEvent]:
    """The answer at depth 0, which depth 3 must repeat exactly."""
    model, _, grammars = demo
    answers = []
    for depth in (0, 3):
        config = EngineConfig(prefill_step=64, prefix_cache_entries=0, speculative_depth=depth)
        engine = Engine(MTPAdapter(model), config, grammars=grammars)
        answers.append(run(engine, GenerationRequest("r", params))["r"])
    (tokens, finish), (again, _) = answers
    assert again == tokens
    return tokens, finish


def ask(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(f"<|user|>{text}<|end|><|assistant|>"))


def test_a_forced_call_parses_however_max_tokens_falls(demo: tuple[Any, Any, Grammars]) -> None:
    _, tokenizer, _ = demo
    grammar = tool_grammar("json_tools", [WEATHER], parallel=False)
    stops = tuple(tokenizer.eos_token_ids)
    for limit in (43, 70):  # 43: the shortest call, in the demo's tokens
        for sampling in SAMPLINGS:
            params = GenerationParams(
                ask(tokenizer, "Weather in Paris?"), limit, sampling, stops, grammar=grammar
            )
            tokens, finish = at_depths(demo, params)
            text = tokenizer.decode(tokens)
            assert finish.finish_reason == "stop", (limit, text)
            assert text.startswith("<tool_call>") and text.endswith("</tool_call>"), text
            call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
            assert call["name"] == "get_weather" and isinstance(call["arguments"]["city"], str)


def test_an_integer_pushed_on_is_closed_in_time(demo: tuple[Any, Any, Grammars]) -> None:
    _, tokenizer, _ = demo
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    options: Any = dict(COMPACT_JSON)
    grammar = LLMatcher.grammar_from_json_schema(
        {**schema, "additionalProperties": False}, defaults=options
    )
    digits = [tokenizer.encode(str(d))[0] for d in range(1, 10)]
    sampling = SamplingParams(logit_bias=tuple((d, 40.0) for d in digits))
    params = GenerationParams(
        ask(tokenizer, "A number"), 30, sampling, tuple(tokenizer.eos_token_ids), grammar=grammar
    )
    tokens, finish = at_depths(demo, params)
    value = json.loads(tokenizer.decode(tokens))
    assert finish.finish_reason == "stop" and value["n"] > 10**5  # ran on, then closed


def test_the_thinking_budget_forces_the_end_marker(demo: tuple[Any, Any, Grammars]) -> None:
    _, tokenizer, _ = demo
    end = tuple(tokenizer.encode(THINK_END))
    assert len(end) > 1  # text to the demo: the marker is forced token by token
    prompt = ask(tokenizer, "Python reference: for")
    for budget in (1, len(end) + 5):
        for sampling in SAMPLINGS:
            params = GenerationParams(prompt, 24, sampling, reasoning=Reasoning(end, budget))
            tokens, _ = at_depths(demo, params)
            size = len(end)
            through = next(
                i + size for i in range(len(tokens)) if tuple(tokens[i : i + size]) == end
            )
            assert through <= max(budget, len(end)), (budget, tokenizer.decode(tokens))
            assert len(tokens) > through  # the answer follows


def test_a_budgeted_row_in_a_batch_is_the_same_as_alone(
    demo: tuple[Any, Any, Grammars],
) -> None:
    """A thinking budget and a forced call, drafting in one batch with a plain request
    (depth 3): each gets its tokens alone."""
    model, tokenizer, grammars = demo
    end = tuple(tokenizer.encode(THINK_END))
    stops = tuple(tokenizer.eos_token_ids)
    budgeted = GenerationParams(
        ask(tokenizer, "Python reference: for"), 20, reasoning=Reasoning(end, 9)
    )
    grammar = tool_grammar("json_tools", [WEATHER], parallel=False)
    forced = GenerationParams(ask(tokenizer, "Weather?"), 50, SAMPLINGS[1], stops, grammar=grammar)
    plain = GenerationParams(ask(tokenizer, "Python reference: while"), 24)
    config = EngineConfig(prefill_step=64, prefix_cache_entries=0, speculative_depth=3)
    named = {"budgeted": budgeted, "forced": forced, "plain": plain}
    requests = [GenerationRequest(name, params) for name, params in named.items()]
    together = run(Engine(MTPAdapter(model), config, grammars=grammars), *requests)
    for request in requests:
        engine = Engine(MTPAdapter(model), config, grammars=grammars)
        alone = run(engine, request)[request.request_id]
        assert together[request.request_id][0] == alone[0], request.request_id


def test_a_budget_then_the_answers_grammar(demo: tuple[Any, Any, Grammars]) -> None:
    """The reasoning's budget, then a JSON answer that must fit the tokens left."""
    _, tokenizer, _ = demo
    end = tuple(tokenizer.encode(THINK_END))
    options: Any = dict(COMPACT_JSON)
    answer = json.loads(LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options))
    answer["grammars"][0]["name"] = "answer"
    reasoning = f"reasoning[stop={json.dumps(THINK_END)}]: " + r"/(.|\n)*/"
    outer = {"name": "reasoning", "lark_grammar": f"start: reasoning @answer\n{reasoning}\n"}
    grammar = json.dumps({"grammars": [outer, *answer["grammars"]]})
    prompt = ask(tokenizer, "Python reference: for")
    stops = tuple(tokenizer.eos_token_ids)
    for budget, limit in ((12, 40), (None, 20)):  # no budget: max_tokens ends the reasoning
        for sampling in SAMPLINGS:
            params = GenerationParams(
                prompt, limit, sampling, stops, grammar=grammar, reasoning=Reasoning(end, budget)
            )
            tokens, finish = at_depths(demo, params)
            text = tokenizer.decode(tokens)
            assert THINK_END in text and finish.finish_reason == "stop", text
            assert isinstance(json.loads(text.split(THINK_END, 1)[1]), dict)
