"""What an answer must look like, as an llguidance grammar the engine enforces.

The front writes grammars and checks, before the request is admitted, that the
engine can enforce them, so a schema no answer can follow is a 400 naming its
field, not a failure inside an engine step: each schema has no part only an
infinite value matches (a ``$ref`` that recurses with no way out, which llguidance
finds only when generation gets there: `mlxserve.server.schema_values`), and the
grammar compiles against the model's tokenizer and its first mask is computed, as
the engine's first step would (`Codec.grammar_problem`). The engine applies them to
the logits (`mlxserve.engine.sample.grammar`). Three sources:

- ``response_format``: ``json_object`` is any JSON object, ``json_schema`` the
  given schema (always enforced, ``strict`` or not: a schema the answer may break
  would be a schema silently ignored);
- ``tool_choice`` ``required`` or a named function: one call (or several, with
  ``parallel_tool_calls``) in the model's own call syntax, arguments valid under
  the function's parameter schema, and nothing after them.

JSON is compact (no free whitespace), so a small model cannot pad its answer with
blank lines until it runs out of tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from mlxserve.server.codec import Codec
from mlxserve.server.errors import InvalidRequest
from mlxserve.server.protocol import FunctionDefinition, ResponseFormat
from mlxserve.server.schema_values import infinite_only

#: Call syntaxes a forced tool call can be written in.
ToolStyle = Literal["json_tools", "dsml"]
#: At most this many calls in one forced answer (parallel_tool_calls).
MAX_FORCED_CALLS = 8
_COMPACT = {"whitespace_flexible": False}
#: A function a forced call may call, and the field its parameters came in
#: (``tools.1.function.parameters``): the one a 400 about its schema names.
ForcedTool = tuple[str, FunctionDefinition]


def _refuse_infinite(schema: dict[str, Any], param: str) -> None:
    """A 400 naming ``param`` if part of ``schema`` only an infinite value matches."""
    where = infinite_only(schema)
    if where is not None:
        raise InvalidRequest(
            f"{param}: only an infinite value matches {where} (a $ref recursing with no way "
            "out), so no answer can follow the schema",
            param=param,
        )


def _json_grammar(schema: dict[str, Any], param: str) -> str:
    _refuse_infinite(schema, param)
    from llguidance import LLMatcher

    options: Any = dict(_COMPACT)  # llguidance's JsonCompileOptions exists in its stub only
    try:
        return str(LLMatcher.grammar_from_json_schema(schema, defaults=options))
    except ValueError as exc:
        raise InvalidRequest(f"{param}: the schema is not valid: {exc}", param=param) from None


def checked(grammar: str, param: str, codec: Codec) -> str:
    """``grammar`` if the engine can enforce it, else a 400 naming ``param``."""
    problem = codec.grammar_problem(grammar)
    if problem is not None:
        raise InvalidRequest(f"{param}: cannot be enforced: {problem}", param=param)
    return grammar


def after_reasoning(grammar: str, end: str, codec: Codec, param: str) -> str:
    """``grammar`` for the answer, after free reasoning up to ``end`` (thinking mode:
    the prompt opened the reasoning, the grammar starts where the model closes it).

    ``grammar`` must have been checked on its own: the whole one's first mask is the
    reasoning's, so a grammar that cannot start would fail only after the reasoning."""
    if grammar.lstrip().startswith("{"):
        grammars = json.loads(grammar)["grammars"]
    else:  # Lark text (what llguidance's grammar_from_lark gives)
        grammars = [{"lark_grammar": grammar}]
    grammars[0]["name"] = "answer"
    reasoning = f"reasoning[stop={json.dumps(end)}]: " + r"/(.|\n)*/"
    outer = {"name": "reasoning", "lark_grammar": f"start: reasoning @answer\n{reasoning}\n"}
    return checked(json.dumps({"grammars": [outer, *grammars]}), param, codec)


def response_format_grammar(fmt: ResponseFormat | None, codec: Codec) -> str | None:
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise InvalidRequest(
                "json_schema is only for type 'json_schema'", param="response_format.json_schema"
            )
        return None
    if fmt.type == "json_object":
        return checked(
            _json_grammar({"type": "object"}, "response_format"), "response_format", codec
        )
    if fmt.json_schema is None:
        raise InvalidRequest(
            "type 'json_schema' needs a json_schema", param="response_format.json_schema"
        )
    param = "response_format.json_schema.schema"
    return checked(_json_grammar(fmt.json_schema.schema_, param), param, codec)


