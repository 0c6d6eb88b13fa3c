"""A served model name and aliases: listed by /v1/models, accepted by every API; the
model setting (a directory's full path) is accepted too."""

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from mlxserve.server.app import create_app
from mlxserve.server.tokenizer import FrontTokenizer
from tests.server.conftest import make_runtime
from tests.server.fakes import FakeBackend


@pytest.fixture
def named(tokenizer: FrontTokenizer) -> Iterator[TestClient]:
    runtime = make_runtime(
        tokenizer, [FakeBackend("primary").up()], model_name="dsv4", model_aliases=["flash"]
    )
    with TestClient(create_app(runtime), raise_server_exceptions=False) as client:
        yield client


def test_models_lists_the_served_name_then_the_aliases(named: TestClient) -> None:
    assert [m["id"] for m in named.get("/v1/models").json()["data"]] == ["dsv4", "flash"]
    assert named.get("/v1/models/flash").json()["id"] == "flash"
    assert named.get("/v1/models/demo").status_code == 200  # the model setting itself
    assert named.get("/v1/models/other").status_code == 404


@pytest.mark.parametrize("name", ["dsv4", "flash", "demo"])
def test_every_api_accepts_each_name(named: TestClient, name: str) -> None:
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert named.post("/v1/chat/completions", json=chat).status_code == 200
    assert named.post("/v1/messages", json=chat).status_code == 200
    responses = {"model": name, "input": "hi", "max_output_tokens": 3}
    assert named.post("/v1/responses", json=responses).status_code == 200


def test_another_name_is_a_404_naming_the_served_one(named: TestClient) -> None:
    chat = {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}
    response = named.post("/v1/chat/completions", json=chat)
    assert response.status_code == 404 and "'dsv4'" in response.json()["error"]["message"]
