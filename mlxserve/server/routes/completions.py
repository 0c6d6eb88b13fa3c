"""POST /v1/completions (text or token-id prompt)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxserve.channel.request import TokenLogprob
from mlxserve.server.choices import fan_out
from mlxserve.server.generation import Delta, Generations, Prepared
from mlxserve.server.logprobs import completion_logprobs
from mlxserve.server.protocol import Completion, CompletionChoice, CompletionRequest, Usage
from mlxserve.server.routes.common import (
    CLIENT_CLOSED,
    ClientGone,
    backend_header,
    collect_choices,
    dump,
    off_loop,
    parse_body,
    runtime_of,
    sampling_of,
    total_usage,
    usage_of,
    with_first,
)
from mlxserve.server.running_usage import RunningUsage
from mlxserve.server.sse import sse_response
from mlxserve.server.tokenizer import FrontTokenizer


def _prepare(generations: Generations, body: CompletionRequest) -> Prepared:
    """The checked generation: tokenizing and checks, in a worker thread (see
    `mlxserve.server.workers`); a text too long for the context is refused from its
    size, before it is tokenized."""
    generations.check_model(body.model)
    prompt = body.single_prompt()
    if isinstance(prompt, str):
        prompt_ids = generations.prompt_ids(prompt, param="prompt")
    else:
        prompt_ids = prompt
    return generations.prepare(
        prompt_ids,
        max_tokens=body.max_tokens,
        sampling=sampling_of(body, body.logprobs),
        stops=body.stop_strings(),
        ignore_eos=bool(body.ignore_eos),
        prompt_param="prompt",
        continues_prompt=True,
    )


async def completions(request: Request) -> Response:
    runtime = runtime_of(request)
    body = await parse_body(request, CompletionRequest)
    generations = runtime.generations
    prepared = await off_loop(request, _prepare, generations, body)
    meta: dict[str, Any] = {
        "id": f"cmpl-{prepared.request_id}",
        "created": int(time.time()),
        "model": body.model,
    }
    n = body.n or 1
    tagged = fan_out(generations, prepared, n)
    first = await anext(tagged)  # the first token, or the error with its real status
    if not body.stream:
        texts: list[list[str]] = [[] for _ in range(n)]
        records: list[list[TokenLogprob]] = [[] for _ in range(n)]

        def add(index: int, delta: Delta) -> None:
            texts[index].append(delta.text)
            records[index] += delta.logprobs or ()

        try:
            lasts = await collect_choices(first, tagged, request, add)
        except ClientGone:  # nobody to answer; the generation was cancelled
            return Response(status_code=CLIENT_CLOSED)
        choices = [
            CompletionChoice(
                index=i,
                text="".join(texts[i]),
                finish_reason=lasts[i].finish_reason or "stop",
                logprobs=_logprobs(runtime.tokenizer, records[i], body.logprobs),
            )
            for i in range(n)
        ]
        last = lasts[0]
        usage = total_usage([usage_of(lasts[i]) for i in range(n)])
        completion = Completion(**meta, choices=choices, usage=usage, speculative=last.speculative)
        return JSONResponse(dump(completion), headers=backend_header(last))
    running = RunningUsage(prepared.prompt_tokens, body.continuous_usage)
    chunks = _chunks(
        first, tagged, meta, body.include_usage, runtime.tokenizer, body.logprobs, running
    )
    return sse_response(chunks, headers=backend_header(first[1]))


def _logprobs(
    tokenizer: FrontTokenizer, records: list[TokenLogprob], asked: int | None, offset: int = 0
) -> dict[str, Any] | None:
    return None if asked is None else completion_logprobs(tokenizer, records, offset)


async def _chunks(
    first: tuple[int, Delta],
    rest: AsyncGenerator[tuple[int, Delta], None],
    meta: dict[str, Any],
    include_usage: bool,
    tokenizer: FrontTokenizer,
    logprobs: int | None,
    running: RunningUsage,
) -> AsyncGenerator[dict[str, Any], None]:
    started: set[int] = set()
    offsets: dict[int, int] = {}
    usages: dict[int, Usage] = {}

    try:
        async for index, delta in with_first(first, rest):
            running.add(index, delta)
            if delta.text or delta.finish_reason is not None or index not in started:
                started.add(index)
                offset = offsets.get(index, 0)
                choice = CompletionChoice(
                    index=index,
                    text=delta.text,
                    finish_reason=delta.finish_reason,
                    logprobs=_logprobs(tokenizer, list(delta.logprobs or ()), logprobs, offset),
                )
                offsets[index] = offset + len(delta.text)
                yield dump(Completion(**meta, choices=[choice], usage=running.of(index)))
            if delta.finish_reason is not None:
                usages[index] = usage_of(delta)
        if include_usage and usages:
            usage = total_usage([usages[i] for i in sorted(usages)])
            yield dump(Completion(**meta, choices=[], usage=usage))
    finally:
        await rest.aclose()


routes = [Route("/v1/completions", completions, methods=["POST"])]
