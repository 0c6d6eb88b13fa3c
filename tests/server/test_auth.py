"""Bearer (or x-api-key) auth on /v1/*; /health, /ready and /metrics stay open."""

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from mlxserve.server.app import create_app
from mlxserve.server.tokenizer import FrontTokenizer
from tests.server.conftest import make_runtime
from tests.server.fakes import FakeBackend


@pytest.fixture
def secured(tokenizer: FrontTokenizer, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.setenv("MLXSERVE_API_KEY", "env-key")
    runtime = make_runtime(tokenizer, [FakeBackend("primary").up()], api_keys=["k1", "k2"])
    with TestClient(create_app(runtime)) as client:
        yield client


@pytest.mark.parametrize("header", [None, "Bearer nope", "Basic k1", "Bearer k1x", "Bearer "])
def test_missing_or_wrong_key_is_401(secured: TestClient, header: str | None) -> None:
    headers = {"Authorization": header} if header else {}
    response = secured.get("/v1/models", headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("key", ["k1", "k2", "env-key"])
def test_any_configured_key_works(secured: TestClient, key: str) -> None:
    assert secured.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_probes_stay_open(secured: TestClient) -> None:
    for path in ("/health", "/ready", "/metrics"):
        assert secured.get(path).status_code == 200


def test_x_api_key_works_and_anthropic_routes_answer_in_their_shape(secured: TestClient) -> None:
    assert secured.get("/v1/models", headers={"x-api-key": "k2"}).status_code == 200
    assert secured.get("/v1/models", headers={"x-api-key": "nope"}).status_code == 401
    body = {"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    refused = secured.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert refused.status_code == 401
    assert refused.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": refused.json()["error"]["message"]},
    }
    count = {"model": "demo", "messages": body["messages"]}
    counted = secured.post("/v1/messages/count_tokens", json=count, headers={"x-api-key": "k1"})
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] > 0
    bad = secured.post(
        "/v1/messages/count_tokens", json={**count, "max_tokens": 2}, headers={"x-api-key": "k1"}
    )
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
