# ruff: noqa: RUF002
"""DeepSeek-V4's tool calls (DSML) read back from the model's streamed answer.

V4.1 writes the same blocks with its own tag names (``<｜DSML｜ calls>``...): the
parser takes the dialect (`dialect`).

The model writes its calls after its answer text and a blank line::

    Let me look.

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

``string="true"`` values are raw text, ``string="false"`` values JSON, kept as the
model wrote them: the arguments are the text the reference parser makes of them. Text
before the block streams as content at once, except what could be the start of the
block marker or the line break(s) before it, which go with the block (the content
keeps any other whitespace it ends with). A block is held until it closes: only then
is it known to be well formed, so a client never receives a call that later turns out
to be broken. A block that does not parse, or never closes, is given back as text; an
empty one is no call and no text. Whitespace after a block is dropped.
"""

from __future__ import annotations

import json
import re

from mlxserve.chat.deepseek_v4.dialect import V4, Dialect
from mlxserve.chat.deepseek_v4.encoding import to_json
from mlxserve.chat.tool_calls import ParsedToolCall, Text, ToolOutput, partial_suffix

_INVOKE_HEAD = re.compile(r'\s*name="([^"]+)">')
_PARAMETER_HEAD = re.compile(r'\s*name="([^"]+)"\s+string="(true|false)">')


class MalformedDsml(ValueError):
    pass


def parse_block(body: str, dialect: Dialect = V4) -> list[ParsedToolCall]:
    """The calls of one block's body (between the block markers, none in an empty one),
    in ``dialect``'s tags; raises `MalformedDsml`."""
    d = dialect
    calls: list[ParsedToolCall] = []
    rest = body
    while rest.strip():
        rest = rest.lstrip()
        if not rest.startswith(d.invoke_start):
            raise MalformedDsml(f"expected {d.invoke_start}, got {rest[:40]!r}")
        head = _INVOKE_HEAD.match(rest, len(d.invoke_start))
        if head is None:
            raise MalformedDsml("an invoke without a name")
        name, rest = head.group(1), rest[head.end() :]
        fragments: list[str] = []
        seen: set[str] = set()
        while True:
            rest = rest.lstrip()
            if rest.startswith(d.invoke_end):
                rest = rest[len(d.invoke_end) :]
                break
            if not rest.startswith(d.parameter_start):
                raise MalformedDsml(f"expected a parameter or {d.invoke_end} in '{name}'")
            param = _PARAMETER_HEAD.match(rest, len(d.parameter_start))
            end = rest.find(d.parameter_end)
            if param is None or end < param.end():
                raise MalformedDsml(f"a malformed parameter in '{name}'")
            key, is_string, raw = param.group(1), param.group(2), rest[param.end() : end]
            if key in seen:
                raise MalformedDsml(f"parameter '{key}' twice in '{name}'")
            seen.add(key)
            fragments.append(
                ("{" if not fragments else ", ") + f"{to_json(key)}: {_value(raw, is_string)}"
            )
            rest = rest[end + len(d.parameter_end) :]
        fragments.append("}" if fragments else "{}")
        calls.append(ParsedToolCall(name, tuple(fragments)))
    return calls


def _value(raw: str, is_string: str) -> str:
    """A parameter's value as JSON text: raw text quoted, a JSON value as written."""
    if is_string == "true":
        return to_json(raw)
    try:
        json.loads(raw)
    except json.JSONDecodeError as exc:
        raise MalformedDsml(f"not JSON: {raw[:40]!r} ({exc})") from None
    return raw


def _line_breaks(text: str) -> str:
    """The line breaks (a blank line at most) that end ``text``: they go with a block."""
    return "\n\n" if text.endswith("\n\n") else "\n" if text.endswith("\n") else ""


class DsmlParser:
    """`ToolCallParser` for DSML in ``dialect``'s tags (V4's, or V4.1's spaced ones):
    text streams through, blocks become calls."""

    def __init__(self, dialect: Dialect = V4) -> None:
        self._dialect = dialect
        start = dialect.calls_start
        #: What the text before a block may end with, held back until the next piece decides.
        self._openings = ("\n\n" + start, "\n" + start, start)
        self._text = ""  # content not yet released
        self._block: str | None = None  # inside a block: what followed its start marker
        self._gap = ""  # the line breaks before the open block
        self._after_block = False  # whitespace that follows a block is dropped
        self.calls = 0

    def push(self, text: str) -> list[ToolOutput]:
        out: list[ToolOutput] = []
        if self._block is not None:
            self._block += text
        else:
            self._text += text
        while True:
            if self._block is None:
                if self._after_block:
                    self._text = self._text.lstrip()
                    if not self._text:
                        return out
                    self._after_block = False
                start = self._text.find(self._dialect.calls_start)
                if start < 0:
                    break
                before = self._text[:start]
                self._gap = _line_breaks(before)
                if len(before) > len(self._gap):
                    out.append(Text(before[: len(before) - len(self._gap)]))
                self._block = self._text[start + len(self._dialect.calls_start) :]
                self._text = ""
            end = self._block.find(self._dialect.calls_end)
            if end < 0:
                return out
            body, after = self._block[:end], self._block[end + len(self._dialect.calls_end) :]
            self._block = None
            out.extend(self._close(body))
            self._text = after
        held = max(partial_suffix(self._text, opening) for opening in self._openings)
        if len(self._text) > held:
            out.append(Text(self._text[: len(self._text) - held]))
            self._text = self._text[len(self._text) - held :]
        return out

    def _close(self, body: str) -> list[ToolOutput]:
        try:
            calls = parse_block(body, self._dialect)
        except MalformedDsml:
            d = self._dialect
            raw = self._gap + d.calls_start + body + d.calls_end
            self._gap = ""
            return [Text(raw, malformed=True)]
        self._gap = ""
        self._after_block = True
        self.calls += len(calls)
        return list(calls)

    def finish(self) -> list[ToolOutput]:
        out: list[ToolOutput] = []
        if self._block is not None:  # never closed
            out.append(Text(self._gap + self._dialect.calls_start + self._block, malformed=True))
            self._block, self._gap = None, ""
        if self._text:
            out.append(Text(self._text))
        self._text = ""
        return out
