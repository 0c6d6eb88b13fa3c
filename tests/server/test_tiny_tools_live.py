"""Tool calls on a generic (llama) model whose own chat template has tools: ChatML
with Hermes-style calls, read by mlx-lm's ``json_tools`` parser, written under a
grammar when the call is forced. The `openai` client against a live server."""

import json
from collections.abc import Iterator

import openai
import pytest

from tests.server.live import LiveServer
from tests.server.tiny_model import CHATML_TOOLS_TEMPLATE, build_tiny_llama, with_chat_template

pytestmark = pytest.mark.slow

CONFIG = """
model = "{model}"
[engine]
max_running = 2
[server]
port = 0
"""
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"term": {"type": "string", "maxLength": 12}},
                "required": ["term"],
                "additionalProperties": False,
            },
        },
    }
]
ASK = [{"role": "user", "content": "Look up MLX."}]


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, LiveServer]]:
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-tools") / "model")
    with_chat_template(model, CHATML_TOOLS_TEMPLATE)
    server = LiveServer(tmp_path_factory.mktemp("tiny-live"), CONFIG.format(model=model))
    try:
        server.start()
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client:
            yield client, server
    finally:
        assert server.stop() == 0, server.tail()


def test_forced_call_whole_and_streamed(api: tuple[openai.OpenAI, LiveServer]) -> None:
    client, _ = api
    for choice in ("required", {"type": "function", "function": {"name": "lookup"}}):
        response = client.chat.completions.create(
            model=str(_model(api)),
            messages=ASK,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice=choice,  # type: ignore[arg-type]
            parallel_tool_calls=False,
            max_tokens=60,
        )
        [call] = response.choices[0].message.tool_calls or []
        assert call.function.name == "lookup"  # type: ignore[union-attr]
        term = json.loads(call.function.arguments)["term"]  # type: ignore[union-attr]
        assert isinstance(term, str) and len(term) <= 12
        assert response.choices[0].finish_reason == "tool_calls"
    chunks = list(
        client.chat.completions.create(
            model=str(_model(api)),
            messages=ASK,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=60,
            stream=True,
        )
    )
    parts = [
        c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls
    ]
    head = parts[0][0]
    assert head.id and head.function and head.function.name == "lookup"  # id and name first
    arguments = "".join(p[0].function.arguments or "" for p in parts if p[0].function)
    assert set(json.loads(arguments)) == {"term"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_calls_and_results_go_back_through_the_template(
    api: tuple[openai.OpenAI, LiveServer],
) -> None:
    client, server = api
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"term": "MLX"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "an array framework"},
    ]
    with server.client() as http:
        body = {"model": str(_model(api)), "messages": messages, "tools": TOOLS}
        prompt = http.post("/tokenize", json=body).json()["prompt"]
    assert '<tool_call>\n{"name": "lookup", "arguments": {"term": "MLX"}}\n</tool_call>' in prompt
    assert "<tool_response>\nan array framework\n</tool_response>" in prompt
    reply = client.chat.completions.create(
        model=str(_model(api)),
        messages=messages,
        tools=TOOLS,
        max_tokens=4,  # type: ignore[arg-type]
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def _model(api: tuple[openai.OpenAI, LiveServer]) -> str:
    return api[0].models.list().data[0].id
