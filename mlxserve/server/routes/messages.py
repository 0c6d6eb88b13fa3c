"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API.

A thin tokenizer: the request becomes the internal chat request (`to_chat`), which goes
through the same prompt builder, grammar, generation and answer splitting as the
chat completions route; the pieces (reasoning, text, tool calls) come out as
Anthropic content blocks, whole or as its event sequence (``message_start``, per
block ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``,
``message_stop``). Errors leave in Anthropic's shape, ``{"type": "error",
"error": {"type", "message"}}``, with the same statuses.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxserve.chat import Content, ParsedToolCall, Piece, Reasoning
from mlxserve.server.anthropic_protocol import CountTokensRequest, MessagesRequest, to_chat
from mlxserve.server.errors import anthropic_error
from mlxserve.server.generation import Delta, Prepared
from mlxserve.server.routes.chat import Answer
from mlxserve.server.routes.chat_call import ChatCall, read_chat, read_generation
from mlxserve.server.routes.common import (
    CLIENT_CLOSED,
    ClientGone,
    backend_header,
    collect,
    with_first,
)
from mlxserve.server.sse import typed_sse_response


def _stop_reason(answer: Answer, last: Delta) -> str:
    if answer.output.tool_calls and last.finish_reason == "stop":
        return "tool_use"
    if last.stop_string is not None:
        return "stop_sequence"
    return "max_tokens" if last.finish_reason == "length" else "end_turn"


def _usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    """Usage as Anthropic counts it: ``input_tokens`` are the prompt's tokens not read
    from the cache, so the prompt is their sum with ``cache_read_input_tokens`` (the
    prefix cache's hits); both cache fields are numbers, 0 when nothing was read or
    written (mlxserve's prefix cache is automatic and writes no entry of its own:
    ``cache_creation_input_tokens`` is always 0)."""
    cached = min(cached_tokens, prompt_tokens)
    return {
        "input_tokens": prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


def _last_usage(last: Delta) -> dict[str, int]:
    return _usage(last.prompt_tokens, last.cached_tokens, last.completion_tokens)


def _tool_block(call: ParsedToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": call.id,
        "name": call.name,
        "input": json.loads(call.arguments),
    }


def _prepare(call: ChatCall[MessagesRequest]) -> Prepared:
    """The route's checks and its generation (in a worker thread: see `read_generation`)."""
    call.refuse_prefill(f"messages.{len(call.body.messages) - 1}.role")
    return call.prepare(call.grammar())


async def messages(request: Request) -> Response:
    call, prepared = await read_generation(request, MessagesRequest, to_chat, _prepare)
    body, prompt = call.body, call.prompt
    generations = call.runtime.generations
    message_id = f"msg_{prepared.request_id}"
    answer = Answer(prompt, call.runtime.tokenizer)
    deltas = generations.run(prepared)
    first = await anext(deltas)  # the first token, or the error with its real status
    if not body.stream:
        try:
            _, last = await collect(with_first(first, deltas), request, answer.add)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        content: list[dict[str, Any]] = []
        if prompt.reasoning_end is not None:
            content.append(
                {"type": "thinking", "thinking": "".join(answer.reasoning), "signature": ""}
            )
        text = "".join(answer.content)
        if text or not answer.output.tool_calls:
            content.append({"type": "text", "text": text})
        content += [_tool_block(call) for call in answer.output.tool_calls]
        reply = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": body.model,
            "content": content,
            "stop_reason": _stop_reason(answer, last),
            "stop_sequence": last.stop_string,
            "usage": _last_usage(last),
        }
        return JSONResponse(reply, headers=backend_header(last))
    head: dict[str, Any] = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": body.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        # The cache's hits are known when the answer ends: message_delta's usage
        # (cumulative, as Anthropic's) has them, and the input_tokens without them.
        "usage": _usage(prepared.prompt_tokens, 0, 0),
    }
    events = _events(with_first(first, deltas), head, answer)
    return typed_sse_response(events, anthropic_error, headers=backend_header(first))


class _Blocks:
    """The open content block of a stream, and the events that open and close blocks."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.stop()
        self.index += 1
        self.open = str(block["type"])
        events.append({"type": "content_block_start", "index": self.index, "content_block": block})
        return events

    def stop(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def piece(self, piece: Piece) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if isinstance(piece, Reasoning):
            if self.open != "thinking":
                events += self.start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self.delta({"type": "thinking_delta", "thinking": piece.text}))
        elif isinstance(piece, Content):
            if self.open != "text":
                events += self.start({"type": "text", "text": ""})
            events.append(self.delta({"type": "text_delta", "text": piece.text}))
        else:
            events += self.start(
                {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}
            )
            for fragment in piece.fragments:
                events.append(self.delta({"type": "input_json_delta", "partial_json": fragment}))
            events += self.stop()
        return events


async def _events(
    deltas: AsyncGenerator[Delta, None], head: dict[str, Any], answer: Answer
) -> AsyncGenerator[dict[str, Any], None]:
    blocks = _Blocks()
    try:
        yield {"type": "message_start", "message": head}
        async for delta in deltas:
            for piece in answer.add(delta):
                for event in blocks.piece(piece):
                    yield event
            if delta.finish_reason is None:
                continue
            if blocks.index < 0:  # an empty answer is one empty text block
                for event in blocks.start({"type": "text", "text": ""}):
                    yield event
            for event in blocks.stop():
                yield event
            yield {
                "type": "message_delta",
                "delta": {
                    "stop_reason": _stop_reason(answer, delta),
                    "stop_sequence": delta.stop_string,
                },
                "usage": _last_usage(delta),
            }
            yield {"type": "message_stop"}
    finally:
        await deltas.aclose()


async def count_tokens(request: Request) -> Response:
    call = await read_chat(request, CountTokensRequest, to_chat)
    return JSONResponse({"input_tokens": len(call.prompt.ids)})


routes = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
