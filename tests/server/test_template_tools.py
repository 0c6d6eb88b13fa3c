"""Tool calls through a chat template mlx-lm knows (the demo's, ``json_tools``).

A scripted backend plays the model (the demo never writes calls by itself); the
template, mlx-lm's parser behind `MarkedToolParser`, chunking and the `openai`
client's own parsing are the real ones. The live engine, where a grammar makes the
demo write the call, is in ``test_structured_live.py``.
"""

import json
from collections.abc import Iterator

import openai
import pytest
from starlette.testclient import TestClient

from mlxserve.server.app import create_app
from mlxserve.server.tokenizer import FrontTokenizer
from tests.server.conftest import make_runtime
from tests.server.test_chat_tools import ScriptedBackend

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture
def scripted(tokenizer: FrontTokenizer) -> Iterator[tuple[TestClient, ScriptedBackend]]:
    backend = ScriptedBackend(tokenizer)
    runtime = make_runtime(tokenizer, [backend])
    backend.up()
    with TestClient(create_app(runtime), raise_server_exceptions=False) as client:
        yield client, backend


def test_history_with_calls_and_results_goes_through_the_template(
    scripted: tuple[TestClient, ScriptedBackend],
) -> None:
    client, _ = scripted
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    body = {"model": "demo", "messages": history, "tools": TOOLS}
    prompt = client.post("/tokenize", json=body).json()["prompt"]
    assert '"name": "get_weather"' in prompt and "<|system|>You may call these tools" in prompt
    assert CALL in prompt and "<tool_response>sunny, 21 C</tool_response>" in prompt
    bad = [
        *history[:1],
        {**history[1], "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
    ]
    response = client.post("/v1/chat/completions", json={**body, "messages": bad})
    assert response.json()["error"]["param"] == "messages.1.tool_calls.0.function.arguments"
    plain = client.post("/tokenize", json={"model": "demo", "messages": ASK}).json()["prompt"]
    assert plain == "<|user|>Weather in Paris?<|end|><|assistant|>"  # unchanged without tools


def test_the_openai_client_reads_template_calls(
    scripted: tuple[TestClient, ScriptedBackend],
) -> None:
    client, backend = scripted
    backend.script = "Let me look. " + CALL
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    response = api.chat.completions.create(model="demo", messages=ASK, tools=TOOLS)  # type: ignore[arg-type]
    message = response.choices[0].message
    [call] = message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    assert message.content == "Let me look. "
    assert response.choices[0].finish_reason == "tool_calls"
    with api.chat.completions.stream(model="demo", messages=ASK, tools=TOOLS) as stream:  # type: ignore[arg-type]
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls or []
    assert json.loads(streamed.function.arguments) == {"city": "Paris"}
    assert final.choices[0].finish_reason == "tool_calls"
    none = api.chat.completions.create(
        model="demo",
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
    )
    assert none.choices[0].message.tool_calls is None  # no tools: the call stays text
    assert CALL in (none.choices[0].message.content or "")
