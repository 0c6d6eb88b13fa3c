"""How a generation ends when a backend fails it: every failure classified once.

A failure of the request itself (a step that raised for it, a grammar the engine
could not apply) is a 500 naming it, `request_failed`: never a 503, never
`no_healthy_backend` (SDKs send a 503 again) and never tried on another backend.
A backend's own failure is still resumed elsewhere.
"""

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from mlxserve.server.app import create_app
from mlxserve.server.tokenizer import FrontTokenizer
from tests.server.conftest import make_runtime
from tests.server.fakes import FakeBackend
from tests.server.live import MODEL, LiveServer

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}


def failing_pair(
    tokenizer: FrontTokenizer, **fake: object
) -> tuple[TestClient, FakeBackend, FakeBackend]:
    """A primary whose first request fails a step after 3 tokens, and a healthy standby."""
    primary = FakeBackend("primary", fail_after=3, step_fails=True, **fake)  # type: ignore[arg-type]
    standby = FakeBackend("standby")
    runtime = make_runtime(tokenizer, [primary, standby], retry_attempts=4, retry_backoff_s=0.01)
    primary.up()
    standby.up()
    return TestClient(create_app(runtime)), primary, standby


def test_a_failed_step_is_a_500_naming_it_and_not_retried(tokenizer: FrontTokenizer) -> None:
    client, primary, standby = failing_pair(tokenizer)
    with client:
        response = client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 500, response.text
        assert "retry-after" not in response.headers
        error = response.json()["error"]
        assert error["code"] == "request_failed"
        assert "step failed" in error["message"]
        assert standby.calls == []  # not resumed elsewhere: it would fail there too
        # The backend serves the next request: the failure was the request's only.
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert client.get("/ready").status_code == 200
    assert len(primary.calls) == 2 and standby.calls == []


def test_a_failed_step_in_a_stream_is_an_error_event_naming_it(tokenizer: FrontTokenizer) -> None:
    client, _, standby = failing_pair(tokenizer)
    with client, client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "request_failed" and error["type"] != "service_unavailable"
    assert standby.calls == []


def test_anthropic_clients_read_a_request_failure_as_an_api_error(
    tokenizer: FrontTokenizer,
) -> None:
    client, _, standby = failing_pair(tokenizer)
    body = {**CHAT, "max_tokens": 8}
    with client:
        response = client.post("/v1/messages", json=body)
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "api_error"  # not overloaded_error (a 503)
    assert standby.calls == []


def test_the_other_rows_go_on(tokenizer: FrontTokenizer) -> None:
    """Two requests in flight on one backend: the one whose step fails ends with its
    error; the other finishes, on the same backend."""
    client, primary, standby = failing_pair(tokenizer, delay_s=0.02)
    statuses: list[int] = []
    with client:
        threads = [
            threading.Thread(
                target=lambda: statuses.append(
                    client.post("/v1/chat/completions", json=CHAT).status_code
                )
            )
            for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert sorted(statuses) == [200, 500]
    assert len(primary.calls) == 2 and standby.calls == []


def test_a_backend_failure_still_resumes_elsewhere(tokenizer: FrontTokenizer) -> None:
    primary = FakeBackend("primary", fail_after=3)
    standby = FakeBackend("standby")
    runtime = make_runtime(tokenizer, [primary, standby], retry_attempts=4, retry_backoff_s=0.01)
    primary.up()
    standby.up()
    with TestClient(create_app(runtime)) as client:
        response = client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    assert len(standby.calls) == 1


def test_a_schema_no_answer_can_follow_never_takes_a_slot(tokenizer: FrontTokenizer) -> None:
    """Refused before admission, naming the field: no backend sees it."""
    engine = FakeBackend("primary")
    runtime = make_runtime(tokenizer, [engine])
    engine.up()
    loop = {"$ref": "#/$defs/a"}
    schema = {"type": "object", "properties": {"x": loop}, "$defs": {"a": loop}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    with TestClient(create_app(runtime)) as client:
        response = client.post("/v1/chat/completions", json={**CHAT, "response_format": fmt})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "response_format.json_schema.schema"
    assert engine.calls == []


# -- with real engines ----------------------------------------------------------------

RAISE_AT_STEP = 12


@pytest.fixture
def raising(tmp_path: Path) -> Iterator[LiveServer]:
    """A primary whose step RAISE_AT_STEP raises (its first start only), and a standby."""
    config = f"""
model = "{MODEL}"
[server]
port = 0
ready_interval_s = 30.0
retry_attempts = 4
retry_backoff_s = 0.1
engine_env = {{ MLXSERVE_FAULT_RAISE_AT_STEP = "{RAISE_AT_STEP}" }}
[[fallback]]
name = "standby"
model = "{MODEL}"
"""
    live = LiveServer(tmp_path, config)
    try:
        yield live.start()
    finally:
        code = live.stop()
        assert code == 0, live.tail()


@pytest.mark.slow
def test_a_step_that_raised_is_a_500_and_the_engine_serves_on(raising: LiveServer) -> None:
    """The step fails its request (finish_reason "error" from the engine): the client
    gets 500 request_failed with the engine's message, the standby never sees it,
    and the same engine answers the next request."""
    body = {**CHAT, "max_tokens": 2 * RAISE_AT_STEP, "temperature": 0}
    with raising.client() as http:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert error["code"] == "request_failed" and "InjectedFault" in error["message"]
        again = http.post("/v1/chat/completions", json=body)
    assert again.status_code == 200, again.text
    assert again.headers["x-mlxserve-backend"] == "primary"
    assert raising.metric("mlxserve_request_retries_total") == 0
    assert not any("resumes on" in line for line in raising.lines)
    _, detail = raising.ready()
    assert detail["active"] == "primary"
