"""A forced tool call as a grammar, in the call syntax of the model's format.

``tool_choice`` ``required`` or a named function: the answer is one call (or several,
with ``parallel_tool_calls``) of the given functions, arguments valid under each
function's parameter schema, and nothing after them. Two call syntaxes have a
grammar: mlx-lm's ``json_tools`` (``<tool_call>{"name", "arguments"}</tool_call>``)
and DeepSeek-V4's DSML (in V4's tags or V4.1's spaced ones). The server checks the
grammar against the model's tokenizer before the request is admitted
(`mlxserve.server.constraints.forced_tool_grammar`).

JSON is compact (no free whitespace), so a small model cannot pad its answer with
blank lines until it runs out of tokens.
"""

from __future__ import annotations

import json
from typing import Any, Literal
from urllib.parse import quote

from mlxserve.chat.deepseek_v4.dialect import BY_STYLE, Dialect
from mlxserve.chat.request import Function

#: Call syntaxes a forced tool call can be written in: mlx-lm's ``json_tools``, and
#: DSML in V4's or V4.1's dialect (`deepseek_v4.dialect`).
ToolStyle = Literal["json_tools", "dsml", "dsml_v41"]
#: At most this many calls in one forced answer (parallel_tool_calls).
MAX_FORCED_CALLS = 8
#: llguidance's JSON options: no whitespace where JSON allows it.
COMPACT_JSON = {"whitespace_flexible": False}


def parameters_schema(tool: Function) -> dict[str, Any]:
    """The schema of the function's arguments (an object with no keys where none is
    given: no key at all for a ``strict`` function)."""
    if tool.parameters:
        return tool.parameters
    empty: dict[str, Any] = {"type": "object", "properties": {}}
    return {**empty, "additionalProperties": False} if tool.strict else empty


#: Keywords that map names to schemas, and keywords whose values are data (a
#: ``$ref`` key in there is a name or a value, not a reference).
_NAMED_SCHEMAS = ("properties", "patternProperties", "dependentSchemas", "$defs", "definitions")
_DATA = ("enum", "const", "default", "examples")


def _rebased(schema: Any, at: str) -> Any:
    """``schema`` moved to the JSON pointer ``at`` of a larger document: each local
    ``$ref`` (``#``, ``#/...``) made to point under ``at``. The grammars embed a
    function's schema in one of their own, and llguidance resolves a ``$ref`` from
    the root of the schema it compiles, so ``#/$defs/x`` would miss the function's."""
    if isinstance(schema, list):
        return [_rebased(item, at) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            moved[key] = at + value[1:]
        elif key in _DATA:
            moved[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            moved[key] = {name: _rebased(item, at) for name, item in value.items()}
        else:
            moved[key] = _rebased(value, at)
    return moved


def _pointer(key: str) -> str:
    """``key`` as a step of a JSON pointer in a URI fragment."""
    return quote(key.replace("~", "~0").replace("/", "~1"), safe="")


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def tool_grammar(style: ToolStyle, tools: list[Function], parallel: bool) -> str:
    """Calls of ``tools`` in ``style`` and nothing else, as llguidance's grammar text."""
    if style == "json_tools":
        calls: list[dict[str, Any]] = []
        defs: dict[str, Any] = {}
        for index, tool in enumerate(tools):
            arguments = parameters_schema(tool)
            moved = _rebased(arguments, f"#/$defs/arguments{index}")
            if moved != arguments:  # it refers to itself: kept whole, where its refs point
                defs[f"arguments{index}"] = moved
                arguments = {"$ref": f"#/$defs/arguments{index}"}
            calls.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": tool.name}, "arguments": arguments},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = {"anyOf": calls, "x-guidance": COMPACT_JSON}
        if defs:
            schema["$defs"] = defs
        call = f'call: "<tool_call>" %json {json.dumps(schema)} "</tool_call>"'
        start = f"start: call{{1,{MAX_FORCED_CALLS}}}" if parallel else "start: call"
        grammar = f"{start}\n{call}\n"
    else:
        grammar = _dsml_grammar(BY_STYLE[style], tools, parallel)
    from llguidance import LLMatcher

    return str(LLMatcher.grammar_from_lark(grammar))


#: What a raw-text DSML value keeps of a string's schema (and the annotations).
_RAW_KEYS = frozenset(
    {"type", "enum", "maxLength", "title", "description", "default", "examples", "$comment"}
)


def _dsml_string(schema: dict[str, Any], exact: bool) -> str | None:
    """A raw-text DSML value: its enum, else text without ``<`` up to its maxLength.
    None where ``exact`` (a strict function) and the raw text cannot keep the schema
    (a pattern, a format, a minLength, a const...): the value is then JSON."""
    enum = schema.get("enum")
    strings = enum if isinstance(enum, list) and all(isinstance(v, str) for v in enum) else None
    limit = schema.get("maxLength")
    within = limit is None or isinstance(limit, int)
    if strings:
        within = within and all(limit is None or len(v) <= limit for v in strings)
    kept = within and (bool(strings) or enum is None)
    if exact and not (kept and schema.keys() <= _RAW_KEYS):
        return None
    if strings:
        return "(" + " | ".join(_lark_string(v) for v in strings) + ")"
    return f"/[^<]{{0,{int(limit)}}}/" if isinstance(limit, int) else "/[^<]*/"


def _dsml_grammar(dialect: Dialect, tools: list[Function], parallel: bool) -> str:
    """DeepSeek-V4's DSML block, in ``dialect``'s tags: each parameter raw text
    (strings) or JSON (the rest).

    A value's JSON schema is embedded alone; one that refers to the function's
    schema (``#/$defs/...``) is embedded as a ``$ref`` into a copy of it."""
    rules: list[str] = []
    invokes: list[str] = []
    for index, tool in enumerate(tools):
        params = parameters_schema(tool)
        properties: dict[str, Any] = params.get("properties") or {}
        required = set(params.get("required") or [])
        moved = _rebased(params, "#/$defs/arguments")
        parts: list[str] = []
        for key, schema in properties.items():
            is_string = isinstance(schema, dict) and schema.get("type") == "string"
            raw = _dsml_string(schema, bool(tool.strict)) if is_string else None
            if raw is None and moved != params:
                pointer = f"#/$defs/arguments/properties/{_pointer(key)}"
                schema = {"$defs": {"arguments": moved}, "$ref": pointer}
            head = (
                f'{dialect.parameter_start} name="{key}" string="{str(raw is not None).lower()}">'
            )
            value = raw if raw is not None else f"%json {json.dumps(schema)}"
            part = f"{_lark_string(head)} {value} {_lark_string(dialect.parameter_end + chr(10))}"
            parts.append(part if key in required else f"({part})?")
        name = f"invoke{index}"
        head = _lark_string(f'{dialect.invoke_start} name="{tool.name}">\n')
        body = " ".join(parts)
        rules.append(f"{name}: {head} {body} {_lark_string(dialect.invoke_end + chr(10))}")
        invokes.append(name)
    repeat = f"{{1,{MAX_FORCED_CALLS}}}" if parallel else ""
    block = (
        f"start: {_lark_string(dialect.calls_start + chr(10))} invoke{repeat} "
        f"{_lark_string(dialect.calls_end)}\n"
        f"invoke: {' | '.join(invokes)}\n"
    )
    return block + "\n".join(rules) + "\n"
