"""``strict: true``: OpenAI's strict subset of JSON Schema, a 400 naming the part a
schema breaks, and grammars that keep strict answers to the schema exactly (no key
the schema does not name, in either call syntax, ``$defs`` included)."""

import copy
from typing import Any

import pytest

from mlxserve.chat import Function
from mlxserve.chat.call_grammar import ToolStyle
from mlxserve.chat.deepseek_v4 import encoding as dsv4
from mlxserve.engine.sample.grammar import Grammars
from mlxserve.server.constraints import forced_tool_grammar, response_format_grammar
from mlxserve.server.errors import InvalidRequest
from mlxserve.server.protocol import ResponseFormat
from mlxserve.server.responses_protocol import ResponsesRequest, to_chat
from mlxserve.server.strict_schema import strict_problem
from mlxserve.server.tokenizer import FrontTokenizer
from tests.server.test_constraints import DEMO, takes

#: Everything the guide's subset has: a union with null, enum, const, a format,
#: number and array bounds, anyOf, $defs and recursion to the root.
STEP = {
    "type": "object",
    "properties": {"say": {"type": "string", "maxLength": 8}},
    "required": ["say"],
    "additionalProperties": False,
}
GOOD: dict[str, Any] = {
    "type": "object",
    "properties": {
        "unit": {"type": ["string", "null"], "enum": ["c", "f", None]},
        "kind": {"const": "w", "description": "always w"},
        "day": {"type": "string", "format": "date"},
        "temp": {"type": "number", "minimum": -130, "maximum": 130},
        "steps": {"type": "array", "items": {"$ref": "#/$defs/step"}, "maxItems": 2},
        "more": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
    },
    "required": ["unit", "kind", "day", "temp", "steps", "more"],
    "additionalProperties": False,
    "$defs": {"step": STEP},
}


def nested(levels: int) -> dict[str, Any]:
    """Objects ``levels`` deep, each the one property of the one above."""
    inner: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
    for _ in range(levels - 1):
        inner = {
            "type": "object",
            "properties": {"x": inner},
            "required": ["x"],
            "additionalProperties": False,
        }
    return inner


def broken(edit: Any) -> dict[str, Any]:
    schema = copy.deepcopy(GOOD)
    edit(schema)
    return schema


def many(count: int, text: str = "") -> dict[str, Any]:
    """An object of ``count`` string properties (named after ``text``)."""
    names = [f"{text}{i}" for i in range(count)]
    properties = {name: {"type": "string"} for name in names}
    return {**nested(1), "properties": properties, "required": names}


def one(schema: dict[str, Any]) -> dict[str, Any]:
    """An object whose one property, ``e``, has ``schema``."""
    return {**nested(1), "properties": {"e": schema}, "required": ["e"]}


@pytest.mark.parametrize(
    ("schema", "where", "why"),
    [
        ({"type": "array", "items": {"type": "string"}}, "", "root must be an object"),
        ({**GOOD, "anyOf": [STEP]}, "anyOf", "must not be an anyOf"),
        ({**GOOD, "additionalProperties": True}, "additionalProperties", "additionalProperties"),
        (broken(lambda s: s.pop("additionalProperties")), "", "additionalProperties: false"),
        (broken(lambda s: s["required"].remove("temp")), "properties.temp", "must be required"),
        (broken(lambda s: s["required"].append("wind")), "required", "'wind' is required"),
        (
            broken(lambda s: s["$defs"]["step"].pop("additionalProperties")),
            "$defs.step",
            "additionalProperties",
        ),
        (
            broken(lambda s: s["properties"]["more"]["anyOf"].append(many(1) | {"x": 1})),
            "properties.more.anyOf.2.x",
            "not among the keywords",
        ),
        (
            broken(lambda s: s["properties"]["temp"].update(allOf=[{"minimum": 0}])),
            "properties.temp.allOf",
            "allOf is not supported",
        ),
        (
            broken(lambda s: s["properties"]["unit"].update(oneOf=[{"type": "null"}])),
            "properties.unit.oneOf",
            "not among the keywords",
        ),
        (
            broken(lambda s: s["properties"]["day"].update(format="uri")),
            "properties.day.format",
            "not one of date-time",
        ),
        (
            broken(lambda s: s["properties"]["temp"].update(pattern="^1")),
            "properties.temp.pattern",
            "applies to type string",
        ),
        (
            broken(lambda s: s["properties"]["steps"].pop("items")),
            "properties.steps.items",
            "what its items are",
        ),
        (one({}), "properties.e", "says what its values are"),
        (
            broken(lambda s: s["properties"]["steps"]["items"].update(type="object")),
            "properties.steps.items.type",
            "next to a $ref",
        ),
        (broken(lambda s: s["properties"]["kind"].update(type="date")), "properties.kind.type", ""),
        (nested(11), ".".join(["properties", "x"] * 10), "at most 10 levels"),
        (many(5001), "", "at most 5000 object properties"),
        (one({"enum": list(range(1001))}), "", "at most 1000 enum values"),
        (one({"enum": [f"{i:060d}" for i in range(251)]}), "properties.e.enum", "15000 characters"),
        (many(2000, "x" * 60), "", "120000 characters"),
    ],
)  # fmt: skip
def test_what_strict_mode_refuses_is_named(schema: dict[str, Any], where: str, why: str) -> None:
    assert strict_problem(GOOD) is None
    assert strict_problem(nested(10)) is None
    problem = strict_problem(schema)
    assert problem is not None
    assert ".".join(problem[0]) == where
    assert why in problem[1]


def strict_format(schema: dict[str, Any], strict: bool) -> ResponseFormat:
    named = {"name": "s", "schema": schema, "strict": strict}
    return ResponseFormat.model_validate({"type": "json_schema", "json_schema": named})