def _parameters(tool: FunctionDefinition) -> dict[str, Any]:
    return tool.parameters or {"type": "object", "properties": {}}


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def forced_tool_grammar(
    style: ToolStyle, tools: Sequence[ForcedTool], parallel: bool, codec: Codec
) -> str:
    """Calls of ``tools`` (one of them, or the one named) and nothing else; a 400
    naming the parameters of the first tool whose calls alone cannot be enforced.

    One check where all is well; a tool at a time only to name the culprit."""
    for param, tool in tools:
        schemas = [_parameters(tool)]
        if style == "dsml":  # each value's schema is embedded on its own (`_dsml_grammar`)
            values = schemas[0].get("properties") or {}
            schemas += [v for v in values.values() if isinstance(v, dict)]
        for schema in schemas:
            _refuse_infinite(schema, param)
    grammar = _tool_grammar(style, [tool for _, tool in tools], parallel)
    if codec.grammar_problem(grammar) is None:
        return grammar
    for param, tool in tools:
        checked(_tool_grammar(style, [tool], parallel=False), param, codec)
    return checked(grammar, "tools", codec)  # each alone can: together they cannot


def _tool_grammar(style: ToolStyle, tools: list[FunctionDefinition], parallel: bool) -> str:
    if style == "json_tools":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, "arguments": _parameters(tool)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for tool in tools
        ]
        schema = {"anyOf": calls, "x-guidance": _COMPACT}
        call = f'call: "<tool_call>" %json {json.dumps(schema)} "</tool_call>"'
        start = f"start: call{{1,{MAX_FORCED_CALLS}}}" if parallel else "start: call"
        grammar = f"{start}\n{call}\n"
    else:
        grammar = _dsml_grammar(tools, parallel)
    from llguidance import LLMatcher

    return str(LLMatcher.grammar_from_lark(grammar))


def _dsml_string(schema: dict[str, Any]) -> str:
    """A raw-text DSML value: its enum, else text without ``<`` up to its maxLength."""
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(_lark_string(v) for v in enum) + ")"
    limit = schema.get("maxLength")
    return f"/[^<]{{0,{int(limit)}}}/" if isinstance(limit, int) else "/[^<]*/"


def _dsml_grammar(tools: list[FunctionDefinition], parallel: bool) -> str:
    """DeepSeek-V4's DSML block: each parameter raw text (strings) or JSON (the rest)."""
    from mlxserve.models.deepseek_v4 import encoding as dsv4

    rules: list[str] = []
    invokes: list[str] = []
    for index, tool in enumerate(tools):
        params = _parameters(tool)
        properties: dict[str, Any] = params.get("properties") or {}
        required = set(params.get("required") or [])
        parts: list[str] = []
        for key, schema in properties.items():
            is_string = isinstance(schema, dict) and schema.get("type") == "string"
            head = f'{dsv4.PARAMETER_START} name="{key}" string="{str(is_string).lower()}">'
            value = _dsml_string(schema) if is_string else f"%json {json.dumps(schema)}"
            part = f"{_lark_string(head)} {value} {_lark_string(dsv4.PARAMETER_END + chr(10))}"
            parts.append(part if key in required else f"({part})?")
        name = f"invoke{index}"
        head = _lark_string(f'{dsv4.INVOKE_START} name="{tool.name}">\n')
        body = " ".join(parts)
        rules.append(f"{name}: {head} {body} {_lark_string(dsv4.INVOKE_END + chr(10))}")
        invokes.append(name)
    repeat = f"{{1,{MAX_FORCED_CALLS}}}" if parallel else ""
    block = (
        f"start: {_lark_string(dsv4.TOOL_CALLS_START + chr(10))} invoke{repeat} "
        f"{_lark_string(dsv4.TOOL_CALLS_END)}\n"
        f"invoke: {' | '.join(invokes)}\n"
    )
    return block + "\n".join(rules) + "\n"
