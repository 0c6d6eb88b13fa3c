# ruff: noqa: RUF001
"""The real server on the demo model in DeepSeek-V4's published format (no template).

The prompts come from DeepSeek-V4's encoder; the answers from the real engine. The
demo was not trained on this format, so what it writes is checked against the same
tokens through `/v1/completions` (greedy): the chat answer must be exactly that text,
split at ``</think>`` into reasoning and content.
"""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mlxserve.models.demo.deepseek_format import build_deepseek_format_demo
from mlxserve.server.tokenizer import FrontTokenizer
from tests.server.live import LiveServer

pytestmark = pytest.mark.slow

KEY = "dsv4-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
B, U, A = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
QUESTION = [{"role": "user", "content": "Python reference: for"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CONFIG = """
model = "{model}"
[engine]
max_running = 2
prefill_step = 64
[server]
port = 0
api_keys = ["{key}"]
ready_interval_s = 2.0
"""


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_deepseek_format_demo(progress=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LiveServer]:
    live = LiveServer(tmp_path_factory.mktemp("dsv4"), CONFIG.format(model=model_dir, key=KEY))
    try:
        yield live.start()
    finally:
        assert live.stop() == 0, live.tail()


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120
    ) as client:
        yield client


def model_name(model_dir: Path) -> str:
    return str(model_dir)


def tokenize(http: httpx.Client, model_dir: Path, **body: Any) -> dict[str, Any]:
    response = http.post("/tokenize", json={"model": str(model_dir), **body})
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def raw_completion(http: httpx.Client, model_dir: Path, ids: list[int], n: int) -> str:
    """The model's raw continuation of `ids`, as a chat reply reads it: a completion
    keeps the space its first token starts with, a reply starts a turn and drops it."""
    response = http.post(
        "/v1/completions",
        json={"model": str(model_dir), "prompt": ids, "max_tokens": n, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    text: str = response.json()["choices"][0]["text"]
    return text[1:] if text.startswith(" ") else text


def test_tokenize_gives_the_deepseek_prompt_and_its_exact_ids(
    http: httpx.Client, model_dir: Path
) -> None:
    tokenizer = FrontTokenizer.load(model_dir)
    thinking = tokenize(http, model_dir, messages=QUESTION)
    assert thinking["prompt"] == f"{B}{U}Python reference: for{A}<think>"
    assert thinking["tokens"] == tokenizer.text_ids(thinking["prompt"])
    assert thinking["count"] == len(thinking["tokens"]) and thinking["max_model_len"] == 4096
    chat = tokenize(http, model_dir, messages=QUESTION, thinking={"type": "disabled"})
    assert chat["prompt"] == f"{B}{U}Python reference: for{A}</think>"
    kwargs = tokenize(http, model_dir, messages=QUESTION, chat_template_kwargs={"thinking": False})
    assert kwargs["prompt"] == chat["prompt"]
    effort = tokenize(http, model_dir, messages=QUESTION, reasoning_effort="max")
    assert effort["prompt"].startswith(f"{B}Reasoning Effort: Absolute maximum")
    completion = tokenize(http, model_dir, prompt="The for statement")
    assert completion["tokens"] == tokenizer.text_ids("The for statement")
    back = http.post("/detokenize", json={"model": str(model_dir), "tokens": thinking["tokens"]})
    assert back.json() == {"prompt": thinking["prompt"]}


def test_tokenize_errors_and_auth(server: LiveServer, http: httpx.Client, model_dir: Path) -> None:
    assert httpx.post(f"{server.url}/tokenize", json={}, timeout=10).status_code == 401
    cases = [
        ({"messages": QUESTION, "reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"messages": QUESTION, "chat_template_kwargs": {"foo": 1}}, "chat_template_kwargs.foo"),
        (
            {
                "messages": QUESTION,
                "thinking": {"type": "enabled"},
                "chat_template_kwargs": {"thinking": False},
            },
            "chat_template_kwargs.thinking",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
        (
            {
                "messages": QUESTION,
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
                "tools": [WEATHER],
            },
            "tool_choice.function.name",
        ),
        ({"prompt": [5, 99999]}, "prompt"),
        ({}, "messages"),
    ]
    for body, param in cases:
        response = http.post("/tokenize", json={"model": str(model_dir), **body})
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, response.text
    response = http.post("/detokenize", json={"model": str(model_dir), "tokens": [-1]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tokens"


def test_thinking_answer_is_the_raw_text_split_at_think_end(
    http: httpx.Client, client: openai.OpenAI, model_dir: Path
) -> None:
    ids = tokenize(http, model_dir, messages=QUESTION)["tokens"]
    raw = raw_completion(http, model_dir, ids, 24)
    reasoning, _, content = raw.partition("</think>")
    response = client.chat.completions.create(
        model=str(model_dir),
        messages=QUESTION,
        max_tokens=24,
        temperature=0,  # type: ignore[arg-type]
    )
    message = response.choices[0].message
    assert getattr(message, "reasoning_content", None) == reasoning
    assert (message.content or "") == content
    usage = response.usage
    assert usage is not None and usage.completion_tokens_details is not None
    reasoning_tokens = usage.completion_tokens_details.reasoning_tokens
    assert reasoning_tokens is not None and 0 < reasoning_tokens <= usage.completion_tokens <= 24
    if "</think>" not in raw:
        assert reasoning_tokens == usage.completion_tokens

    stream = client.chat.completions.create(
        model=str(model_dir),
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    last = chunks[-1].usage
    assert last is not None and last.completion_tokens_details is not None
    assert last.completion_tokens_details.reasoning_tokens == reasoning_tokens


def test_chat_mode_answer_is_all_content(
    http: httpx.Client, client: openai.OpenAI, model_dir: Path
) -> None:
    ids = tokenize(http, model_dir, messages=QUESTION, thinking={"type": "disabled"})["tokens"]
    raw = raw_completion(http, model_dir, ids, 16)
    response = client.chat.completions.create(
        model=str(model_dir),
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=16,
        temperature=0,
        extra_body={"thinking": {"type": "disabled"}},
    )
    message = response.choices[0].message
    assert message.content == raw
    assert getattr(message, "reasoning_content", None) is None


def test_tool_conversation_is_accepted_and_encoded(
    http: httpx.Client, client: openai.OpenAI, model_dir: Path
) -> None:
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should look it up.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    prompt = tokenize(http, model_dir, messages=history, tools=[WEATHER])["prompt"]
    assert prompt.startswith(f"{B}You help.\n\n## Tools\n\n")
    assert (
        f"{A}<think>I should look it up.</think>\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
        f"{U}<tool_result>sunny</tool_result>{A}<think>"
    ) in prompt
    response = client.chat.completions.create(
        model=str(model_dir),
        messages=history,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="auto",
        max_tokens=8,
        temperature=0,
    )
    assert response.choices[0].finish_reason in ("stop", "length")


def test_anthropic_client_x_api_key_and_thinking_blocks(
    server: LiveServer, model_dir: Path
) -> None:
    import anthropic

    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0) as client:
        reply = client.messages.create(
            model=model_name(model_dir),
            max_tokens=24,
            messages=QUESTION,  # type: ignore[arg-type]
            thinking={"type": "enabled", "budget_tokens": 1024},
            extra_body={"temperature": 0},
        )
        assert reply.content[0].type == "thinking"
        with client.messages.stream(
            model=model_name(model_dir),
            max_tokens=24,
            messages=QUESTION,  # type: ignore[arg-type]
            thinking={"type": "enabled", "budget_tokens": 1024},
            extra_body={"temperature": 0},
        ) as stream:
            final = stream.get_final_message()
        assert final.content[0].type == "thinking"
        assert final.content[0].thinking == reply.content[0].thinking  # greedy: equal
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            client.messages.create(model=model_name(model_dir), max_tokens=2, messages=QUESTION)  # type: ignore[arg-type]
        assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


def test_forced_dsml_call_parses(client: openai.OpenAI, model_dir: Path) -> None:
    """A named tool_choice: the grammar writes DSML, which our DSML parser reads back."""
    city = {"type": "string", "maxLength": 12}
    days = {"type": "integer", "enum": [1, 2, 3]}
    parameters = {"type": "object", "properties": {"city": city, "days": days}}
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {**parameters, "required": ["city", "days"]},
        },
    }
    response = client.chat.completions.create(
        model=model_name(model_dir),
        messages=QUESTION,  # type: ignore[arg-type]
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        max_tokens=400,
        temperature=0,
        extra_body={"thinking": {"type": "disabled"}},
    )
    [call] = response.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    assert isinstance(arguments["city"], str) and arguments["days"] in (1, 2, 3)
    assert response.choices[0].finish_reason == "tool_calls"


def test_a_thinking_budget_then_the_forced_call_or_json(
    client: openai.OpenAI, model_dir: Path
) -> None:
    """The demo never closes its reasoning on its own: at the budget the engine writes
    ``</think>``, and the answer's grammar follows, closed before max_tokens (a forced
    call's 130-odd tokens of DSML in the demo's text tokens)."""
    tokenizer = FrontTokenizer.load(model_dir)
    budget = 12
    thinking = {"thinking": {"type": "enabled", "budget_tokens": budget}}
    ask: dict[str, Any] = {"model": model_name(model_dir), "messages": QUESTION}
    forced = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 160}
    response = client.chat.completions.create(**ask, **forced, temperature=0, extra_body=thinking)
    choice = response.choices[0]
    [call] = choice.message.tool_calls or []
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert isinstance(json.loads(call.function.arguments), dict)  # type: ignore[union-attr]
    details = response.usage.completion_tokens_details  # type: ignore[union-attr]
    assert details is not None and details.reasoning_tokens == budget
    reasoning = choice.message.reasoning_content  # type: ignore[attr-defined]
    assert len(tokenizer.text_ids(reasoning + "</think>")) <= budget + 1  # merges differ
    json_object: dict[str, Any] = {"type": "json_object"}
    reply = client.chat.completions.create(
        **ask, response_format=json_object, max_tokens=24, seed=4, extra_body=thinking
    )
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    assert reply.choices[0].finish_reason == "stop"
