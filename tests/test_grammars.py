"""Closing paths (`mlxserve.grammars.Closing`): the tokens that finish a grammar from
where an answer is, which the engine reserves before ``max_tokens`` and the front
counts from the start. On the demo's tokenizer; each path must leave the grammar
where it may end, and not wander (a quote inside a string is text, not its end)."""

import json
from pathlib import Path
from typing import Any

import pytest
from llguidance import LLMatcher

from mlxserve.chat.call_grammar import COMPACT_JSON, tool_grammar
from mlxserve.chat.deepseek_v4 import encoding as dsv4
from mlxserve.grammars import Closing, ll_tokenizer
from mlxserve.server.tokenizer import FrontTokenizer
from tests.engine.sample.test_ending import WEATHER

DEMO = Path(__file__).resolve().parents[1] / "mlxserve" / "models" / "demo" / "weights"


@pytest.fixture(scope="module")
def front() -> FrontTokenizer:
    return FrontTokenizer.load(DEMO)


def finish(front: FrontTokenizer, grammar: str, written: str) -> str | None:
    """The text of the path that finishes ``grammar`` after ``written`` (None: none)."""
    ll = ll_tokenizer(front._tokenizer, front.vocab_size)
    matcher = LLMatcher(ll, grammar, log_level=0)
    assert matcher.consume_tokens(front.text_ids(written)), matcher.get_error()
    path = Closing(ll, front.vocab_size).path(matcher)
    if path is not None:
        assert matcher.is_accepting() and not matcher.is_error()
    return None if path is None else front.decode(path)


def schema(value: dict[str, Any]) -> str:
    options: Any = dict(COMPACT_JSON)
    return str(LLMatcher.grammar_from_json_schema(value, defaults=options))


REQUIRED = {
    "type": "object",
    "properties": {"a": {"type": "string"}, "b": {"type": "array", "items": {"type": "string"}}},
    "required": ["a", "b"],
}


@pytest.mark.parametrize(
    ("value", "written", "rest"),
    [
        ({"type": "object"}, "", "{}"),
        (REQUIRED, "", '{"a":"","b":[]}'),
        (REQUIRED, '{"a":"say \\"]} and', '","b":[]}'),  # brackets in a string are text
        (REQUIRED, '{"a":"x","b":["y"', "]}"),
        ({"type": "object", "properties": {"n": {"type": "integer"}}}, '{"n":12345', "}"),
        (
            {"type": "object", "properties": {"x": {"type": "number", "exclusiveMinimum": 0}}},
            '{"x":0.0',
            "01}",  # then not 0 again: the same token again leads nowhere
        ),
        (
            {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a*b$"}}},
            '{"s":"aaa',
            'ab"}',  # then not a again
        ),
        (
            {
                "type": "object",
                "properties": {"o": {"type": "object", "properties": {"p": {"type": "boolean"}}}},
            },
            '{"o":{"p":true',
            "}}",
        ),
    ],
)
def test_a_path_finishes_json(
    front: FrontTokenizer, value: dict[str, Any], written: str, rest: str
) -> None:
    assert finish(front, schema(value), written) == rest


def test_a_path_finishes_forced_calls(front: FrontTokenizer) -> None:
    calls = tool_grammar("json_tools", [WEATHER], parallel=True)
    assert finish(front, calls, '<tool_call>{"name":"get_weather","arguments":{"city":"Pa') == (
        '"}}</tool_call>'
    )
    dsml = tool_grammar("dsml", [WEATHER], parallel=True)
    head = f'{dsv4.TOOL_CALLS_START}\n{dsv4.INVOKE_START} name="get_weather">\n'
    city = f'{dsv4.PARAMETER_START} name="city" string="true">Pa"ris'  # a quote: text here
    assert finish(front, dsml, head + city) == (
        f"{dsv4.PARAMETER_END}\n{dsv4.INVOKE_END}\n{dsv4.TOOL_CALLS_END}"
    )


def test_free_reasoning_has_no_path_but_its_end_marker_gives_one(front: FrontTokenizer) -> None:
    """A reasoning's end is no token a path tries: its end marker comes first (the
    engine and the front put it there), then the answer's path."""
    answer = json.loads(schema({"type": "object"}))
    answer["grammars"][0]["name"] = "answer"
    reasoning = 'reasoning[stop="</think>"]: ' + r"/(.|\n)*/"
    outer = {"name": "reasoning", "lark_grammar": f"start: reasoning @answer\n{reasoning}\n"}
    grammar = json.dumps({"grammars": [outer, *answer["grammars"]]})
    assert finish(front, grammar, "Let me see") is None
    end = front.text_ids("</think>")
    assert front.closing_tokens(grammar, end) == len(end) + 2  # </think>{}
    shortest = len(front.text_ids('{"a":"","b":[]}'))  # the path's tokens are not all merged
    assert shortest <= (front.closing_tokens(schema(REQUIRED), []) or 0) <= shortest + 2
