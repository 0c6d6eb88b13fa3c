"""What a tool-call parser turns model output into, whatever the model's call syntax.

A parser reads the answer text as it streams and returns pieces: plain text for
``content``, or a complete, valid tool call. The chat API streams a call as its
header (id and name) and then its argument fragments. Each model family brings its
own parser behind `ToolCallParser` (DeepSeek-V4's DSML is one; mlx-lm's
``TokenizerWrapper.tool_parser`` functions can be wrapped the same way), so the
HTTP layer never knows the syntax.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Protocol


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
