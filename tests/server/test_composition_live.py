"""Features that compose: thinking, constrained output and tools, under speculation,
through every API, on both demo formats.

The matrix of issue 29 over the real server: {thinking off, on with a budget} x
{json_object, json_schema strict, forced tool, required, auto} x {chat, Responses,
Messages}, all sent at once (a mixed batch) and a few alone, on the demo (its chat
template) and on the demo in DeepSeek-V4's published format, at the automatic
depth (which drafts at 1-5). Every answer must be valid: 200, and JSON that parses
(and follows the schema) or the forced call with arguments that validate. The
template demo has no reasoning markers, so there a thinking cell must be refused
by name (400), never a 5xx. Depths 1 and 3, greedy and seeded, alone and batched,
are also held token for token against depth 0 in-process
(tests/engine/spec/test_thinking_rounds.py).
"""

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from mlxserve.models.demo.deepseek_format import build_deepseek_format_demo
from tests.server.live import LiveServer

pytestmark = pytest.mark.slow

MAX_TOKENS = 160
BUDGET = 12
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
KINDS = ("json_object", "json_schema", "forced_tool", "required", "auto")
APIS = ("chat", "responses", "messages")
QUESTION = "Python reference: the weather of Paris"
CONFIG = """
model = "{model}"
[speculative]
depth = {depth}
[engine]
max_running = 8
[server]
port = 0
max_queue = 64
ready_interval_s = 5.0
"""


@pytest.fixture(scope="module", params=[("template", '"auto"'), ("dsv4", '"auto"')])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, LiveServer]]:
    fmt, depth = request.param
    model = str(build_deepseek_format_demo(progress=False)) if fmt == "dsv4" else "demo"
    workdir = tmp_path_factory.mktemp(f"compose-{fmt}")
    live = LiveServer(workdir, CONFIG.format(model=model, depth=depth))
    try:
        yield fmt, live.start()
    finally:
        assert live.stop() == 0, live.tail()


def body(api: str, kind: str, thinking: bool, model: str) -> tuple[str, dict[str, Any]]:
    """The route and body of one cell of the matrix."""
    if api == "chat":
        return "/v1/chat/completions", chat_body(kind, thinking, model)
    if api == "responses":
        return "/v1/responses", responses_body(kind, thinking, model)
    return "/v1/messages", messages_body(kind, thinking, model)


def chat_body(kind: str, thinking: bool, model: str) -> dict[str, Any]:
    weather = {"name": "get_weather", "parameters": SCHEMA}
    tools = [{"type": "function", "function": weather}]
    out: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    if thinking:
        out["thinking"] = {"type": "enabled", "budget_tokens": BUDGET}
    if kind == "json_object":
        out["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        schema = {"name": "city", "schema": SCHEMA, "strict": True}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    else:
        out["tools"] = tools
        out["tool_choice"] = {
            "forced_tool": {"type": "function", "function": {"name": "get_weather"}},
            "required": "required",
            "auto": "auto",
        }[kind]
    return out


def responses_body(kind: str, thinking: bool, model: str) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "input": QUESTION, "max_output_tokens": MAX_TOKENS}
    out["temperature"] = 0
    if thinking:
        out["reasoning"] = {"effort": "high", "budget_tokens": BUDGET}
    if kind == "json_object":
        out["text"] = {"format": {"type": "json_object"}}
    elif kind == "json_schema":
        fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
        out["text"] = {"format": fmt}
    else:
        out["tools"] = [
            {"type": "function", "name": "get_weather", "parameters": SCHEMA, "strict": True}
        ]
        out["tool_choice"] = {
            "forced_tool": {"type": "function", "name": "get_weather"},
            "required": "required",
            "auto": "auto",
        }[kind]
    return out


def messages_body(kind: str, thinking: bool, model: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    if thinking:
        out["thinking"] = {"type": "enabled", "budget_tokens": BUDGET}
    if kind in ("json_object", "json_schema"):  # Anthropic has JSON schemas only
        out["output_config"] = {"format": {"type": "json_schema", "schema": SCHEMA}}
    else:
        out["tools"] = [{"name": "get_weather", "input_schema": SCHEMA}]
        out["tool_choice"] = {
            "forced_tool": {"type": "tool", "name": "get_weather"},
            "required": {"type": "any"},
            "auto": {"type": "auto"},
        }[kind]
    return out


def follows_schema(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"city"} and isinstance(value["city"], str)


def answer_of(api: str, data: dict[str, Any]) -> tuple[str, list[tuple[str, Any]]]:
    """The answer's text and its calls (name, parsed arguments)."""
    if api == "chat":
        message = data["choices"][0]["message"]
        calls = [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls") or []
        ]
        return message.get("content") or "", calls
    if api == "responses":
        text, calls = "", []
        for item in data["output"]:
            if item["type"] == "message":
                text += "".join(p.get("text", "") for p in item["content"])
            elif item["type"] == "function_call":
                calls.append((item["name"], json.loads(item["arguments"])))
        return text, calls
    text = "".join(b.get("text", "") for b in data["content"] if b["type"] == "text")
    calls = [(b["name"], b["input"]) for b in data["content"] if b["type"] == "tool_use"]
    return text, calls


def check(api: str, kind: str, response: httpx.Response) -> str | None:
    """None when the answer is valid for its cell, else why not."""
    if response.status_code != 200:
        return f"{response.status_code} {response.text[:300]}"
    text, calls = answer_of(api, response.json())
    if kind in ("json_object", "json_schema"):
        try:
            value = json.loads(text)
        except ValueError:
            return f"not JSON: {text!r}"
        if kind == "json_object" and not isinstance(value, dict):
            return f"not an object: {text!r}"
        if kind == "json_schema" and not follows_schema(value):
            return f"does not follow the schema: {text!r}"
        return None
    if kind in ("forced_tool", "required"):
        if not calls:
            return f"no call: {text!r}"
        if any(name != "get_weather" or not follows_schema(args) for name, args in calls):
            return f"invalid call: {calls!r}"
        if "<tool_call>" in text or "DSML" in text:
            return f"call markup in the text: {text!r}"
        return None
    return None if not calls or all(follows_schema(args) for _, args in calls) else str(calls)


def test_every_cell_is_valid_alone_and_in_a_mixed_batch(served: tuple[str, LiveServer]) -> None:
    fmt, live = served
    model = "demo"
    if fmt == "dsv4":
        model = str(build_deepseek_format_demo(progress=False))
    cells = [(api, kind, thinking) for api in APIS for kind in KINDS for thinking in (False, True)]

    def send(cell: tuple[str, str, bool]) -> tuple[tuple[str, str, bool], httpx.Response]:
        api, kind, thinking = cell
        path, payload = body(api, kind, thinking, model)
        return cell, httpx.post(f"{live.url}{path}", json=payload, timeout=300)

    with ThreadPoolExecutor(len(cells)) as pool:
        batched = list(pool.map(send, cells))
    alone = [send(cell) for cell in cells if cell[0] == "chat" and cell[2]]
    problems = []
    for (api, kind, thinking), response in [*batched, *alone]:
        if thinking and fmt == "template":
            named = "thinking" in response.text or "reasoning" in response.text
            if response.status_code != 400 or not named:
                problems.append(f"{api} {kind} thinking: {response.status_code} {response.text}")
            continue
        problem = check(api, kind, response)
        if problem is not None:
            problems.append(f"{api} {kind} thinking={thinking}: {problem}")
    assert not problems, "\n".join(problems)
    assert not any(" 500 " in line or "Traceback" in line for line in live.lines), live.tail()