def test_strict_response_format_is_400_naming_the_part(tokenizer: FrontTokenizer) -> None:
    loose = {"type": "object", "properties": {"x": {"type": "object"}}}
    assert response_format_grammar(strict_format(loose, strict=False), tokenizer)
    with pytest.raises(InvalidRequest) as caught:
        response_format_grammar(strict_format(loose, strict=True), tokenizer)
    assert caught.value.param == "response_format.json_schema.schema"
    assert "additionalProperties: false" in caught.value.message
    closed = {**loose, "additionalProperties": False}
    with pytest.raises(InvalidRequest) as caught:
        response_format_grammar(strict_format(closed, strict=True), tokenizer)
    assert caught.value.param == "response_format.json_schema.schema.properties.x"
    assert response_format_grammar(strict_format(GOOD, strict=True), tokenizer)


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    from mlx_lm.utils import load_tokenizer

    loaded = load_tokenizer(DEMO)  # type: ignore[no-untyped-call]
    return Grammars(loaded, len(loaded))


def dsml(tool: str, *values: tuple[str, str, bool]) -> str:
    """A DSML block calling ``tool`` with (name, text, raw string) values."""
    parameters = "".join(
        f'{dsv4.PARAMETER_START} name="{key}" string="{str(raw).lower()}">{text}'
        f"{dsv4.PARAMETER_END}\n"
        for key, text, raw in values
    )
    invoke = f'{dsv4.INVOKE_START} name="{tool}">\n{parameters}{dsv4.INVOKE_END}\n'
    return f"{dsv4.TOOL_CALLS_START}\n{invoke}{dsv4.TOOL_CALLS_END}"


def json_call(tool: str, arguments: str) -> str:
    return f'<tool_call>{{"name":"{tool}","arguments":{arguments}}}</tool_call>'


CODE = {"type": "string", "pattern": "^[A-Z]{2}$"}
#: Refers to its own $defs and to itself: embedded in a call's grammar, its refs
#: still resolve from its own root.
TREE = {
    "type": "object",
    "properties": {
        "step": {"$ref": "#/$defs/step"},
        "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1},
        "code": CODE,
    },
    "required": ["step", "kids", "code"],
    "additionalProperties": False,
    "$defs": {"step": STEP},
}
LEAF = '{"step":{"say":"hi"},"kids":[],"code":"AB"}'
#: TREE's values (step, kids, code, as JSON) and whether they are valid.
TREE_VALUES = [
    ('{"say":"hi"}', f"[{LEAF}]", '"CD"', True),
    ('{"say":"hi","x":1}', "[]", '"CD"', False),  # a key STEP does not have
    ('{"say":"hi"}', '[{"kids":[]}]', '"CD"', False),  # an item that is no TREE
    ('{"say":"hi"}', "[]", '"cd"', False),  # not the pattern
]


@pytest.mark.parametrize("style", ["json_tools", "dsml"])
def test_strict_calls_follow_the_schema_exactly(
    grammars: Grammars, tokenizer: FrontTokenizer, style: ToolStyle
) -> None:
    tree = Function(name="tree", parameters=TREE, strict=True)
    plain = Function(name="plain", strict=True)  # no parameters: no key at all
    grammar = forced_tool_grammar(style, [("t.0", tree), ("t.1", plain)], False, tokenizer)
    for step, kids, code, valid in TREE_VALUES:
        if style == "json_tools":
            text = json_call("tree", f'{{"step":{step},"kids":{kids},"code":{code}}}')
        else:  # the pattern string is JSON (string="false"): raw text could not keep it
            text = dsml("tree", ("step", step, False), ("kids", kids, False), ("code", code, False))
        assert takes(grammars.compile(grammar), tokenizer, text) == valid, (step, kids, code)
    if style == "dsml":
        raw = dsml(
            "tree", ("step", '{"say":"hi"}', False), ("kids", "[]", False), ("code", "CD", True)
        )
        assert not takes(grammars.compile(grammar), tokenizer, raw)
    empty, extra = (
        (json_call("plain", "{}"), json_call("plain", '{"x":1}'))
        if style == "json_tools"
        else (dsml("plain"), dsml("plain", ("x", "1", False)))
    )
    assert takes(grammars.compile(grammar), tokenizer, empty)
    assert not takes(grammars.compile(grammar), tokenizer, extra)
    with pytest.raises(InvalidRequest) as caught:
        loose = Function("loose", parameters={**TREE, "additionalProperties": True}, strict=True)
        forced_tool_grammar(style, [("t.0", tree), ("t.1", loose)], False, tokenizer)
    assert caught.value.param == "t.1.additionalProperties"


def test_responses_strict_functions_and_formats() -> None:
    tool = {"type": "function", "name": "tree", "parameters": TREE, "strict": True}
    base: dict[str, Any] = {"model": "m", "input": "hi", "tools": [tool]}
    # Responses clients send strict: true on every function: with auto it is accepted.
    auto = to_chat(ResponsesRequest.model_validate(base))
    assert auto.tools and not auto.tools[0].function.strict
    forced = to_chat(ResponsesRequest.model_validate({**base, "tool_choice": "required"}))
    assert forced.tools and forced.tools[0].function.strict
    loose = {**tool, "parameters": {**TREE, "required": ["step"]}}
    shape = {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}
    for body, param in [
        ({**base, "tools": [tool, loose]}, "tools.1.parameters.properties.kids"),
        ({**base, "text": {"format": shape}}, "text.format.schema"),
    ]:
        with pytest.raises(InvalidRequest) as caught:
            to_chat(ResponsesRequest.model_validate(body))
        assert caught.value.param == param
