"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxserve.server.generation import Delta
from mlxserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
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

ROLE_ALIASES = {"developer": "system"}


async def chat_completions(request: Request) -> Response:
    runtime = runtime_of(request)
    body = await parse_body(request, ChatCompletionRequest)
    generations = runtime.generations
    generations.check_model(body.model)
    messages = [
        {"role": ROLE_ALIASES.get(m.role, m.role), "content": m.text()} for m in body.messages
    ]
    prepared = generations.prepare(
        runtime.codec.chat_ids(messages),
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
    if not body.stream:
        try:
            text, last = await collect(deltas, request)
        except ClientGone:  # nobody to answer; the generation was cancelled
            return Response(status_code=CLIENT_CLOSED)
        completion = ChatCompletion(
            **meta,
            choices=[
                ChatChoice(
                    message=AssistantMessage(content=text),
                    finish_reason=last.finish_reason or "stop",
                )
            ],
            usage=usage_of(last),
            speculative=last.speculative,
        )
        return JSONResponse(dump(completion), headers=backend_header(last))
    first = await anext(deltas)  # the first token, or the error with its real status
    chunks = _chunks(with_first(first, deltas), meta, body.include_usage)
    return sse_response(chunks, headers=backend_header(first))


async def _chunks(
    deltas: AsyncGenerator[Delta, None], meta: dict[str, Any], include_usage: bool
) -> AsyncGenerator[dict[str, Any], None]:
    def chunk(delta: ChatDelta, finish: str | None = None) -> dict[str, Any]:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish)
        return dump(ChatCompletionChunk(**meta, choices=[choice]))

    first = True
    try:
        async for delta in deltas:
            if first:
                first = False
                yield chunk(ChatDelta(role="assistant", content=delta.text))
            elif delta.text:
                yield chunk(ChatDelta(content=delta.text))
            if delta.finish_reason is not None:
                yield chunk(ChatDelta(), delta.finish_reason)
                if include_usage:
                    yield dump(ChatCompletionChunk(**meta, choices=[], usage=usage_of(delta)))
    finally:
        await deltas.aclose()


routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"])]
