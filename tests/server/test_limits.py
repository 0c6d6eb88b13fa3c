"""The body limit, as middleware on a bare app (declared and streamed bodies)."""

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from mlxserve.server.errors import APIError, handle_api_error
from mlxserve.server.limits import BodySizeLimit


async def echo_size(request: Request) -> Response:
    return PlainTextResponse(str(len(await request.body())))


def make_client() -> TestClient:
    app = Starlette(
        routes=[Route("/", echo_size, methods=["POST"])],
        exception_handlers={APIError: handle_api_error},
    )
    return TestClient(BodySizeLimit(app, max_bytes=100))


def test_at_the_limit_passes() -> None:
    assert make_client().post("/", content=b"x" * 100).text == "100"


def test_declared_length_over_the_limit_is_413() -> None:
    response = make_client().post("/", content=b"x" * 101)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_streamed_body_over_the_limit_is_413() -> None:
    def chunks():  # type: ignore[no-untyped-def]
        for _ in range(5):
            yield b"x" * 30

    assert make_client().post("/", content=chunks()).status_code == 413
