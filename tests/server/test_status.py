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
    assert '<script type="application/json" id="initial">' in page  # the charts' data


def test_the_page_loads_nothing_from_elsewhere(status_client: TestClient) -> None:
    """Offline Macs: every script and style is inline, no URL leaves the server."""
    response = status_client.get("/status")
    page = response.text
    assert " src=" not in page and page.count("<link") == page.count(
        '<link rel="icon" href="data:,">'
    )
    assert "http://" not in page.replace('"http://www.w3.org/2000/svg"', "")  # a name only
    assert "https://" not in page and "//cdn" not in page
    assert "connect-src 'self'" in response.headers["content-security-policy"]


def test_normal_facts_are_not_painted_as_faults(status_client: TestClient) -> None:
    """ "simulated: yes/no" and "NAX: no" are facts, not alarms; only health is coloured."""
    page = status_client.get("/status").text
    facts = page.split('id="plan-facts"')[1].split("</table>")[0]
    ranks = page.split('id="plan-ranks"')[1].split("</table>")[0]
    assert "<td>yes</td>" in facts  # simulated, plain
    assert "<td>Apple M3 Ultra</td><td>no</td>" in ranks  # no NAX, plain
    assert 'class="bad"' not in facts + ranks
    backends = page.split('id="backends"')[1].split("</table>")[0]
    assert '<td class="ok">yes</td>' in backends  # healthy: green


def test_json_has_history_and_since_keeps_only_newer_samples(status_client: TestClient) -> None:
    runtime = status_client.app.state.runtime  # type: ignore[attr-defined]
    runtime.history.sample()
    _chat(status_client)
    runtime.history.sample()
    data = status_client.get("/status?format=json").json()
    samples = data["history"]["samples"]
    assert len(samples) == 2 and samples[1]["tokens_per_s"] > 0
    assert set(samples[1]["backends"]) == {"primary", "spare"}
    newer = status_client.get(f"/status?format=json&since={samples[0]['t']}").json()
    assert [s["t"] for s in newer["history"]["samples"]] == [samples[1]["t"]]
    same = status_client.get(f"/v1/status?since={samples[0]['t']}").json()
    assert same["history"]["samples"] == newer["history"]["samples"]
    assert status_client.get("/v1/status?since=soon").json()["error"]["param"] == "since"
    assert status_client.get("/status?sinse=1").json()["error"]["param"] == "sinse"


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
    assert "<script>x" not in page and "&lt;script&gt;" in page
    assert "</script>x" not in page  # nor in the script's data: no '<' reaches the parser
    html = page.split('<script type="application/json"')[0]  # the data is JSON, not markup
    assert '" onmouseover' not in html and "odd = <b>3</b>" in html


def test_without_a_plan_the_page_says_so(tokenizer: FrontTokenizer) -> None:
    runtime = make_runtime(tokenizer, [FakeBackend("primary").up()])
    with TestClient(create_app(runtime)) as client:
        assert "no engine has reported a plan yet" in client.get("/status").text
        assert client.get("/status?format=json").json()["plan"] is None


def test_guarded_when_keys_are_set(tokenizer: FrontTokenizer) -> None:
    runtime = make_runtime(tokenizer, [FakeBackend("primary").up()], api_keys=["k1"])
    with TestClient(create_app(runtime)) as client:
        assert client.get("/status").status_code == 401
        assert client.get("/v1/status").status_code == 401
        assert client.get("/status", headers={"Authorization": "Bearer k1"}).status_code == 200
        assert client.get("/v1/status", headers={"x-api-key": "k1"}).status_code == 200
