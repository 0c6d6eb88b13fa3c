"""Bearer auth on /v1/*; /health, /ready and /metrics stay open."""

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from mlxserve.server.app import create_app
from mlxserve.server.codec import Codec
from tests.server.conftest import make_runtime
from tests.server.fakes import FakeBackend


@pytest.fixture
def secured(codec: Codec, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.setenv("MLXSERVE_API_KEY", "env-key")
    runtime = make_runtime(codec, [FakeBackend("primary").up()], api_keys=["k1", "k2"])
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
