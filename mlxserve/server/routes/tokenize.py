"""POST /tokenize and POST /detokenize: the exact tokens and text the engine would see.

A chat body (``messages``, with the same thinking and tool controls as chat
completions) goes through the same prompt builder as `/v1/chat/completions`; a
completion body (``prompt``) through the same encoding as `/v1/completions`. The
answer has vLLM's and SGLang's shape: ``tokens``, ``count``, ``max_model_len`` and,
here, the ``prompt`` text too, so a user can check the format the model is given.
A prompt is tokenized whatever its length (nothing is generated from it), in the
runtime's worker threads, as is the answer's JSON: never on the event loop.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxserve.server.errors import InvalidRequest
from mlxserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeKind,
)
from mlxserve.server.routes.chat_call import as_chat, read_chat
from mlxserve.server.routes.common import off_loop, parse_body, runtime_of
from mlxserve.server.runtime import Runtime


async def tokenize(request: Request) -> Response:
    runtime = runtime_of(request)
    kind = await parse_body(request, TokenizeKind)
    if (kind.messages is None) == (kind.prompt is None):
        raise InvalidRequest(
            "send either 'messages' (chat) or 'prompt' (completion)", param="messages"
        )
    if kind.messages is not None:
        prompt = (await read_chat(request, ChatCompletionRequest, as_chat)).prompt
        ids, text = prompt.ids, prompt.text
    else:
        completion = await parse_body(request, CompletionRequest)
        ids, text = await off_loop(request, _completion_tokens, runtime, completion)
    body: dict[str, Any] = {
        "tokens": ids,
        "count": len(ids),
        "max_model_len": runtime.context_length(),
        "prompt": text,
    }
    return await off_loop(request, JSONResponse, body)  # a long prompt's JSON takes time


def _completion_tokens(runtime: Runtime, body: CompletionRequest) -> tuple[list[int], str]:
    """A completion prompt's ids and text (blocking: a worker thread's job)."""
    runtime.generations.check_model(body.model)
    single = body.single_prompt()
    if isinstance(single, str):
        return runtime.tokenizer.text_ids(single), single
    ids = runtime.generations.checked_ids(single, param="prompt")
    return ids, runtime.tokenizer.decode(ids)


def _detokenized(runtime: Runtime, body: DetokenizeRequest) -> str:
    runtime.generations.check_model(body.model)
    ids = runtime.generations.checked_ids(body.tokens, param="tokens")
    return runtime.tokenizer.decode(ids)


async def detokenize(request: Request) -> Response:
    runtime = runtime_of(request)
    body = await parse_body(request, DetokenizeRequest)
    return JSONResponse({"prompt": await off_loop(request, _detokenized, runtime, body)})


routes = [
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
]
