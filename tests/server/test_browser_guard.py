"""Without an API key, what a web page in the user's browser could send is refused: a
POST that is not JSON (415), a Host that is not this server's (421, DNS rebinding), an
Origin that is not its own or allowed (403); the clients people use keep working."""

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from starlette.testclient import TestClient

from mlxserve.server.app import create_app
from mlxserve.server.tokenizer import FrontTokenizer
from tests.server.conftest import TEST_CLIENT_HOST, make_runtime
from tests.server.fakes import FakeBackend
from tests.server.front import running_front

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
MESSAGES = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
JSON = {"content-type": "application/json"}


def client_of(tokenizer: FrontTokenizer, **server: Any) -> TestClient:
    runtime = make_runtime(tokenizer, [FakeBackend("primary").up()], **server)
    return TestClient(create_app(runtime), raise_server_exceptions=False)


@pytest.fixture
def keyless(tokenizer: FrontTokenizer) -> TestClient:
    return client_of(tokenizer)


def openai_error(response: Any, status: int) -> dict[str, Any]:
    """The error of an OpenAI-shaped answer (from httpx, or the TestClient's own)."""
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# -- JSON only ------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_post_that_is_not_json_is_415(keyless: TestClient, content_type: str | None) -> None:
    """What a page can POST without a preflight: the JSON body is the same."""
    headers = {"content-type": content_type} if content_type else {}
    raw = json.dumps(CHAT).encode()
    response = keyless.post("/v1/chat/completions", content=raw, headers=headers)
    error = openai_error(response, 415)
    assert (error["param"], error["code"]) == ("content-type", "unsupported_media_type")
    assert "application/json" in error["message"]


def test_415_on_the_messages_route_is_in_anthropic_shape(keyless: TestClient) -> None:
    raw = json.dumps(MESSAGES).encode()
    response = keyless.post("/v1/messages", content=raw, headers={"content-type": "text/plain"})
    assert response.status_code == 415
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_json_with_a_charset_is_json(keyless: TestClient) -> None:
    raw = json.dumps(CHAT).encode()
    headers = {"content-type": "Application/JSON; charset=utf-8"}
    assert keyless.post("/v1/chat/completions", content=raw, headers=headers).status_code == 200


# -- Host -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host", ["attacker.example", "attacker.example:8000", "localhost.attacker.example", ""]
)
def test_a_foreign_host_is_421(keyless: TestClient, host: str) -> None:
    headers = {"host": host}
    for response in (
        keyless.post("/v1/chat/completions", json=CHAT, headers=headers),
        keyless.get("/status", headers=headers),  # what a rebinding page would read
        keyless.get("/health", headers=headers),
    ):
        error = openai_error(response, 421)
        assert (error["param"], error["code"]) == ("host", "host_not_allowed")


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1:8000", "localhost", "LOCALHOST:8000", "app.localhost", "[::1]:8000", "10.1.2.3"],
)
def test_addresses_and_loopback_names_pass(keyless: TestClient, host: str) -> None:
    response = keyless.post("/v1/chat/completions", json=CHAT, headers={"host": host})
    assert response.status_code == 200, response.text


def test_the_bind_host_and_allowed_hosts_pass(tokenizer: FrontTokenizer) -> None:
    client = client_of(tokenizer, host="mlx.lan", allowed_hosts=["*.corp.example", "box"])
    for host in ("mlx.lan:8000", "gpu.corp.example", "box:80"):
        assert client.get("/health", headers={"host": host}).status_code == 200, host
    for host in ("corp.example", "evil-corp.example", "boxes"):
        assert client.get("/health", headers={"host": host}).status_code == 421, host
    anyone = client_of(tokenizer, allowed_hosts=["*"])
    assert anyone.get("/health", headers={"host": "whatever.example"}).status_code == 200


# -- Origin ---------------------------------------------------------------------------------


@pytest.mark.parametrize("origin", ["https://attacker.example", "null", "http://localhost:3000"])
def test_a_foreign_origin_is_403(keyless: TestClient, origin: str) -> None:
    response = keyless.post("/v1/chat/completions", json=CHAT, headers={"origin": origin})
    error = openai_error(response, 403)
    assert (error["param"], error["code"]) == ("origin", "origin_not_allowed")


def test_the_servers_own_origin_and_allowed_origins_pass(tokenizer: FrontTokenizer) -> None:
    keyless = client_of(tokenizer, allowed_origins=["http://localhost:3000/"])
    for origin in (f"http://{TEST_CLIENT_HOST}", "http://localhost:3000"):
        response = keyless.post("/v1/chat/completions", json=CHAT, headers={"origin": origin})
        assert response.status_code == 200, origin
    response = keyless.post(
        "/v1/chat/completions", json=CHAT, headers={"origin": "http://localhost:3001"}
    )
    assert response.status_code == 403


# -- with a key -----------------------------------------------------------------------------


def test_with_an_api_key_the_checks_are_off(tokenizer: FrontTokenizer) -> None:
    """A page cannot make an authorised request; a proxy's own Host name keeps working."""
    client = client_of(tokenizer, api_keys=["k1"])
    headers = {
        "authorization": "Bearer k1",
        "host": "api.example",
        "origin": "https://app.example",
        "content-type": "text/plain",
    }
    raw = json.dumps(CHAT).encode()
    assert client.post("/v1/chat/completions", content=raw, headers=headers).status_code == 200
    del headers["authorization"]
    assert client.post("/v1/chat/completions", content=raw, headers=headers).status_code == 401


# -- the clients people use, over real sockets ------------------------------------------------


def test_the_sdks_and_curl_style_requests_pass(tokenizer: FrontTokenizer) -> None:
    runtime = make_runtime(tokenizer, [FakeBackend("primary").up()])
    with running_front(runtime) as (host, port):
        base = f"http://{host}:{port}"
        chat = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        answer = chat.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert answer.choices[0].message.content is not None
        claude = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
        message = claude.messages.create(
            model="demo", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
        )
        assert message.content
        # The README's curl: -H 'content-type: application/json' -d '{...}'
        for url in (base, f"http://localhost:{port}"):
            response = httpx.post(
                f"{url}/v1/chat/completions", content=json.dumps(CHAT), headers=JSON, timeout=10
            )
            assert response.status_code == 200, response.text
        # What a page could send instead: refused before anything is generated
        rebound = httpx.post(
            f"{base}/v1/chat/completions",
            content=json.dumps(CHAT),
            headers={"content-type": "text/plain", "host": f"attacker.example:{port}"},
            timeout=10,
        )
        assert rebound.status_code == 421
