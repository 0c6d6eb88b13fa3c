"""A chat answer's text split into reasoning, content and tool calls, as it streams.

In thinking mode the prompt ends inside the reasoning (``<think>``): everything up
to the model's ``</think>`` is ``reasoning_content``, the rest is the answer. The
answer then goes through the model's tool-call parser, if the request has tools.
Text that could still become a marker is held back, so no marker text ever reaches
the client, and a marker split across tokens is recognised all the same. A forced
call's answer (``tool_choice`` required or named) is its calls only: what of it does
not parse as a call (cut short by a stop string, a lost backend) is dropped, not
given back as content, and marks the answer `malformed`.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxserve.chat.tool_calls import ParsedToolCall, Text, ToolCallParser, partial_suffix


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Content:
    text: str


Piece = Reasoning | Content | ParsedToolCall


class ChatOutput:
    """Push text deltas, get pieces; `finish` flushes what was held back."""

    def __init__(
        self,
        *,
        reasoning_end: str | None,
        tools: ToolCallParser | None = None,
        forced: bool = False,
    ) -> None:
        self._end = reasoning_end  # None: no reasoning part (chat mode)
        self._held = ""
        self._tools = tools
        self._forced = forced  # the answer is calls only: its text is never content
        self.tool_calls: list[ParsedToolCall] = []
        self.malformed = False

    @property
    def in_reasoning(self) -> bool:
        return self._end is not None

    def push(self, text: str) -> list[Piece]:
        if self._end is None:
            return self._answer(text)
        self._held += text
        end = self._held.find(self._end)
        if end >= 0:
            reasoning, rest = self._held[:end], self._held[end + len(self._end) :]
            self._held, self._end = "", None
            return [*self._reasoning(reasoning), *self._answer(rest)]
        keep = partial_suffix(self._held, self._end)
        reasoning = self._held[: len(self._held) - keep]
        self._held = self._held[len(reasoning) :]
        return self._reasoning(reasoning)

    def finish(self) -> list[Piece]:
        pieces: list[Piece] = []
        if self._end is not None:
            pieces += self._reasoning(self._held)
            self._held = ""
        if self._tools is not None:
            pieces += self._convert(self._tools.finish())
        return pieces

    @staticmethod
    def _reasoning(text: str) -> list[Piece]:
        return [Reasoning(text)] if text else []

    def _answer(self, text: str) -> list[Piece]:
        if self._tools is None:
            return [Content(text)] if text else []
        return self._convert(self._tools.push(text))

    def _convert(self, outputs: list[Text | ParsedToolCall]) -> list[Piece]:
        pieces: list[Piece] = []
        for output in outputs:
            if isinstance(output, ParsedToolCall):
                self.tool_calls.append(output)
                pieces.append(output)
            else:
                self.malformed |= output.malformed or (self._forced and bool(output.text))
                if output.text and not self._forced:
                    pieces.append(Content(output.text))
        return pieces
