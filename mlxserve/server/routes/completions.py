"""POST /v1/completions (text or token-id prompt)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxserve.server.generation import Delta
from mlxserve.server.protocol import Completion, CompletionChoice, CompletionRequest
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


async def completions(request: Request) -> Response:
    runtime = runtime_of(request)
    body = await parse_body(request, CompletionRequest)
    generations = runtime.generations
    generations.check_model(body.model)
    prompt = body.single_prompt()
    prompt_ids = runtime.codec.text_ids(prompt) if isinstance(prompt, str) else prompt
    prepared = generations.prepare(
        prompt_ids,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stops=body.stop_strings(),
        ignore_eos=bool(body.ignore_eos),
    )
    meta: dict[str, Any] = {
        "id": f"cmpl-{prepared.request_id}",
        "created": int(time.time()),
        "model": body.model,
    }
    deltas = generations.run(prepared)
    if not body.stream:
        try:
            text, last = await collect(deltas, request)
        except ClientGone:  # nobody to answer; the generation was cancelled
            return Response(status_code=CLIENT_CLOSED)
        choice = CompletionChoice(text=text, finish_reason=last.finish_reason or "stop")
        completion = Completion(
            **meta, choices=[choice], usage=usage_of(last), speculative=last.speculative
        )
        return JSONResponse(dump(completion), headers=backend_header(last))
    first = await anext(deltas)  # the first token, or the error with its real status
    chunks = _chunks(with_first(first, deltas), meta, body.include_usage)
    return sse_response(chunks, headers=backend_header(first))


async def _chunks(
    deltas: AsyncGenerator[Delta, None], meta: dict[str, Any], include_usage: bool
) -> AsyncGenerator[dict[str, Any], None]:
    first = True
    try:
        async for delta in deltas:
            if delta.text or delta.finish_reason is not None or first:
                first = False
                choice = CompletionChoice(text=delta.text, finish_reason=delta.finish_reason)
                yield dump(Completion(**meta, choices=[choice]))
            if delta.finish_reason is not None and include_usage:
                yield dump(Completion(**meta, choices=[], usage=usage_of(delta)))
    finally:
        await deltas.aclose()


routes = [Route("/v1/completions", completions, methods=["POST"])]
