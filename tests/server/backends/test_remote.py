"""The remote backend against a fake OpenAI-compatible server (in process, no network),
and against another mlxserve on a loopback port."""

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlxserve.channel.request import GenerationParams, Reasoning
from mlxserve.server.app import create_app
from mlxserve.server.backends.base import (
    BackendError,
    BackendRejected,
    BackendRequestFailed,
    BackendUnavailable,
    Finished,
    Tokens,
)
from mlxserve.server.backends.remote import RemoteBackend, completion_body
from mlxserve.server.tokenizer import FrontTokenizer
from tests.server.conftest import make_runtime
from tests.server.fakes import FakeBackend
from tests.server.test_request_walk import ALL_FIELDS, field_of, with_field

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


def remote(
    tokenizer: FrontTokenizer, app: Starlette, api_key: str | None = "secret"
) -> RemoteBackend:
    return RemoteBackend(
        "remote",
        "http://fake/v1",
        tokenizer=tokenizer,
        api_key=api_key,
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


def test_streams_text_as_tokens(tokenizer: FrontTokenizer) -> None:
    app = fake_server()
    backend = remote(tokenizer, app)
    prompt = tokenizer.text_ids("Say hello")
    events = asyncio.run(collect(backend, prompt))
    assert backend.info is not None and backend.info.context_length == 1024
    tokens = [t for e in events if isinstance(e, Tokens) for t in e.token_ids]
    assert tokenizer.decode(tokens) == "".join(PIECES)
    assert isinstance(events[-1], Finished) and events[-1].reason == "length"
    sent = app.state.seen[0]
    assert sent["prompt"] == "Say hello" and sent["model"] == "remote-model"
    assert sent["stream"] is True and sent["max_tokens"] == 8


@pytest.mark.parametrize(("status", "error"), [(503, BackendUnavailable), (400, BackendRejected)])
def test_status_codes_map_to_retry_or_not(
    tokenizer: FrontTokenizer, status: int, error: type
) -> None:
    with pytest.raises(error):
        asyncio.run(collect(remote(tokenizer, fake_server(status)), [1, 2]))


def test_a_stream_without_finish_is_a_failure(tokenizer: FrontTokenizer) -> None:
    with pytest.raises(BackendUnavailable):
        asyncio.run(collect(remote(tokenizer, fake_server(finish=False)), [1, 2]))


# -- every field of the request reaches the remote --------------------------------------


@asynccontextmanager
async def mlxserve_remote(tokenizer: FrontTokenizer) -> AsyncIterator[tuple[str, FakeBackend]]:
    """Another mlxserve (its front, a fake engine behind it) on a loopback port: its URL
    and its backend, whose calls are what the remote made of the requests it got."""
    engine = FakeBackend("engine").up()
    app = create_app(make_runtime(tokenizer, [engine]))
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="warning")
    )
    serving = asyncio.create_task(server.serve())
    while not server.started:
        assert not serving.done(), "the remote did not start"
        await asyncio.sleep(0.01)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    try:
        yield f"http://{host}:{port}/v1", engine
    finally:
        server.should_exit = True
        await serving


async def send_each(
    tokenizer: FrontTokenizer, variants: dict[str, GenerationParams]
) -> dict[str, GenerationParams | str]:
    """Each variant through a `RemoteBackend` over real HTTP: what the remote's engine
    got (or the refusal's message), by variant."""
    got: dict[str, GenerationParams | str] = {}
    async with mlxserve_remote(tokenizer) as (url, engine):
        backend = RemoteBackend(
            "fallback",
            url,
            tokenizer=tokenizer,
            api_key=None,
            request_timeout_s=10,
            context_length=256,
        )
        await backend.start()
        try:
            for name, params in variants.items():
                calls = len(engine.calls)
                try:
                    events = [e async for e in backend.generate(name, params)]
                except BackendRejected as exc:
                    got[name] = str(exc)
                    assert len(engine.calls) == calls  # refused before it was sent
                    continue
                assert isinstance(events[-1], Finished)
                got[name] = engine.calls[-1]
        finally:
            await backend.stop()
    return got


