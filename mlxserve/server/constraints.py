"""What an answer must look like, as an llguidance grammar the engine enforces.

The front writes grammars and checks, before the request is admitted, that the
engine can enforce them, so a schema no answer can follow is a 400 naming its
field, not a failure inside an engine step: each schema has no part only an
infinite value matches (a ``$ref`` that recurses with no way out, which llguidance
finds only when generation gets there: `mlxserve.server.schema_values`), and the
grammar compiles against the model's tokenizer and its first mask is computed, as
the engine's first step would (`FrontTokenizer.grammar_problem`). The engine applies them to
the logits (`mlxserve.engine.sample.grammar`). Three sources:

- ``response_format``: ``json_object`` is any JSON object, ``json_schema`` the
  given schema (always enforced, ``strict`` or not: a schema the answer may break
  would be a schema silently ignored; ``strict: true`` also holds the schema to
  OpenAI's strict subset, `mlxserve.server.strict_schema`);
- ``tool_choice`` ``required`` or a named function: one call (or several, with
  ``parallel_tool_calls``) in the model's own call syntax, arguments valid under
  the function's parameter schema, and nothing after them (written by the chat
  format, `mlxserve.chat.call_grammar`; checked here; a ``strict`` function's
  schema held to OpenAI's strict subset, as above).

JSON is compact (no free whitespace), so a small model cannot pad its answer with
blank lines until it runs out of tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from mlxserve.chat.call_grammar import COMPACT_JSON, ToolStyle, parameters_schema, tool_grammar
from mlxserve.chat.prompt import ForcedTool
from mlxserve.server.errors import InvalidRequest
from mlxserve.server.protocol import ResponseFormat
from mlxserve.server.schema_values import infinite_only
from mlxserve.server.strict_schema import refuse_unstrict
from mlxserve.server.tokenizer import FrontTokenizer


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

    options: Any = dict(COMPACT_JSON)  # llguidance's JsonCompileOptions exists in its stub only
    try:
        return str(LLMatcher.grammar_from_json_schema(schema, defaults=options))
    except ValueError as exc:
        raise InvalidRequest(f"{param}: the schema is not valid: {exc}", param=param) from None


def checked(grammar: str, param: str, tokenizer: FrontTokenizer) -> str:
    """``grammar`` if the engine can enforce it, else a 400 naming ``param``."""
    problem = tokenizer.grammar_problem(grammar)
    if problem is not None:
        raise InvalidRequest(f"{param}: cannot be enforced: {problem}", param=param)
    return grammar


def after_reasoning(grammar: str, end: str, tokenizer: FrontTokenizer, param: str) -> str:
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
    return checked(json.dumps({"grammars": [outer, *grammars]}), param, tokenizer)


def response_format_grammar(fmt: ResponseFormat | None, tokenizer: FrontTokenizer) -> str | None:
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise InvalidRequest(
                "json_schema is only for type 'json_schema'", param="response_format.json_schema"
            )
        return None
    if fmt.type == "json_object":
        return checked(
            _json_grammar({"type": "object"}, "response_format"), "response_format", tokenizer
        )
    if fmt.json_schema is None:
        raise InvalidRequest(
            "type 'json_schema' needs a json_schema", param="response_format.json_schema"
        )
    param = "response_format.json_schema.schema"
    if fmt.json_schema.strict:
        refuse_unstrict(fmt.json_schema.schema_, param)
    return checked(_json_grammar(fmt.json_schema.schema_, param), param, tokenizer)


def forced_tool_grammar(
    style: ToolStyle, tools: Sequence[ForcedTool], parallel: bool, tokenizer: FrontTokenizer
) -> str:
    """Calls of ``tools`` (one of them, or the one named) and nothing else; a 400
    naming the parameters of the first tool whose calls alone cannot be enforced.

    One check where all is well; a tool at a time only to name the culprit."""
    for param, tool in tools:
        schemas = [parameters_schema(tool)]
        if tool.strict:
            refuse_unstrict(schemas[0], param)
        if style != "json_tools":  # DSML (V4, V4.1): each value's schema is embedded alone
            values = schemas[0].get("properties") or {}
            schemas += [v for v in values.values() if isinstance(v, dict)]
        for schema in schemas:
            _refuse_infinite(schema, param)
    grammar = tool_grammar(style, [tool for _, tool in tools], parallel)
    if tokenizer.grammar_problem(grammar) is None:
        return grammar
    for param, tool in tools:
        checked(tool_grammar(style, [tool], parallel=False), param, tokenizer)
    return checked(grammar, "tools", tokenizer)  # each alone can: together they cannot
