"""Request bodies parse with limits: JSON nested too deep, or a number too long, is a 400
naming the field (never a 500, never a reset connection), in the route's error shape."""

import json
import time
from typing import Any

import pytest
from starlette.testclient import TestClient

from mlxserve.server.app import create_app
from mlxserve.server.errors import InvalidRequest
from mlxserve.server.json_limits import loads
from mlxserve.server.tokenizer import FrontTokenizer
from tests.server.conftest import make_runtime
from tests.server.fakes import FakeBackend
from tests.server.front import connect, post, read_response, running_front

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def nested(levels: int, inner: bytes = b"") -> bytes:
    return b"[" * levels + inner + b"]" * levels


def refusal(raw: bytes, max_depth: int = 64, max_number_chars: int = 64) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        loads(raw, max_depth=max_depth, max_number_chars=max_number_chars)
    return caught.value


# -- the parser ------------------------------------------------------------------------


def test_within_the_limits_parses_as_json_does() -> None:
    body = {"a": json.loads(nested(63)), "n": -(10**62), "f": 1.5e300, "s": "9" * 5000}
    raw = json.dumps(body).encode()
    assert loads(raw, max_depth=64, max_number_chars=64) == json.loads(raw)


@pytest.mark.parametrize("levels", [65, 1000, 100_000])
def test_too_deep_names_the_field(levels: int) -> None:
    raw = b'{"model": "demo", "messages": [{"content": ' + nested(levels) + b"}]}"
    error = refusal(raw)
    assert error.code == "json_too_deep"
    assert error.param is not None
    assert error.param.startswith("messages.0.content.0.0")
    assert error.param.count(".") == 63  # the container on level 65
    assert error.param in error.message


def test_too_deep_past_wide_siblings_and_malformed_after_it() -> None:
    raw = b'{"a": [1, {"b": [2]}, ' + nested(5000)[:5010] + b" garbage"
    assert refusal(raw).param == "a.2." + ".".join(["0"] * 62)  # level 65


def test_a_number_too_long_names_the_field() -> None:
    for literal, kind in [(b"9" * 5000, "integer"), (b"-" + b"1" * 64, "integer")]:
        error = refusal(b'{"model": "demo", "tools": [0, {"n": ' + literal + b"}]}")
        assert (error.param, error.code) == ("tools.1.n", "number_too_long")
        assert kind in error.message and str(len(literal)) in error.message
    error = refusal(b'{"x": [0.' + b"1" * 70 + b"e-5]}")
    assert (error.param, error.code) == ("x.0", "number_too_long")


def test_digits_in_strings_are_not_numbers() -> None:
    raw = json.dumps({"prompt": "1" * 10_000, "n": 1}).encode()
    assert loads(raw, max_depth=64, max_number_chars=64)["n"] == 1


def test_megabytes_parse_fast() -> None:
    """A bound against a slow path on ordinary large bodies, not a speed target."""
    bodies = [
        json.dumps({"prompt": list(range(400_000))}).encode(),
        json.dumps({"messages": [{"role": "user", "content": "x [1] " * 400_000}]}).encode(),
        json.dumps({"messages": [{"role": "user", "content": "hi"}] * 50_000}).encode(),
    ]
    for raw in bodies:
        began = time.perf_counter()
        loads(raw, max_depth=64, max_number_chars=64)
        parse_s = time.perf_counter() - began
        began = time.perf_counter()
        json.loads(raw)
        assert parse_s < 5 * (time.perf_counter() - began) + 0.2


# -- through the app ---------------------------------------------------------------------


@pytest.fixture
def roomy(tokenizer: FrontTokenizer) -> TestClient:
    runtime = make_runtime(tokenizer, [FakeBackend("primary").up()], max_body_bytes=1 << 20)
    return TestClient(create_app(runtime), raise_server_exceptions=False)


def deep_chat() -> bytes:
    return b'{"model": "demo", "messages": ' + nested(1000) + b"}"


def long_number_chat() -> bytes:
    return json.dumps(CHAT).encode()[:-1] + b', "seed": ' + b"7" * 5000 + b"}"


@pytest.mark.parametrize("raw", [deep_chat(), long_number_chat()])
def test_the_chat_route_answers_400_in_openai_shape(roomy: TestClient, raw: bytes) -> None:
    response = roomy.post(
        "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"].split(".")[0] in ("messages", "seed")


def test_the_messages_route_answers_400_in_anthropic_shape(roomy: TestClient) -> None:
    raw = b'{"model": "demo", "max_tokens": 2, "messages": ' + nested(1000) + b"}"
    response = roomy.post("/v1/messages", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("messages.0.0")


def test_the_limits_are_settings(tokenizer: FrontTokenizer) -> None:
    runtime = make_runtime(tokenizer, [FakeBackend("primary").up()], max_json_depth=8)
    client = TestClient(create_app(runtime), raise_server_exceptions=False)
    eight = {**CHAT, "metadata": {"a": {"b": {"c": {"d": {"e": {"f": {}}}}}}}}  # f: level 8
    assert client.post("/v1/chat/completions", json=eight).status_code == 200
    nine = {**CHAT, "metadata": {"a": {"b": {"c": {"d": {"e": {"f": {"g": {}}}}}}}}}
    response = client.post("/v1/chat/completions", json=nine)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "metadata.a.b.c.d.e.f.g"


def test_a_refused_body_keeps_the_connection(tokenizer: FrontTokenizer) -> None:
    """Over a real socket: the 400 comes, and the same connection serves the next request."""
    runtime = make_runtime(tokenizer, [FakeBackend("primary").up()], max_body_bytes=1 << 20)
    with running_front(runtime) as address, connect(address) as sock:
        for raw in (deep_chat(), long_number_chat()):
            sock.sendall(post("/v1/chat/completions", raw))
            status, headers, body = read_response(sock)
            assert status == 400, body
            assert headers.get("connection") != "close"
        sock.sendall(post("/v1/chat/completions", json.dumps(CHAT).encode()))
        status, _, body = read_response(sock)
        assert status == 200, body
