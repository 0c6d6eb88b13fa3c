"""The remote backend against a fake OpenAI-compatible server (in process, no network)."""

import asyncio
import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlxserve.server.backends.base import (
    BackendRejected,
    BackendUnavailable,
    Finished,
    GenerationParams,
    Tokens,
)
from mlxserve.server.backends.remote import RemoteBackend
from mlxserve.server.codec import Codec

PIECES = ["Hello", " world", ", again"]


def fake_server(status: int = 200, finish: bool = True) -> Starlette:
    seen: list[dict[str, object]] = []

    async def models(request: Request) -> Response:
        assert request.headers["authorization"] == "Bearer secret"
        return JSONResponse({"data": [{"id": "remote-model", "context_length": 1024}]})

    async def completions(request: Request) -> Response:
        seen.append(await request.json())
        if status != 200:
            return JSONResponse({"error": {"message": "no"}}, status_code=status)

        async def body():  # type: ignore[no-untyped-def]
            for i, piece in enumerate(PIECES):
                last = finish and i == len(PIECES) - 1
                choice = {"index": 0, "text": piece, "finish_reason": "length" if last else None}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    app = Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )
    app.state.seen = seen
    return app


def remote(codec: Codec, app: Starlette) -> RemoteBackend:
    return RemoteBackend(
        "remote",
        "http://fake/v1",
        codec=codec,
        api_key="secret",
        request_timeout_s=5,
        context_length=4096,
        transport=httpx.ASGITransport(app=app),
    )


async def collect(backend: RemoteBackend, prompt: list[int]) -> list[object]:
    await backend.start()
    try:
        return [e async for e in backend.generate("r", GenerationParams(tuple(prompt), 8))]
    finally:
        await backend.stop()


def test_streams_text_as_tokens(codec: Codec) -> None:
    app = fake_server()
    backend = remote(codec, app)
    prompt = codec.text_ids("Say hello")
    events = asyncio.run(collect(backend, prompt))
    assert backend.info is not None and backend.info.context_length == 1024
    tokens = [t for e in events if isinstance(e, Tokens) for t in e.token_ids]
    assert codec.decode(tokens) == "".join(PIECES)
    assert isinstance(events[-1], Finished) and events[-1].reason == "length"
    sent = app.state.seen[0]
    assert sent["prompt"] == "Say hello" and sent["model"] == "remote-model"
    assert sent["stream"] is True and sent["max_tokens"] == 8


@pytest.mark.parametrize(("status", "error"), [(503, BackendUnavailable), (400, BackendRejected)])
def test_status_codes_map_to_retry_or_not(codec: Codec, status: int, error: type) -> None:
    with pytest.raises(error):
        asyncio.run(collect(remote(codec, fake_server(status)), [1, 2]))


def test_a_stream_without_finish_is_a_failure(codec: Codec) -> None:
    with pytest.raises(BackendUnavailable):
        asyncio.run(collect(remote(codec, fake_server(finish=False)), [1, 2]))
