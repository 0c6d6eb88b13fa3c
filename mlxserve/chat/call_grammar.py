"""A forced tool call as a grammar, in the call syntax of the model's format.

``tool_choice`` ``required`` or a named function: the answer is one call (or several,
with ``parallel_tool_calls``) of the given functions, arguments valid under each
function's parameter schema, and nothing after them. Two call syntaxes have a
grammar: mlx-lm's ``json_tools`` (``<tool_call>{"name", "arguments"}</tool_call>``)
and DeepSeek-V4's DSML. The server checks the grammar against the model's tokenizer
before the request is admitted (`mlxserve.server.constraints.forced_tool_grammar`).

JSON is compact (no free whitespace), so a small model cannot pad its answer with
blank lines until it runs out of tokens.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from mlxserve.chat.deepseek_v4 import encoding as dsv4
from mlxserve.chat.request import Function

#: Call syntaxes a forced tool call can be written in.
ToolStyle = Literal["json_tools", "dsml"]
#: At most this many calls in one forced answer (parallel_tool_calls).
MAX_FORCED_CALLS = 8
#: llguidance's JSON options: no whitespace where JSON allows it.
COMPACT_JSON = {"whitespace_flexible": False}


def parameters_schema(tool: Function) -> dict[str, Any]:
    """The schema of the function's arguments (an object with no keys where none is given)."""
    return tool.parameters or {"type": "object", "properties": {}}


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def tool_grammar(style: ToolStyle, tools: list[Function], parallel: bool) -> str:
    """Calls of ``tools`` in ``style`` and nothing else, as llguidance's grammar text."""
    if style == "json_tools":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, "arguments": parameters_schema(tool)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for tool in tools
        ]
        schema = {"anyOf": calls, "x-guidance": COMPACT_JSON}
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


def _dsml_grammar(tools: list[Function], parallel: bool) -> str:
    """DeepSeek-V4's DSML block: each parameter raw text (strings) or JSON (the rest)."""
    rules: list[str] = []
    invokes: list[str] = []
    for index, tool in enumerate(tools):
        params = parameters_schema(tool)
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
