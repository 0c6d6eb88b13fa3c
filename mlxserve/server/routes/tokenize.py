"""POST /tokenize and POST /detokenize: the exact tokens and text the engine would see.

A chat body (``messages``, with the same thinking and tool controls as chat
completions) goes through the same prompt builder as `/v1/chat/completions`; a
completion body (``prompt``) through the same encoding as `/v1/completions`. The
answer has vLLM's and SGLang's shape: ``tokens``, ``count``, ``max_model_len`` and,
here, the ``prompt`` text too, so a user can check the format the model is given.
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
from mlxserve.server.routes.common import parse_body, runtime_of


async def tokenize(request: Request) -> Response:
    runtime = runtime_of(request)
    kind = await parse_body(request, TokenizeKind)
    if (kind.messages is None) == (kind.prompt is None):
        raise InvalidRequest(
            "send either 'messages' (chat) or 'prompt' (completion)", param="messages"
        )
    codec = runtime.codec
    if kind.messages is not None:
        prompt = (await read_chat(request, ChatCompletionRequest, as_chat)).prompt
        ids, text = prompt.ids, prompt.text
    else:
        completion = await parse_body(request, CompletionRequest)
        runtime.generations.check_model(completion.model)
        single = completion.single_prompt()
        if isinstance(single, str):
            ids, text = codec.text_ids(single), single
        else:
            ids = runtime.generations.checked_ids(single, param="prompt")
            text = codec.decode(ids)
    body: dict[str, Any] = {
        "tokens": ids,
        "count": len(ids),
        "max_model_len": runtime.context_length(),
        "prompt": text,
    }
    return JSONResponse(body)


async def detokenize(request: Request) -> Response:
    runtime = runtime_of(request)
    body = await parse_body(request, DetokenizeRequest)
    runtime.generations.check_model(body.model)
    ids = runtime.generations.checked_ids(body.tokens, param="tokens")
    return JSONResponse({"prompt": runtime.codec.decode(ids)})


routes = [
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
]
