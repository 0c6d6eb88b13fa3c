"""GET /status: the status page, as HTML and as JSON."""

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from mlxserve.config import Settings
from mlxserve.hardware.simulate import parse_cluster_spec
from mlxserve.server.app import create_app
from mlxserve.server.tokenizer import FrontTokenizer
from mlxserve.startup.plan import build_plan
from tests.server.conftest import make_runtime
from tests.server.fakes import FakeBackend

MIXED = "Apple M3 Ultra,Apple M5 Max"


@pytest.fixture(scope="module")
def mixed_plan() -> dict[str, Any]:
    settings = Settings(cluster={"simulate": parse_cluster_spec(MIXED), "backend": "jaccl"})  # type: ignore[arg-type]
    plan, _ = build_plan(settings)
    document: dict[str, Any] = plan.document()
    return document


@pytest.fixture
def status_client(tokenizer: FrontTokenizer, mixed_plan: dict[str, Any]) -> Iterator[TestClient]:
    primary = FakeBackend("primary", plan=mixed_plan).up()
    runtime = make_runtime(tokenizer, [primary, FakeBackend("spare").up()])
    with TestClient(create_app(runtime), raise_server_exceptions=False) as client:
        yield client


def _chat(client: TestClient) -> None:
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_json_has_traffic_backends_and_the_plan_per_rank(status_client: TestClient) -> None:
    _chat(status_client)
    data = status_client.get("/status?format=json").json()
    assert data["model"] == "demo"
    assert [b["name"] for b in data["backends"]] == ["primary", "spare"]
    assert data["active_backend"] == "primary"
    traffic = data["traffic"]
    assert traffic["completion_tokens"] == 5 and traffic["prompt_tokens"] > 0
    assert traffic["running"] == 0 and traffic["max_running"] == 2
    plan = data["plan"]
    assert plan["simulated"] is True and plan["world_size"] == 2
    chips = [r["chip"] for r in plan["ranks"]]
    assert chips == ["Apple M3 Ultra", "Apple M5 Max"]
    m5 = plan["ranks"][1]["decisions"]["nax_moe"]
    assert m5["value"] == "full" and m5["rule"] == "nax-moe-mixed-cluster-full"


def test_html_shows_the_decisions_with_reasons(status_client: TestClient) -> None:
    response = status_client.get("/status")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    assert "<h1>mlxserve: demo</h1>" in page
    assert "Apple M5 Max" in page and "nax_moe = <b>full</b>" in page
    assert 'title="' in page  # the reason, as a tooltip
    assert 'http-equiv="refresh"' in page


def test_unknown_format_is_a_400(status_client: TestClient) -> None:
    response = status_client.get("/status?format=xml")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "format"


def test_values_are_escaped(tokenizer: FrontTokenizer) -> None:
    evil = "<script>x</script>"
    decision = {"value": evil, "rule": evil, "reason": f'" onmouseover="{evil}'}
    rank = {"rank": 0, "profile": {"chip": evil}, "decisions": {evil: decision, "odd": 3}}
    plan = {"plan_hash": "x", "ranks": [rank]}
    runtime = make_runtime(tokenizer, [FakeBackend("primary", plan=plan).up()])
    with TestClient(create_app(runtime)) as client:
        page = client.get("/status").text
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert '" onmouseover' not in page and "odd = <b>3</b>" in page


def test_without_a_plan_the_page_says_so(tokenizer: FrontTokenizer) -> None:
    runtime = make_runtime(tokenizer, [FakeBackend("primary").up()])
    with TestClient(create_app(runtime)) as client:
        assert "no engine has reported a plan yet" in client.get("/status").text
        assert client.get("/status?format=json").json()["plan"] is None


def test_guarded_when_keys_are_set(tokenizer: FrontTokenizer) -> None:
    runtime = make_runtime(tokenizer, [FakeBackend("primary").up()], api_keys=["k1"])
    with TestClient(create_app(runtime)) as client:
        assert client.get("/status").status_code == 401
        assert client.get("/status", headers={"Authorization": "Bearer k1"}).status_code == 200
