# ruff: noqa: RUF001
"""Tool calls and thinking through the real app and the DeepSeek-format tokenizer.

The demo model never writes DSML, so a scripted backend stands in for the engine
here: it streams, one token per event, the token ids of an answer the test chooses,
as a DeepSeek-V4 model would. Everything else is the server's own path (prompt
encoder, detokenizer, reasoning split, DSML parser, chunking). The same path with
the real engine is in ``test_deepseek_format_live.py``.
"""

import json
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import openai
import pytest
from starlette.testclient import TestClient

from mlxserve.channel.request import GenerationParams
from mlxserve.server.app import create_app
from mlxserve.server.backends.base import BackendEvent, Finished, Tokens
from mlxserve.server.tokenizer import FrontTokenizer
from tests.server.conftest import make_runtime
from tests.server.fakes import FakeBackend

CALL = (
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
ASK = [{"role": "user", "content": "Weather?"}]


class ScriptedBackend(FakeBackend):
    """Answers every request with the tokens of ``script`` (and EOS)."""

    def __init__(self, tokenizer: FrontTokenizer) -> None:
        super().__init__("primary", context_length=4096)
        self.tokenizer = tokenizer
        self.script = ""

    async def generate(
        self, request_id: str, params: GenerationParams
    ) -> AsyncGenerator[BackendEvent, None]:
        self.calls.append(params)
        ids = self.tokenizer.text_ids(self.script)[: params.max_tokens]
        for token in ids:
            yield Tokens((token,))
        reason = "length" if len(ids) == params.max_tokens else "stop"
        yield Finished(reason, len(params.prompt_ids), len(ids))


@pytest.fixture
def scripted(dsv4_tokenizer: FrontTokenizer) -> Iterator[tuple[TestClient, ScriptedBackend]]:
    backend = ScriptedBackend(dsv4_tokenizer)
    runtime = make_runtime(dsv4_tokenizer, [backend])
    backend.up()
    with TestClient(create_app(runtime), raise_server_exceptions=False) as client:
        yield client, backend


def chat(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={"model": "demo", "messages": ASK, **body})
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def stream(client: TestClient, **body: Any) -> list[dict[str, Any]]:
    payload = {"model": "demo", "messages": ASK, "stream": True, **body}
    with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_tool_call_with_reasoning_not_streamed(
    scripted: tuple[TestClient, ScriptedBackend],
) -> None:
    client, backend = scripted
    backend.script = "The user wants weather.</think>Checking.\n\n" + CALL
    body = chat(client, tools=TOOLS)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == "The user wants weather."
    assert message["content"] == "Checking."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}
    details = body["usage"]["completion_tokens_details"]
    assert 0 < details["reasoning_tokens"] < body["usage"]["completion_tokens"]


def test_tool_call_streamed_header_first_then_fragments(
    scripted: tuple[TestClient, ScriptedBackend],
) -> None:
    client, backend = scripted
    backend.script = "Hmm.</think>" + CALL
    chunks = stream(client, tools=TOOLS, stream_options={"include_usage": True})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Hmm."
    assert "".join(d.get("content", "") for d in deltas) == ""
    assert not any("DSML" in json.dumps(d.get("content", "")) for d in deltas)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"] == {
        "name": "get_weather",
        "arguments": "",
    }
    assert all("id" not in c and c["index"] == 0 for c in calls[1:])
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(arguments) == {"city": "Paris", "days": 2}
    assert [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]][
        -1
    ] == "tool_calls"
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


@pytest.mark.parametrize(
    "broken",
    [CALL[:-10], CALL.replace('false">2<', 'false">two<')],
    ids=["unclosed", "bad-json"],
)
def test_malformed_dsml_is_text_with_stop(
    scripted: tuple[TestClient, ScriptedBackend], broken: str
) -> None:
    client, backend = scripted
    backend.script = "R</think>" + broken
    body = chat(client, tools=TOOLS)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == broken and "tool_calls" not in choice["message"]
    chunks = stream(client, tools=TOOLS)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content", "") for d in deltas) == broken
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_without_tools_dsml_is_plain_content(scripted: tuple[TestClient, ScriptedBackend]) -> None:
    client, backend = scripted
    backend.script = CALL
    body = chat(client, thinking={"type": "disabled"})
    assert body["choices"][0]["message"]["content"] == CALL
    assert body["choices"][0]["finish_reason"] == "stop"
    assert "completion_tokens_details" not in body["usage"]


def test_max_tokens_counts_reasoning_and_answer(
    scripted: tuple[TestClient, ScriptedBackend],
) -> None:
    client, backend = scripted
    backend.script = "a b c d e f</think>answer"
    body = chat(client, max_tokens=3)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
    assert body["choices"][0]["message"].get("content") in ("", None)


def test_template_model_refuses_what_it_cannot_honour(client: TestClient) -> None:
    """The demo's own template has no thinking: refused by name (it has tools)."""
    base = {"model": "demo", "messages": ASK, "max_tokens": 2}
    cases = [
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"thinking": {"type": "enabled"}}, "thinking"),
        (
            {"chat_template_kwargs": {"enable_thinking": True}},
            "chat_template_kwargs.enable_thinking",
        ),
        ({"chat_template_kwargs": {"drop_thinking": False}}, "chat_template_kwargs.drop_thinking"),
        (
            {"messages": [*ASK, {"role": "tool", "content": "x"}]},
            "messages.1.tool_call_id",
        ),
    ]
    for extra, param in cases:
        response = client.post("/v1/chat/completions", json={**base, **extra})
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == param
    ok = client.post("/v1/chat/completions", json={**base, "thinking": {"type": "disabled"}})
    assert ok.status_code == 200 and "reasoning_content" not in ok.json()["choices"][0]["message"]


def test_the_openai_client_reads_the_calls(scripted: tuple[TestClient, ScriptedBackend]) -> None:
    """The `openai` package parses both shapes (its own types, its stream accumulator)."""
    client, backend = scripted
    backend.script = "Why not.</think>" + CALL
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    response = api.chat.completions.create(
        model="demo",
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
    )
    [call] = response.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert response.choices[0].finish_reason == "tool_calls"
    with api.chat.completions.stream(
        model="demo",
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
    ) as stream:
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls or []
    assert streamed.function.name == "get_weather"
    assert json.loads(streamed.function.arguments) == {"city": "Paris", "days": 2}
    assert final.choices[0].finish_reason == "tool_calls"