def test_every_field_reaches_a_remote_mlxserve_or_is_refused_by_name(
    tokenizer: FrontTokenizer,
) -> None:
    """Walks every field of `GenerationParams` and its `SamplingParams` (a new one fails
    here until it is carried or refused): each, set alone to a value other than the
    baseline's, must reach the remote's engine as sent, the whole request otherwise
    unchanged."""
    prompt = tuple(tokenizer.text_ids("Tell me about the sea"))
    eos = (5,)  # the fake engine's, which the remote front stops at by default
    base = GenerationParams(prompt_ids=prompt, max_tokens=4, stop_token_ids=eos)
    samples: dict[str, object] = {
        "prompt_ids": tuple(tokenizer.text_ids("Another prompt, about the hills")),
        "max_tokens": 7,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 1234,
        "stop_token_ids": (),  # ignore_eos: what 5 of 8 resumed streams lost
        "top_k": 7,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.2,
        "logit_bias": ((11, 2.5), (12, -100.0)),
        "logprobs": 2,
        "grammar": '{"grammars": [{"lark_grammar": "start: \\"a\\""}]}',
        # A resume: the tokens already sent end the prompt, which carries them.
        "grammar_prefix": prompt[-2:],
        "reasoning": Reasoning(end_ids=(7, 8), budget_tokens=3),  # a thinking budget
    }
    refused = {"logprobs", "grammar", "reasoning"}
    assert set(samples) == ALL_FIELDS, "a field has no sample"
    variants = {"baseline": base} | {
        name: with_field(base, name, value) for name, value in samples.items()
    }
    for name, value in samples.items():
        assert field_of(base, name) != value, f"{name}: the sample is the baseline's value"
    got = asyncio.run(send_each(tokenizer, variants))
    assert got["baseline"] == base
    for name, value in samples.items():
        if name in refused:
            assert isinstance(got[name], str) and name in got[name], got[name]
        elif name == "grammar_prefix":
            assert got[name] == base  # the prompt holds it; without a grammar it is inert
        else:
            assert got[name] == with_field(base, name, value), name


def test_ignore_eos_is_sent_only_when_asked(tokenizer: FrontTokenizer) -> None:
    """A plain request carries no vendor extension, so a strict server takes it."""
    params = GenerationParams(prompt_ids=(1, 2), max_tokens=3, stop_token_ids=(5,))
    assert set(completion_body(params, "m", "p")) == {
        "model", "prompt", "max_tokens", "temperature", "top_p", "stream", "stream_options"
    }  # fmt: skip
    assert completion_body(replace(params, stop_token_ids=()), "m", "p")["ignore_eos"] is True


# -- failures, classified as the remote states them ---------------------------------------


def failing_server(status: int, error: dict[str, object], in_band: bool = False) -> Starlette:
    """A remote that answers `status` with `error`, or (in_band) streams one piece and
    then `error` as an event, as mlxserve does after a stream has started."""

    async def models(request: Request) -> Response:
        return JSONResponse({"data": [{"id": "remote-model"}]})

    async def completions(request: Request) -> Response:
        if not in_band:
            return JSONResponse({"error": error}, status_code=status)

        async def body():  # type: ignore[no-untyped-def]
            choice = {"index": 0, "text": "Hello", "finish_reason": None}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            yield f"data: {json.dumps({'error': error})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )


FAILED = {"message": "grammar: no way forward", "type": "internal_error", "code": "request_failed"}
DOWN = {"message": "no healthy backend", "code": "no_healthy_backend"}
BUG = {"message": "internal server error", "type": "internal_error", "code": "internal_error"}


@pytest.mark.parametrize(
    ("status", "error", "in_band", "kind"),
    [
        (500, FAILED, False, BackendRequestFailed),
        (200, FAILED, True, BackendRequestFailed),
        (503, DOWN, False, BackendUnavailable),
        (200, DOWN, True, BackendUnavailable),
        (500, BUG, False, BackendUnavailable),
        (429, DOWN, False, BackendUnavailable),
        (400, {"message": "bad", "code": "invalid_value"}, False, BackendRejected),
    ],
)
def test_a_remote_failure_is_classified_as_it_states_it(
    tokenizer: FrontTokenizer, status: int, error: dict[str, object], in_band: bool, kind: type
) -> None:
    app = failing_server(status, error, in_band)
    with pytest.raises(BackendError) as caught:
        asyncio.run(collect(remote(tokenizer, app, api_key=None), [1, 2]))
    assert type(caught.value) is kind
    assert str(error["message"]) in str(caught.value)
