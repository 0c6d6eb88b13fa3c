"""Bad input against the live server: every error row, then a hypothesis run with no 5xx.

The schema-driven part builds requests from the request models' fields: a valid
base with one field replaced by arbitrary JSON, removed, or the whole body
replaced by arbitrary JSON. Whatever comes in, the answer is a 2xx or a 4xx in
the OpenAI error shape, and the server is still ready afterwards.
"""

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.server.live import MODEL, LiveServer

pytestmark = pytest.mark.slow

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
COMPLETED = "mlxserve_completion_tokens_total"
#: How long a dropped request may take to be cancelled on a loaded machine: a bound
#: against a hang, not a speed target (the outcome says whether it was cancelled).
SETTLE_S = 120.0


def assert_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in response.text
    return error


@pytest.fixture(scope="module")
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with live.client() as client:
        yield client


def test_error_rows(http: httpx.Client, live: LiveServer) -> None:
    post = "/v1/chat/completions"
    headers = {"content-type": "application/json"}
    assert_error(http.post(post, content=b'{"model": ', headers=headers), 400)
    assert_error(http.post(post, json={**CHAT, "temperature": "warm"}), 400)
    assert_error(http.post(post, json={**CHAT, "n": 9}), 400)
    assert_error(http.post(post, json={**CHAT, "model": "no-such-model"}), 404)
    too_long = {**CHAT, "max_tokens": 10_000_000}
    assert assert_error(http.post(post, json=too_long), 400)["code"] == "context_length_exceeded"
    huge = {**CHAT, "messages": [{"role": "user", "content": "x" * 70_000}]}
    assert_error(http.post(post, json=huge), 413)
    assert_error(http.get("/v1/unknown"), 404)


def test_queue_full_is_429_and_disconnects_cancel(live: LiveServer) -> None:
    """max_running 2 and max_queue 1 (the live config): a fourth concurrent request is refused.

    The three long streams are then dropped by their clients, which must free every slot
    (cancelled: none of their tokens counted as completed, however long that takes).
    """
    body = {**CHAT, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    stop = threading.Event()
    completed = live.metric(COMPLETED)

    def hold() -> None:
        with (
            httpx.Client(base_url=live.url, timeout=120) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            for _ in response.iter_lines():
                if stop.is_set():
                    return  # closing the connection mid-stream

    threads = [threading.Thread(target=hold) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 60
        while (
            live.metric("mlxserve_running_requests"),
            live.metric("mlxserve_queue_depth"),
        ) != (2, 1):
            assert time.monotonic() < deadline, (
                "the long requests did not fill the slots",
                live.metric("mlxserve_running_requests"),
                live.metric("mlxserve_queue_depth"),
                live.tail(),
            )
            time.sleep(0.02)
        refused = httpx.post(f"{live.url}/v1/chat/completions", json=CHAT, timeout=30)
        error = assert_error(refused, 429)
        assert refused.headers["retry-after"].isdigit()
        assert error["type"] == "rate_limit_error"
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    deadline = time.monotonic() + SETTLE_S
    while live.metric("mlxserve_running_requests") or live.metric("mlxserve_queue_depth"):
        assert time.monotonic() < deadline, "disconnected streams kept their slots"
        time.sleep(0.05)
    assert live.metric(COMPLETED) == completed, "a dropped stream generated to the end"
    detail = live.settled()
    assert all(b["in_flight"] == 0 for b in detail["backends"]), detail


def _fields(model: type) -> list[str]:
    return list(model.model_fields)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=10,
)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes]:
    path, base, model = draw(
        st.sampled_from(
            [
                ("/v1/chat/completions", CHAT, ChatCompletionRequest),
                ("/v1/completions", COMPLETION, CompletionRequest),
            ]
        )
    )
    body: Any = dict(base)
    action = draw(st.sampled_from(["replace", "replace", "drop", "whole", "bytes"]))
    if action == "bytes":
        return path, draw(st.binary(max_size=64))
    if action == "whole":
        body = draw(JSON)
    else:
        field = draw(st.sampled_from(_fields(model)))
        if action == "drop":
            body.pop(field, None)
        else:
            body[field] = draw(JSON)
    if isinstance(body, dict) and isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = max(1, min(body["max_tokens"], 4))  # keep valid requests short
    if isinstance(body, dict) and body.get("stream") is True:
        body["stream"] = False
    return path, json.dumps(body).encode()


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(requests())
def test_fuzzed_requests_never_5xx(http: httpx.Client, request_: tuple[str, bytes]) -> None:
    path, raw = request_
    response = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code < 500, (raw, response.text)
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_still_ready_after_the_fuzzing(live: LiveServer) -> None:
    status, detail = live.ready()
    assert status == 200, detail
    assert live.metric("mlxserve_requests_total", status="500") == 0


def test_non_streamed_request_is_cancelled_when_its_client_goes(live: LiveServer) -> None:
    """A long non-streamed request whose client times out must free its slot, cancelled.

    Why not a time window: on a loaded machine the cancellation may take seconds, and
    on a fast one 1500 tokens may not. What tells a cancelled request from a finished
    one is its outcome: answered 499 (client closed), with none of its 1500 tokens
    counted as completed.
    """
    body = {**CHAT, "max_tokens": 1500, "ignore_eos": True}
    closed = live.metric("mlxserve_requests_total", status="499")
    completed = live.metric(COMPLETED)

    def ended() -> bool:
        outcome = live.metric("mlxserve_requests_total", status="499") > closed or (
            live.metric(COMPLETED) > completed
        )
        return outcome and not live.metric("mlxserve_running_requests")

    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + SETTLE_S
    while not ended():
        assert time.monotonic() < deadline, "the abandoned request kept its slot"
        time.sleep(0.05)
    assert live.metric(COMPLETED) == completed, "the abandoned request generated to the end"
    assert live.metric("mlxserve_requests_total", status="499") == closed + 1
    detail = live.settled()
    assert all(b["in_flight"] == 0 for b in detail["backends"]), detail
