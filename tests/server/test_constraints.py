"""The grammars the front writes, driven token by token through llguidance with the
demo tokenizer: what they let through and what they refuse."""

import json
from pathlib import Path

import pytest

from mlxserve.chat import Function
from mlxserve.chat.call_grammar import ToolStyle
from mlxserve.engine.sample.grammar import Grammar, Grammars
from mlxserve.server.constraints import (
    after_reasoning,
    forced_tool_grammar,
    response_format_grammar,
)
from mlxserve.server.errors import InvalidRequest
from mlxserve.server.protocol import ResponseFormat
from mlxserve.server.tokenizer import FrontTokenizer

DEMO = Path(__file__).resolve().parents[2] / "mlxserve" / "models" / "demo" / "weights"


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(DEMO)  # type: ignore[no-untyped-call]
    return Grammars(tokenizer, len(tokenizer))


def takes(grammar: Grammar, tokenizer: FrontTokenizer, text: str) -> bool:
    """Whether the grammar lets every token of ``text`` through, in order."""
    for token in tokenizer.text_ids(text):
        if not bool(grammar.mask()[token]):
            return False
        grammar.accept(token)
    return True


def test_schema_and_tool_grammars(grammars: Grammars, tokenizer: FrontTokenizer) -> None:
    schema = {"type": "object", "properties": {"a": {"enum": ["x"]}}, "required": ["a"]}
    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    )
    grammar = response_format_grammar(fmt, tokenizer)
    assert grammar is not None
    assert takes(grammars.compile(grammar), tokenizer, '{"a":"x"}')
    assert not takes(grammars.compile(grammar), tokenizer, '{"a":"y"}')
    assert not takes(grammars.compile(grammar), tokenizer, '{ "a": "x"}')  # compact only
    tool = Function(name="f", parameters=schema)
    call = '<tool_call>{"name":"f","arguments":{"a":"x"}}</tool_call>'
    one = forced_tool_grammar("json_tools", [("tools.0", tool)], False, tokenizer)
    assert takes(compiled := grammars.compile(one), tokenizer, call) and compiled.finished
    assert not takes(grammars.compile(one), tokenizer, "Sure: " + call)
    both = forced_tool_grammar("json_tools", [("tools.0", tool)], True, tokenizer)
    assert takes(grammars.compile(both), tokenizer, call * 2)


def test_thinking_then_the_grammar(grammars: Grammars, tokenizer: FrontTokenizer) -> None:
    fmt = ResponseFormat.model_validate({"type": "json_object"})
    inner = response_format_grammar(fmt, tokenizer)
    assert inner is not None
    grammar = grammars.compile(after_reasoning(inner, "</think>", tokenizer, "response_format"))
    assert takes(grammar, tokenizer, 'Let me see: "quotes", {braces}\nand lines.</think>{"k":1}')
    tool = Function(name="f")
    forced = forced_tool_grammar("json_tools", [("tools.0", tool)], False, tokenizer)
    forced = after_reasoning(forced, "</think>", tokenizer, "tools")
    call = '<tool_call>{"name":"f","arguments":{}}</tool_call>'
    assert takes(grammars.compile(forced), tokenizer, "hmm</think>" + call)


def test_bad_schemas_are_400(tokenizer: FrontTokenizer) -> None:
    bad = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nonsense"}}}
    )
    with pytest.raises(InvalidRequest) as caught:
        response_format_grammar(bad, tokenizer)
    assert caught.value.param == "response_format.json_schema.schema"
    assert json.dumps(caught.value.body())


#: No finite value: llguidance compiles it and fails at the first mask (in the engine,
#: inside a step, after admission; it was a 503 after a retry on every backend).
RECURSIVE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
UNSATISFIABLE = {"allOf": [{"type": "string"}, {"type": "integer"}]}
#: The first mask is fine here: llguidance gets stuck only after ``{"x":``.
DEEP = {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "$defs": RECURSIVE["$defs"]}


@pytest.mark.parametrize("schema", [RECURSIVE, UNSATISFIABLE, DEEP])
def test_a_schema_no_answer_can_follow_is_400_naming_it(
    tokenizer: FrontTokenizer, schema: dict[str, object]
) -> None:
    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    )
    with pytest.raises(InvalidRequest) as caught:
        response_format_grammar(fmt, tokenizer)
    assert caught.value.param == "response_format.json_schema.schema"
    assert caught.value.status == 400


@pytest.mark.parametrize("style", ["json_tools", "dsml"])
@pytest.mark.parametrize("parallel", [False, True])
def test_a_forced_tool_whose_schema_cannot_be_enforced_is_named(
    tokenizer: FrontTokenizer, style: ToolStyle, parallel: bool
) -> None:
    good = Function(name="good", parameters={"type": "object", "properties": {}})
    loop = {"$ref": "#/$defs/a"}
    for parameters in [
        # The recursion under an optional key: llguidance lets the key be written.
        {"type": "object", "properties": {"x": loop}, "$defs": {"a": loop}},
        # A value's own schema recursing (DSML embeds each value's schema alone).
        {"type": "object", "properties": {"x": RECURSIVE}},
        # A $ref to nothing.
        {"type": "object", "properties": {"x": loop}},
        RECURSIVE,
    ]:
        bad = Function(name="bad", parameters=parameters)
        tools = [("tools.0.function.parameters", good), ("tools.3.function.parameters", bad)]
        with pytest.raises(InvalidRequest) as caught:
            forced_tool_grammar(style, tools, parallel, tokenizer)
        assert caught.value.param == "tools.3.function.parameters", parameters
    assert forced_tool_grammar(style, tools[:1], parallel, tokenizer)  # the good one alone is fine


def test_the_grammar_check_does_not_refuse_a_schema_that_only_recurses(
    tokenizer: FrontTokenizer,
) -> None:
    """A tree (a ``$ref`` under an optional key) has finite values: it is enforced."""
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "tree", "schema": tree}}
    )
    assert response_format_grammar(fmt, tokenizer) is not None
