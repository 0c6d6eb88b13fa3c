"""What a tool-call parser turns model output into, whatever the model's call syntax.

A parser reads the answer text as it streams and returns pieces: plain text for
``content``, or a complete, valid tool call. The chat API streams a call as its
header (id and name) and then its argument fragments. Each model family brings its
own parser behind `ToolCallParser` (DeepSeek-V4's DSML is one; mlx-lm's
``TokenizerWrapper.tool_parser`` functions can be wrapped the same way), so the
HTTP layer never knows the syntax.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``.

    Streamed text arrives in token-sized pieces, so a marker can be split across
    them; that much is held back until the next piece decides.
    """
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ParsedToolCall:
    """A call the model made; ``fragments`` joined are its JSON arguments."""

    name: str
    fragments: tuple[str, ...]
    id: str = field(default_factory=new_call_id)

    @property
    def arguments(self) -> str:
        return "".join(self.fragments)


@dataclass(frozen=True)
class Text:
    """Answer text; ``malformed`` marks call syntax the parser gave back as text."""

    text: str
    malformed: bool = False


ToolOutput = Text | ParsedToolCall


class ToolCallParser(Protocol):
    """Streaming: `push` the answer text as it arrives, `finish` once it has ended."""

    def push(self, text: str) -> list[ToolOutput]: ...

    def finish(self) -> list[ToolOutput]: ...


ParseFunction = Callable[[str, Any], Any]


class MarkedToolParser:
    """mlx-lm's tool parsers behind `ToolCallParser`: calls sit between two markers.

    mlx-lm knows each model family's markers (``TokenizerWrapper.tool_call_start`` /
    ``tool_call_end``) and parses one call's text (``tool_parser(text, tools)``) into
    ``{"name", "arguments"}`` (or a list of them). This class does the streaming part:
    text outside the markers is content at once, except what could be the start of a
    marker; a call is held until its end marker, then parsed; one that does not parse
    or never ends comes back as text marked malformed. An empty end marker means the
    calls run to the end of the answer.
    """

    def __init__(self, start: str, end: str, parse: ParseFunction, tools: Any) -> None:
        self._start = start
        self._end = end
        self._parse = parse
        self._tools = tools
        self._held = ""
        self._inside = False

    def push(self, text: str) -> list[ToolOutput]:
        self._held += text
        out: list[ToolOutput] = []
        while True:
            if not self._inside:
                at = self._held.find(self._start)
                if at < 0:
                    keep = partial_suffix(self._held, self._start)
                    cut = len(self._held) - keep
                    if cut:
                        out.append(Text(self._held[:cut]))
                    self._held = self._held[cut:]
                    return out
                if at:
                    out.append(Text(self._held[:at]))
                self._held = self._held[at + len(self._start) :]
                self._inside = True
            if not self._end:
                return out
            end = self._held.find(self._end)
            if end < 0:
                return out
            body, self._held = self._held[:end], self._held[end + len(self._end) :]
            self._inside = False
            out += self._calls(body)

    def finish(self) -> list[ToolOutput]:
        held, self._held = self._held, ""
        if not self._inside:
            return [Text(held)] if held else []
        self._inside = False
        if not self._end:
            return self._calls(held)
        return [Text(self._start + held, malformed=True)]

    def _calls(self, body: str) -> list[ToolOutput]:
        try:
            parsed = self._parse(body, self._tools)
            items = parsed if isinstance(parsed, list) else [parsed]
            calls: list[ToolOutput] = []
            for item in items:
                name, arguments = item["name"], item.get("arguments", {})
                if not isinstance(name, str) or not name:
                    raise ValueError("a call without a name")
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments, ensure_ascii=False)
                calls.append(ParsedToolCall(name, (arguments,)))
            return calls
        except (ValueError, KeyError, TypeError, AttributeError):
            return [Text(self._start + body + self._end, malformed=True)]
