# ruff: noqa: RUF001, RUF002
"""The real server on a tiny DeepSeek-V4.1 with Engram, in V4.1's own prompt format.

The checkpoint is `tests.models.v41_fixtures` (published key names, Engram layers, a
vision tower and a draft head the server leaves out) with the tokenizer dressed as
DeepSeek's (its special tokens, no chat template), so the front builds its prompts
with V4.1's dialect: ``<｜System｜>``, the numeric effort line, spaced DSML tags. Its
weights are random: what it writes is only checked where the server decides it (the
split at ``</think>``, a forced call's markup read back, the reasoning budget).
"""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from mlxserve.models.demo.build import WEIGHTS_DIR
from mlxserve.models.demo.deepseek_format import _write_tokenizer
from mlxserve.server.tokenizer import FrontTokenizer
from tests.models.v41_fixtures import write_v41
from tests.server.live import LiveServer

pytestmark = pytest.mark.slow

B, S, U, A = "<｜begin▁of▁sentence｜>", "<｜System｜>", "<｜User｜>", "<｜Assistant｜>"
EFFORT = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)"
QUESTION = [{"role": "user", "content": "Python reference: for"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
CONFIG = """
model = "{model}"
[engine]
max_running = 2
prefill_step = 64
[server]
port = 0
ready_interval_s = 2.0
"""
CHAT_OFF = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = write_v41(tmp_path_factory.mktemp("v41") / "DeepSeek-V4.1-tiny", engram=True)
    _write_tokenizer(WEIGHTS_DIR, directory)  # DeepSeek's special tokens, no template
    return directory


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LiveServer]:
    live = LiveServer(tmp_path_factory.mktemp("v41-serve"), CONFIG.format(model=model_dir))
    try:
        yield live.start()
    finally:
        assert live.stop() == 0, live.tail()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


def prompt_of(server: LiveServer, model_dir: Path, **body: Any) -> str:
    with server.client() as http:
        response = http.post("/tokenize", json={"model": str(model_dir), **body})
    assert response.status_code == 200, response.text
    prompt: str = response.json()["prompt"]
    return prompt


def test_the_front_picks_v41_s_format_from_the_config(model_dir: Path) -> None:
    tokenizer = FrontTokenizer.load(model_dir)
    assert (tokenizer.prompt_format, tokenizer.deepseek_release) == ("deepseek_v4", "v4.1")


def test_prompts_in_v41_s_dialect(server: LiveServer, model_dir: Path) -> None:
    thinking = prompt_of(server, model_dir, messages=QUESTION)
    assert thinking == f"{B}{S}{EFFORT.format(75)}\n\n{U}Python reference: for{A}<think>"
    effort = prompt_of(server, model_dir, messages=QUESTION, reasoning_effort="max")
    assert effort.startswith(f"{B}{S}{EFFORT.format(100)}\n\n{U}")
    chat = prompt_of(server, model_dir, messages=QUESTION, **CHAT_OFF)
    assert chat == f"{B}{U}Python reference: for{A}</think>"
    with server.client() as http:
        developer = [{"role": "developer", "content": "Be brief."}, *QUESTION]
        response = http.post("/tokenize", json={"model": str(model_dir), "messages": developer})
    assert response.status_code == 400 and "developer" in response.json()["error"]["message"]


def test_a_chat_answer_and_the_same_answer_streamed(client: openai.OpenAI, model_dir: Path) -> None:
    ask: dict[str, Any] = {"model": str(model_dir), "messages": QUESTION, "max_tokens": 12}
    reply = client.chat.completions.create(**ask, temperature=0, extra_body=CHAT_OFF)
    message = reply.choices[0].message
    assert message.content and getattr(message, "reasoning_content", None) is None
    assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 12
    stream = client.chat.completions.create(**ask, temperature=0, stream=True, extra_body=CHAT_OFF)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == message.content  # greedy: the same tokens


def test_a_tool_call_round(server: LiveServer, client: openai.OpenAI, model_dir: Path) -> None:
    """tool_choice required: the grammar writes V4.1's DSML, the parser reads it back as
    a call; the call and its result then go back into a V4.1 prompt, which is answered."""
    ask: dict[str, Any] = {"model": str(model_dir), "messages": QUESTION, "tools": [WEATHER]}
    response = client.chat.completions.create(
        **ask, tool_choice="required", max_tokens=200, temperature=0, extra_body=CHAT_OFF
    )
    choice = response.choices[0]
    [call] = choice.message.tool_calls or []
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    city = json.loads(call.function.arguments)["city"]  # type: ignore[union-attr]
    assert isinstance(city, str) and len(city) <= 12
    history: list[dict[str, Any]] = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    prompt = prompt_of(server, model_dir, messages=history, tools=[WEATHER], **CHAT_OFF)
    written = (
        f"{A}</think>\n\n<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="get_weather">\n'
        f'<｜DSML｜ parameter name="city" string="true">{city}</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>"
        f"{U}<tool_result>sunny</tool_result>{A}</think>"
    )
    assert prompt.startswith(f"{B}{S}\n\n## Tools\n\n") and prompt.endswith(written)
    answer = client.chat.completions.create(
        model=str(model_dir),
        messages=history,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=8,
        temperature=0,
        extra_body=CHAT_OFF,
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_thinking_with_a_budget(client: openai.OpenAI, model_dir: Path) -> None:
    """The reasoning stops at its budget (the engine writes ``</think>`` there, or the
    model does before), and the answer follows as content."""
    budget = 8
    response = client.chat.completions.create(
        model=str(model_dir),
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=20,
        temperature=0,
        extra_body={"thinking": {"type": "enabled", "budget_tokens": budget}},
    )
    message = response.choices[0].message
    assert getattr(message, "reasoning_content", None)
    details = response.usage.completion_tokens_details  # type: ignore[union-attr]
    assert details is not None and 0 < (details.reasoning_tokens or 0) <= budget
    assert response.usage is not None and response.usage.completion_tokens > budget
