"""POST /v1/responses: the OpenAI Responses API, for text and function calls.

A thin codec over the chat path (prompt, grammar, generation, answer splitting):
the pieces become output items (``reasoning``, ``message``, ``function_call``),
whole or as the Responses event sequence (``response.created``, per item
``response.output_item.added`` ... ``response.output_item.done``, then
``response.completed``), each event numbered.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxserve.chat import Content, Piece, Reasoning
from mlxserve.server.errors import APIError, InvalidRequest
from mlxserve.server.generation import Delta, Prepared
from mlxserve.server.responses_protocol import ResponsesRequest, to_chat
from mlxserve.server.routes.chat import Answer
from mlxserve.server.routes.chat_call import ChatCall, read_generation
from mlxserve.server.routes.common import (
    CLIENT_CLOSED,
    ClientGone,
    backend_header,
    collect_each,
    with_first,
)
from mlxserve.server.sse import typed_sse_response


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Items:
    """Output items as pieces arrive, and the events that build them."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence, **fields}

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _start(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[dict[str, Any]]:
        events = self.close()
        self.items.append(item)
        self.open = item
        events.append(
            self.event(
                "response.output_item.added",
                output_index=len(self.items) - 1,
                item=dict(item, content=[]) if "content" in item else dict(item),
            )
        )
        if part is not None:
            item["content"].append(part)
            events.append(
                self.event(
                    "response.content_part.added", **self._where(), content_index=0, part=dict(part)
                )
            )
        return events

    def close(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        self.open = item
        where = self._where()
        self.open = None
        events: list[dict[str, Any]] = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(
                self.event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            events.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events.append(
                self.event(
                    "response.reasoning_text.done", **where, content_index=0, text=part["text"]
                )
            )
            events.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
        item["status"] = "completed"
        events.append(
            self.event("response.output_item.done", output_index=where["output_index"], item=item)
        )
        return events

    def piece(self, piece: Piece) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item: dict[str, Any]
        if isinstance(piece, Reasoning):
            if self.open is None or self.open["type"] != "reasoning":
                item = {
                    "id": _id("rs"),
                    "type": "reasoning",
                    "summary": [],
                    "content": [],
                    "status": "in_progress",
                }
                events += self._start(item, {"type": "reasoning_text", "text": ""})
            assert self.open is not None
            self.open["content"][0]["text"] += piece.text
            events.append(
                self.event(
                    "response.reasoning_text.delta",
                    **self._where(),
                    content_index=0,
                    delta=piece.text,
                )
            )
        elif isinstance(piece, Content):
            if self.open is None or self.open["type"] != "message":
                item = {
                    "id": _id("msg"),
                    "type": "message",
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [],
                }
                events += self._start(item, {"type": "output_text", "text": "", "annotations": []})
            assert self.open is not None
            self.open["content"][0]["text"] += piece.text
            events.append(
                self.event(
                    "response.output_text.delta",
                    **self._where(),
                    content_index=0,
                    delta=piece.text,
                    logprobs=[],
                )
            )
        else:
            item = {
                "id": _id("fc"),
                "type": "function_call",
                "call_id": piece.id,
                "name": piece.name,
                "arguments": "",
                "status": "in_progress",
            }
            events += self._start(item, None)
            for fragment in piece.fragments:
                item["arguments"] += fragment
                events.append(
                    self.event(
                        "response.function_call_arguments.delta", **self._where(), delta=fragment
                    )
                )
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    **self._where(),
                    arguments=item["arguments"],
                )
            )
            events += self.close()
        return events


def _response(
    head: dict[str, Any], items: list[dict[str, Any]], last: Delta | None, answer: Answer
) -> dict[str, Any]:
    response = dict(head, output=items)
    if last is None:
        return response
    incomplete = last.finish_reason == "length"
    response["status"] = "incomplete" if incomplete else "completed"
    response["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
    response["completed_at"] = time.time()
    usage = answer.usage(last)
    details = usage.completion_tokens_details or {}
    response["usage"] = {
        "input_tokens": last.prompt_tokens,
        "input_tokens_details": {"cached_tokens": last.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": last.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
        "total_tokens": last.prompt_tokens + last.completion_tokens,
    }
    return response


def _prepare(call: ChatCall[ResponsesRequest]) -> Prepared:
    """The route's checks and its generation (in a worker thread: see `read_generation`)."""
    given = call.body.input
    call.refuse_prefill(f"input.{len(given) - 1}" if isinstance(given, list) else "input")
    return call.prepare(call.grammar(), limit_param="max_output_tokens")


#: The chat request's names of the fields a Responses request names otherwise, for the
#: refusals of its prompt's format (`mlxserve.chat`).
_NAMES = {
    "reasoning_effort": "reasoning.effort",
    "thinking.budget_tokens": "reasoning.budget_tokens",
    "thinking": "reasoning.budget_tokens",  # what turns thinking on here
}


async def responses(request: Request) -> Response:
    try:
        call, prepared = await read_generation(
            request, ResponsesRequest, to_chat, _prepare, prompt_param="input"
        )
    except InvalidRequest as exc:
        old = exc.param or ""
        name = _NAMES.get(old)
        if name is None:
            raise
        if exc.message.startswith(old):
            exc.message = name + exc.message[len(old) :]
        exc.param = name
        raise
    body, prompt = call.body, call.prompt
    generations = call.runtime.generations
    head: dict[str, Any] = {
        "id": f"resp_{prepared.request_id}",
        "object": "response",
        "created_at": time.time(),
        "status": "in_progress",
        "model": body.model,
        "output": [],
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": body.model_dump(mode="json")["tool_choice"] or "auto",
        "tools": [tool.model_dump(mode="json", exclude_none=True) for tool in body.tools or []],
        "temperature": body.temperature,
        "top_p": body.top_p,
        "metadata": body.metadata or {},
        "store": False,
        "error": None,
        "incomplete_details": None,
    }
    answer = Answer(prompt, call.runtime.tokenizer)
    items = _Items()
    deltas = generations.run(prepared)
    first = await anext(deltas)  # the first token, or the error with its real status
    if not body.stream:
        last: list[Delta] = []

        def add(delta: Delta) -> None:
            for piece in answer.add(delta):
                items.piece(piece)
            if delta.finish_reason is not None:
                items.close()
                last.append(delta)

        try:
            await collect_each(with_first(first, deltas), request, add)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        reply = _response(head, items.items, last[0], answer)
        return JSONResponse(reply, headers=backend_header(last[0]))
    events = _events(with_first(first, deltas), head, answer, items)
    return typed_sse_response(events, _error, headers=backend_header(first))


def _error(error: APIError) -> dict[str, Any]:
    return {"type": "error", "code": error.code, "message": error.message, "param": error.param}


async def _events(
    deltas: AsyncGenerator[Delta, None], head: dict[str, Any], answer: Answer, items: _Items
) -> AsyncGenerator[dict[str, Any], None]:
    try:
        yield items.event("response.created", response=_response(head, [], None, answer))
        yield items.event("response.in_progress", response=_response(head, [], None, answer))
        async for delta in deltas:
            for piece in answer.add(delta):
                for event in items.piece(piece):
                    yield event
            if delta.finish_reason is not None:
                for event in items.close():
                    yield event
                final = _response(head, items.items, delta, answer)
                kind = (
                    "response.incomplete"
                    if final["status"] == "incomplete"
                    else "response.completed"
                )
                yield items.event(kind, response=final)
    finally:
        await deltas.aclose()


routes = [Route("/v1/responses", responses, methods=["POST"])]
