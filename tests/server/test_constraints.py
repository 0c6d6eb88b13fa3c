"""The grammars the front writes, driven token by token through llguidance with the
demo tokenizer: what they let through and what they refuse."""

import json
from pathlib import Path

import pytest

from mlxserve.engine.grammar import Grammar, Grammars
from mlxserve.server.codec import Codec
from mlxserve.server.constraints import (
    after_reasoning,
    forced_tool_grammar,
    response_format_grammar,
)
from mlxserve.server.errors import InvalidRequest
from mlxserve.server.protocol import FunctionDefinition, ResponseFormat

DEMO = Path(__file__).resolve().parents[2] / "mlxserve" / "models" / "demo" / "weights"


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(DEMO)  # type: ignore[no-untyped-call]
    return Grammars(tokenizer, len(tokenizer))


def takes(grammar: Grammar, codec: Codec, text: str) -> bool:
    """Whether the grammar lets every token of ``text`` through, in order."""
    for token in codec.text_ids(text):
        if not bool(grammar.mask()[token]):
            return False
        grammar.accept(token)
    return True


def test_schema_and_tool_grammars(grammars: Grammars, codec: Codec) -> None:
    schema = {"type": "object", "properties": {"a": {"enum": ["x"]}}, "required": ["a"]}
    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    )
    grammar = response_format_grammar(fmt)
    assert grammar is not None
    assert takes(grammars.compile(grammar), codec, '{"a":"x"}')
    assert not takes(grammars.compile(grammar), codec, '{"a":"y"}')
    assert not takes(grammars.compile(grammar), codec, '{ "a": "x"}')  # compact only
    tool = FunctionDefinition(name="f", parameters=schema)
    call = '<tool_call>{"name":"f","arguments":{"a":"x"}}</tool_call>'
    one = forced_tool_grammar("json_tools", [tool], parallel=False)
    assert takes(compiled := grammars.compile(one), codec, call) and compiled.finished
    assert not takes(grammars.compile(one), codec, "Sure: " + call)
    assert takes(grammars.compile(forced_tool_grammar("json_tools", [tool], True)), codec, call * 2)


def test_thinking_then_the_grammar(grammars: Grammars, codec: Codec) -> None:
    fmt = ResponseFormat.model_validate({"type": "json_object"})
    inner = response_format_grammar(fmt)
    assert inner is not None
    grammar = grammars.compile(after_reasoning(inner, "</think>"))
    assert takes(grammar, codec, 'Let me see: "quotes", {braces}\nand lines.</think>{"k":1}')
    tool = FunctionDefinition(name="f")
    forced = after_reasoning(forced_tool_grammar("json_tools", [tool], False), "</think>")
    call = '<tool_call>{"name":"f","arguments":{}}</tool_call>'
    assert takes(grammars.compile(forced), codec, "hmm</think>" + call)


def test_bad_schemas_are_400() -> None:
    bad = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nonsense"}}}
    )
    with pytest.raises(InvalidRequest) as caught:
        response_format_grammar(bad)
    assert caught.value.param.startswith("response_format")  # type: ignore[union-attr]
    assert json.dumps(caught.value.body())
