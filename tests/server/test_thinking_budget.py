# ruff: noqa: RUF001
"""The thinking budget and the effort levels, as the three APIs ask for them, and the
front's part of the closing reserve: a limit no answer fits is a 400 up front, and a
forced call's markup never reaches the client's content.

Through the real app on the DeepSeek-format tokenizer (thinking on by default), with
a fake backend that records the generation it is handed (the engine's part:
``tests/engine/sample/test_ending.py``).
"""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from mlxserve.channel.request import Reasoning
from mlxserve.chat.deepseek_v4.encoding import (
    REASONING_EFFORT_BEYOND_MAX,
    REASONING_EFFORT_MAX,
    TOOL_CALLS_START,
)
from mlxserve.models.demo.build import WEIGHTS_DIR
from mlxserve.models.demo.deepseek_format import _write_tokenizer
from mlxserve.server.app import create_app
from mlxserve.server.tokenizer import FrontTokenizer
from tests.server.conftest import make_runtime
from tests.server.fakes import FakeBackend
from tests.server.test_structured_live import WEATHER

ASK = [{"role": "user", "content": "Weather?"}]
CHAT = {"model": "demo", "messages": ASK, "max_tokens": 64}
MESSAGES = {"model": "demo", "messages": ASK, "max_tokens": 64}
RESPONSES = {"model": "demo", "input": "Weather?", "max_output_tokens": 64}


@pytest.fixture
def served(dsv4_tokenizer: FrontTokenizer) -> Iterator[tuple[TestClient, FakeBackend]]:
    fake = FakeBackend("primary", context_length=4096)
    with TestClient(create_app(make_runtime(dsv4_tokenizer, [fake.up()]))) as client:
        yield client, fake


def post(client: TestClient, path: str, body: dict[str, Any], status: int = 200) -> Any:
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    return response.json()


def refused(client: TestClient, path: str, body: dict[str, Any]) -> str:
    """The field a 400 names."""
    error = post(client, path, body, 400)
    return str(error["error"]["param"] if "param" in error["error"] else error["error"]["message"])


def test_each_api_carries_its_budget(
    served: tuple[TestClient, FakeBackend], dsv4_tokenizer: FrontTokenizer
) -> None:
    client, fake = served
    end = tuple(dsv4_tokenizer.text_ids("</think>"))
    post(
        client,
        "/v1/chat/completions",
        {**CHAT, "thinking": {"type": "enabled", "budget_tokens": 7}},
    )
    post(client, "/v1/messages", {**MESSAGES, "thinking": {"type": "enabled", "budget_tokens": 8}})
    post(
        client, "/v1/responses", {**RESPONSES, "reasoning": {"budget_tokens": 9, "summary": "auto"}}
    )
    assert [params.reasoning for params in fake.calls] == [
        Reasoning(end, 7),
        Reasoning(end, 8),
        Reasoning(end, 9),
    ]
    post(client, "/v1/chat/completions", CHAT)  # no budget, no grammar: nothing to carry
    assert fake.calls[-1].reasoning is None


def test_a_budget_needs_thinking_on(served: tuple[TestClient, FakeBackend]) -> None:
    client, _ = served
    off = {"type": "disabled", "budget_tokens": 7}
    assert refused(client, "/v1/chat/completions", {**CHAT, "thinking": off}) == (
        "thinking.budget_tokens"
    )
    for kind in ("disabled", "adaptive"):
        thinking = {"type": kind, "budget_tokens": 7}
        body = {**MESSAGES, "thinking": thinking}
        assert "thinking.budget_tokens" in refused(client, "/v1/messages", body)
    none = {"reasoning": {"effort": "none", "budget_tokens": 9}}
    assert refused(client, "/v1/responses", {**RESPONSES, **none}) == "reasoning.effort"
    enabled = {"thinking": {"type": "enabled"}, "reasoning_effort": "none"}
    assert refused(client, "/v1/chat/completions", {**CHAT, **enabled}) == "reasoning_effort"


def test_the_templates_refuse_a_budget(tokenizer: FrontTokenizer) -> None:
    """The demo's template has no thinking: a budget has no reasoning to bound."""
    fake = FakeBackend("primary", context_length=4096)
    with TestClient(create_app(make_runtime(tokenizer, [fake.up()]))) as client:
        thinking = {"type": "enabled", "budget_tokens": 7}
        assert refused(client, "/v1/chat/completions", {**CHAT, "thinking": thinking}) == (
            "thinking"
        )
        assert refused(client, "/v1/chat/completions", {**CHAT, "reasoning_effort": "high"}) == (
            "reasoning_effort"
        )
        post(client, "/v1/chat/completions", {**CHAT, "reasoning_effort": "none"})


def prompt_text(client: TestClient, body: dict[str, Any]) -> str:
    response = client.post("/tokenize", json={"model": "demo", "messages": ASK, **body})
    assert response.status_code == 200, response.text
    return str(response.json()["prompt"])


@pytest.fixture(scope="module")
def checkpoint_0731(tmp_path_factory: pytest.TempPathFactory) -> FrontTokenizer:
    """A -0731 checkpoint told by its config: the DSpark draft head's fields."""
    directory: Path = tmp_path_factory.mktemp("flash")
    _write_tokenizer(WEIGHTS_DIR, directory)
    config = {"model_type": "deepseek_v4", "dspark_block_size": 16}
    (directory / "config.json").write_text(json.dumps(config))
    return FrontTokenizer.load(directory)


