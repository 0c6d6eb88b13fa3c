"""What an answer must look like, as an llguidance grammar the engine enforces.

The front only writes grammars (and checks they compile); the engine applies them
to the logits (`mlxserve.engine.grammar`). Three sources:

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
from typing import Any, Literal

from mlxserve.server.errors import InvalidRequest
from mlxserve.server.protocol import FunctionDefinition, ResponseFormat

#: Call syntaxes a forced tool call can be written in.
ToolStyle = Literal["json_tools", "dsml"]
#: At most this many calls in one forced answer (parallel_tool_calls).
MAX_FORCED_CALLS = 8
_COMPACT = {"whitespace_flexible": False}


def _json_grammar(schema: dict[str, Any]) -> str:
    from llguidance import LLMatcher

    options: Any = dict(_COMPACT)  # llguidance's JsonCompileOptions exists in its stub only
    try:
        return str(LLMatcher.grammar_from_json_schema(schema, defaults=options))
    except ValueError as exc:
        raise InvalidRequest(f"the schema is not valid: {exc}", param="response_format") from None


def checked(grammar: str, param: str) -> str:
    """``grammar`` if it compiles, else a 400 naming ``param``."""
    from mlxserve.engine.grammar import validate

    problem = validate(grammar)
    if problem is not None:
        raise InvalidRequest(f"{param}: cannot be enforced: {problem}", param=param)
    return grammar


def after_reasoning(grammar: str, end: str) -> str:
    """``grammar`` for the answer, after free reasoning up to ``end`` (thinking mode:
    the prompt opened the reasoning, the grammar starts where the model closes it)."""
    if grammar.lstrip().startswith("{"):
        grammars = json.loads(grammar)["grammars"]
    else:  # Lark text (what llguidance's grammar_from_lark gives)
        grammars = [{"lark_grammar": grammar}]
    grammars[0]["name"] = "answer"
    reasoning = f"reasoning[stop={json.dumps(end)}]: " + r"/(.|\n)*/"
    outer = {"name": "reasoning", "lark_grammar": f"start: reasoning @answer\n{reasoning}\n"}
    return checked(json.dumps({"grammars": [outer, *grammars]}), "response_format")


def response_format_grammar(fmt: ResponseFormat | None) -> str | None:
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise InvalidRequest(
                "json_schema is only for type 'json_schema'", param="response_format.json_schema"
            )
        return None
    if fmt.type == "json_object":
        return checked(_json_grammar({"type": "object"}), "response_format")
    if fmt.json_schema is None:
        raise InvalidRequest(
            "type 'json_schema' needs a json_schema", param="response_format.json_schema"
        )
    schema = fmt.json_schema.schema_
    return checked(_json_grammar(schema), "response_format.json_schema.schema")


def _parameters(tool: FunctionDefinition) -> dict[str, Any]:
    return tool.parameters or {"type": "object", "properties": {}}


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def forced_tool_grammar(style: ToolStyle, tools: list[FunctionDefinition], parallel: bool) -> str:
    """Calls of ``tools`` (one of them, or the one named) and nothing else."""
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

    return checked(LLMatcher.grammar_from_lark(grammar), "tools")


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
