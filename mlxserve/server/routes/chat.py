"""POST /v1/chat/completions.

The prompt comes from `mlxserve.chat` (template, DeepSeek-V4 encoder or transcript);
the answer's text goes through `ChatOutput`, which splits off the reasoning and
reads tool calls, so the same pieces make a `message` or a stream of `delta`s.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxserve.channel.request import TokenLogprob
from mlxserve.chat import ChatOutput, ChatPrompt, Content, ParsedToolCall, Piece, Reasoning
from mlxserve.server.choices import fan_out
from mlxserve.server.errors import InvalidRequest
from mlxserve.server.generation import Delta, Prepared
from mlxserve.server.logprobs import chat_logprobs
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
from mlxserve.server.routes.chat_call import ChatCall, as_chat, read_generation
from mlxserve.server.routes.common import (
    CLIENT_CLOSED,
    ClientGone,
    backend_header,
    collect_choices,
    dump,
    total_usage,
    usage_of,
    with_first,
)
from mlxserve.server.running_usage import RunningUsage
from mlxserve.server.sse import sse_response
from mlxserve.server.tokenizer import FrontTokenizer


def chat_logprobs_count(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def _prepare(call: ChatCall[ChatCompletionRequest]) -> Prepared:
    """The route's checks and its generation (in a worker thread: see `read_generation`)."""
    body = call.body
    call.refuse_prefill(f"messages.{len(body.messages) - 1}.role")
    grammar = call.grammar()  # a bad response format is refused before bad logprobs
    limit_param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    return call.prepare(grammar, limit_param=limit_param, logprobs=chat_logprobs_count(body))


async def chat_completions(request: Request) -> Response:
    call, prepared = await read_generation(request, ChatCompletionRequest, as_chat, _prepare)
    body, prompt, tokenizer = call.body, call.prompt, call.runtime.tokenizer
    generations = call.runtime.generations
    meta: dict[str, Any] = {
        "id": f"chatcmpl-{prepared.request_id}",
        "created": int(time.time()),
        "model": body.model,
    }
    n = body.n or 1
    answers = [Answer(prompt, tokenizer) for _ in range(n)]
    tagged = fan_out(generations, prepared, n)
    first = await anext(tagged)  # the first token, or the error with its real status
    if not body.stream:
        try:
            lasts = await collect_choices(
                first, tagged, request, lambda index, delta: answers[index].add(delta)
            )
        except ClientGone:  # nobody to answer; the generation was cancelled
            return Response(status_code=CLIENT_CLOSED)
        choices = [
            ChatChoice(
                index=i,
                message=answer.message(),
                finish_reason=answer.finish(lasts[i]),
                logprobs=answer.logprobs_dict(),
            )
            for i, answer in enumerate(answers)
        ]
        last = lasts[0]
        completion = ChatCompletion(
            **meta,
            choices=choices,
            usage=total_usage([a.usage(lasts[i]) for i, a in enumerate(answers)]),
            speculative=last.speculative,
        )
        return JSONResponse(dump(completion), headers=backend_header(last))
    running = RunningUsage(prepared.prompt_tokens, body.continuous_usage)
    chunks = _chunks(with_first(first, tagged), meta, answers, body.include_usage, running)
    return sse_response(chunks, headers=backend_header(first[1]))


@dataclass
class Answer:
    """One answer's pieces as they come, and what its end reports."""

    prompt: ChatPrompt
    tokenizer: FrontTokenizer
    output: ChatOutput = field(init=False)
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None

    def __post_init__(self) -> None:
        parser = self.prompt.tool_parser() if self.prompt.tool_parser else None
        forced = self.prompt.forced is not None
        self.output = ChatOutput(
            reasoning_end=self.prompt.reasoning_end, tools=parser, forced=forced
        )

    def add(self, delta: Delta) -> list[Piece]:
        if delta.logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *delta.logprobs]
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

    def logprobs_dict(self, records: Sequence[TokenLogprob] | None = None) -> dict[str, Any] | None:
        records = self.logprobs if records is None else records
        return None if records is None else chat_logprobs(self.tokenizer, records)

    def finish(self, last: Delta) -> str:
        reason = last.finish_reason or "stop"
        return "tool_calls" if self.output.tool_calls and reason == "stop" else reason

    def usage(self, last: Delta) -> Usage:
        usage = usage_of(last)
        marker = self.prompt.reasoning_end
        if marker is not None:
            ids = list(last.token_ids)
            through = self.tokenizer.tokens_through(ids, marker)
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
    deltas: AsyncGenerator[tuple[int, Delta], None],
    meta: dict[str, Any],
    answers: list[Answer],
    include_usage: bool,
    running: RunningUsage,
) -> AsyncGenerator[dict[str, Any], None]:
    def chunk(
        index: int,
        delta: ChatDelta,
        finish: str | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)
        return dump(ChatCompletionChunk(**meta, choices=[choice], usage=running.of(index)))

    usages: dict[int, Usage] = {}
    try:
        for index in range(len(answers)):
            yield chunk(index, ChatDelta(role="assistant", content=""))
        async for index, delta in deltas:
            answer = answers[index]
            running.add(index, delta)
            calls_before = len(answer.output.tool_calls)
            logprobs = answer.logprobs_dict(delta.logprobs) if delta.logprobs else None
            piece_deltas = _piece_deltas(answer.add(delta), calls_before)
            if logprobs is not None and not piece_deltas:
                piece_deltas = [ChatDelta(content="")]  # the tokens' logprobs, text held back
            for number, piece_delta in enumerate(piece_deltas):
                yield chunk(index, piece_delta, logprobs=logprobs if number == 0 else None)
            if delta.finish_reason is not None:
                yield chunk(index, ChatDelta(), answer.finish(delta))
                usages[index] = answer.usage(delta)
        if include_usage and usages:
            usage = total_usage([usages[i] for i in sorted(usages)])
            yield dump(ChatCompletionChunk(**meta, choices=[], usage=usage))
    finally:
        await deltas.aclose()


routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"])]
