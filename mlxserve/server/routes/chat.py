"""POST /v1/chat/completions.

The prompt comes from `chat_prompt` (template, DeepSeek-V4 encoder or transcript);
the answer's text goes through `ChatOutput`, which splits off the reasoning and
reads tool calls, so the same pieces make a `message` or a stream of `delta`s.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxserve.models.tool_calls import ParsedToolCall
from mlxserve.server.chat_output import ChatOutput, Content, Piece, Reasoning
from mlxserve.server.chat_prompt import ChatPrompt, build_chat_prompt
from mlxserve.server.codec import Codec
from mlxserve.server.generation import Delta
from mlxserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    FunctionDelta,
    ToolCallOut,
    Usage,
)
from mlxserve.server.routes.common import (
    CLIENT_CLOSED,
    ClientGone,
    backend_header,
    collect,
    dump,
    parse_body,
    runtime_of,
    usage_of,
    with_first,
)
from mlxserve.server.sse import sse_response


async def chat_completions(request: Request) -> Response:
    runtime = runtime_of(request)
    body = await parse_body(request, ChatCompletionRequest)
    generations = runtime.generations
    generations.check_model(body.model)
    prompt = build_chat_prompt(body, runtime.codec, runtime.settings.chat.thinking)
    prepared = generations.prepare(
        prompt.ids,
        max_tokens=body.token_limit,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stops=body.stop_strings(),
        ignore_eos=bool(body.ignore_eos),
        limit_param="max_completion_tokens" if body.max_completion_tokens else "max_tokens",
    )
    meta: dict[str, Any] = {
        "id": f"chatcmpl-{prepared.request_id}",
        "created": int(time.time()),
        "model": body.model,
    }
    deltas = generations.run(prepared)
    answer = _Answer(prompt, runtime.codec)
    if not body.stream:
        try:
            _, last = await collect(deltas, request, answer.add)
        except ClientGone:  # nobody to answer; the generation was cancelled
            return Response(status_code=CLIENT_CLOSED)
        completion = ChatCompletion(
            **meta,
            choices=[ChatChoice(message=answer.message(), finish_reason=answer.finish(last))],
            usage=answer.usage(last),
            speculative=last.speculative,
        )
        return JSONResponse(dump(completion), headers=backend_header(last))
    first = await anext(deltas)  # the first token, or the error with its real status
    chunks = _chunks(with_first(first, deltas), meta, answer, body.include_usage)
    return sse_response(chunks, headers=backend_header(first))


@dataclass
class _Answer:
    """One answer's pieces as they come, and what its end reports."""

    prompt: ChatPrompt
    codec: Codec
    output: ChatOutput = field(init=False)
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        parser = self.prompt.tool_parser() if self.prompt.tool_parser else None
        self.output = ChatOutput(reasoning_end=self.prompt.reasoning_end, tools=parser)

    def add(self, delta: Delta) -> list[Piece]:
        pieces = self.output.push(delta.text)
        if delta.finish_reason is not None:
            pieces += self.output.finish()
        for piece in pieces:
            if isinstance(piece, Reasoning):
                self.reasoning.append(piece.text)
            elif isinstance(piece, Content):
                self.content.append(piece.text)
        return pieces

    def message(self) -> AssistantMessage:
        calls = self.output.tool_calls
        content = "".join(self.content)
        return AssistantMessage(
            content=content if content or not calls else None,
            reasoning_content="".join(self.reasoning) if self.prompt.reasoning_end else None,
            tool_calls=[_call_out(call) for call in calls] or None,
        )

    def finish(self, last: Delta) -> str:
        reason = last.finish_reason or "stop"
        return "tool_calls" if self.output.tool_calls and reason == "stop" else reason

    def usage(self, last: Delta) -> Usage:
        usage = usage_of(last)
        marker = self.prompt.reasoning_end
        if marker is not None:
            ids = list(last.token_ids)
            through = self.codec.tokens_through(ids, marker)
            reasoning = len(ids) if through is None else through
            usage.completion_tokens_details = {"reasoning_tokens": reasoning}
        return usage


def _call_out(call: ParsedToolCall) -> ToolCallOut:
    function = FunctionDelta(name=call.name, arguments=call.arguments)
    return ToolCallOut(id=call.id, type="function", function=function)


def _piece_deltas(pieces: list[Piece], calls_before: int) -> list[ChatDelta]:
    deltas: list[ChatDelta] = []
    index = calls_before
    for piece in pieces:
        if isinstance(piece, Reasoning):
            deltas.append(ChatDelta(reasoning_content=piece.text))
        elif isinstance(piece, Content):
            deltas.append(ChatDelta(content=piece.text))
        else:
            head = FunctionDelta(name=piece.name, arguments="")
            deltas.append(
                ChatDelta(
                    tool_calls=[
                        ToolCallOut(index=index, id=piece.id, type="function", function=head)
                    ]
                )
            )
            for fragment in piece.fragments:
                part = ToolCallOut(index=index, function=FunctionDelta(arguments=fragment))
                deltas.append(ChatDelta(tool_calls=[part]))
            index += 1
    return deltas


async def _chunks(
    deltas: AsyncGenerator[Delta, None],
    meta: dict[str, Any],
    answer: _Answer,
    include_usage: bool,
) -> AsyncGenerator[dict[str, Any], None]:
    def chunk(delta: ChatDelta, finish: str | None = None) -> dict[str, Any]:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish)
        return dump(ChatCompletionChunk(**meta, choices=[choice]))

    try:
        yield chunk(ChatDelta(role="assistant", content=""))
        async for delta in deltas:
            calls_before = len(answer.output.tool_calls)
            for piece_delta in _piece_deltas(answer.add(delta), calls_before):
                yield chunk(piece_delta)
            if delta.finish_reason is not None:
                yield chunk(ChatDelta(), answer.finish(delta))
                if include_usage:
                    usage = answer.usage(delta)
                    yield dump(ChatCompletionChunk(**meta, choices=[], usage=usage))
    finally:
        await deltas.aclose()


routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"])]