def test_the_effort_prompts_per_checkpoint(
    dsv4_tokenizer: FrontTokenizer, checkpoint_0731: FrontTokenizer
) -> None:
    """V4: only max has a directive (Absolute maximum). -0731: high has that one, max
    "Beyond maximum"; low and unset none. OpenAI's levels fold as DeepSeek's API folds
    them; "none" is thinking off."""
    expected = {
        "v4": {None: "", "low": "", "high": "", "max": REASONING_EFFORT_MAX},
        "v4-0731": {
            None: "",
            "low": "",
            "high": REASONING_EFFORT_MAX,
            "max": REASONING_EFFORT_BEYOND_MAX,
        },
    }
    folded = {"minimal": "low", "medium": "high", "xhigh": "high", "ultra": "max"}
    for tokenizer in (dsv4_tokenizer, checkpoint_0731):
        directives = expected[tokenizer.deepseek_release]
        fake = FakeBackend("primary", context_length=4096)
        with TestClient(create_app(make_runtime(tokenizer, [fake.up()]))) as client:
            for effort, level in {**{e: e for e in directives}, **folded}.items():
                body = {} if effort is None else {"reasoning_effort": effort}
                text = prompt_text(client, body)
                assert text.startswith("<｜begin▁of▁sentence｜>" + directives[level]), effort
                assert text.endswith("<｜Assistant｜><think>")
                off = prompt_text(client, {**body, "thinking": {"type": "disabled"}})
                assert "Reasoning Effort" not in off  # chat mode: no directive
            assert prompt_text(client, {"reasoning_effort": "none"}).endswith("</think>")


def test_a_0731_checkpoint_is_told_by_config_or_name(tmp_path: Path) -> None:
    for name, config, release in [
        ("DeepSeek-V4-Flash", {}, "v4"),
        ("DeepSeek-V4-Flash", {"text_config": {"dspark_target_layer_ids": [1]}}, "v4-0731"),
        ("DeepSeek-V4-Flash-0731-4bit", {}, "v4-0731"),
    ]:
        directory = tmp_path / name
        directory.mkdir(exist_ok=True)
        _write_tokenizer(WEIGHTS_DIR, directory)
        (directory / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", **config}))
        assert FrontTokenizer.load(directory).deepseek_release == release, (name, config)


SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "x",
        "schema": {
            "type": "object",
            "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def test_a_limit_no_answer_fits_is_a_400_naming_it(served: tuple[TestClient, FakeBackend]) -> None:
    """The shortest answer (thinking on: ``</think>``, then ``{"a":"","b":0}``) is the
    least limit taken; one below it is refused by the name the request gave it."""
    client, fake = served
    chat = {**CHAT, "response_format": SCHEMA}
    error = post(client, "/v1/chat/completions", {**chat, "max_tokens": 1}, 400)["error"]
    need = int(error["message"].split(" takes ")[1].split()[0])
    assert error["param"] == "max_tokens" and 10 < need < 30, error
    for field in ("max_tokens", "max_completion_tokens"):
        body = {**chat, "max_tokens": None, field: need - 1}
        assert refused(client, "/v1/chat/completions", body) == field
        post(client, "/v1/chat/completions", {**body, field: need})
        assert fake.calls[-1].max_tokens == need
    tools = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 8}
    assert refused(client, "/v1/chat/completions", {**CHAT, **tools}) == "max_tokens"
    text = {"text": {"format": {"type": "json_object"}}, "max_output_tokens": 3}
    assert refused(client, "/v1/responses", {**RESPONSES, **text}) == "max_output_tokens"
    schema = SCHEMA["json_schema"]["schema"]  # type: ignore[index]
    output = {"output_config": {"format": {"type": "json_schema", "schema": schema}}}
    assert "max_tokens" in refused(client, "/v1/messages", {**MESSAGES, **output, "max_tokens": 4})


def test_a_forced_calls_markup_never_reaches_content(
    served: tuple[TestClient, FakeBackend], dsv4_tokenizer: FrontTokenizer
) -> None:
    """A forced call the answer does not finish (the fake writes on past the cut: junk
    in the block until max_tokens) is dropped, not given back as text; with ``auto``
    the same answer is the model's text."""
    client, fake = served
    cut = f'Hmm.</think>{TOOL_CALLS_START}\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜par'
    fake.script = dsv4_tokenizer.text_ids(cut)
    forced = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 400}
    reply = post(client, "/v1/chat/completions", {**CHAT, **forced})["choices"][0]
    message = reply["message"]
    assert reply["finish_reason"] == "length" and message["reasoning_content"] == "Hmm."
    assert not message["content"] and not message.get("tool_calls")
    parameters = WEATHER["function"]["parameters"]  # type: ignore[index]
    tools = [{"type": "function", "name": "get_weather", "parameters": parameters}]
    body = {**RESPONSES, "tools": tools, "tool_choice": "required", "max_output_tokens": 400}
    response = post(client, "/v1/responses", body)
    assert response["status"] == "incomplete"
    assert [item["type"] for item in response["output"]] == ["reasoning"]
    auto = {**CHAT, "tools": [WEATHER], "max_tokens": 400}
    message = post(client, "/v1/chat/completions", auto)["choices"][0]["message"]
    assert "DSML" in message["content"]  # with auto, malformed markup is the model's text
