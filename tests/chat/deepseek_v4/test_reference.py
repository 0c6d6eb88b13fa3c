"""DeepSeek-V4's encoder and DSML parser against DeepSeek's reference, byte for byte.

The cases are data (``reference/``, README.md there): DeepSeek's own four test cases
(conversations and the exact prompts its ``encoding_dsv4.py`` writes), and more
conversations and model answers whose expected text the reference wrote. Each prompt
is built twice: by the encoder from the conversation, and through the server's path
(an API request through `chat_request` and `build_prompt`) wherever an API request
can say the same. Each answer is read whole and streamed, split at every place.
"""

from typing import Any

import pytest

from mlxserve.chat import build_prompt
from mlxserve.chat.deepseek_v4.dsml import DsmlParser
from mlxserve.chat.deepseek_v4.encoding import EOS, Message, ToolCall, encode
from mlxserve.chat.output import ChatOutput, Content, Reasoning
from mlxserve.chat.tool_calls import ParsedToolCall
from mlxserve.server.chat_request import chat_request
from mlxserve.server.protocol import ChatCompletionRequest
from tests.chat.deepseek_v4.reference import (
    DEEPSEEK_CASES,
    golden_output,
    load,
    prompt_messages,
)

CASES = load()


def _tools(given: list[dict[str, Any]] | None) -> tuple[dict[str, Any], ...]:
    return tuple(tool["function"] for tool in given or [])


def encoder_message(message: dict[str, Any]) -> Message:
    """A message as the reference takes it (OpenAI's shape, and DeepSeek's own keys)."""
    content = message.get("content") or ""
    if isinstance(content, list):  # a tool result's text parts
        content = tuple(part["text"] for part in content)
    return Message(
        message["role"],
        content,
        reasoning_content=message.get("reasoning_content"),
        tool_calls=tuple(
            ToolCall(call["function"]["name"], call["function"]["arguments"], call.get("id", ""))
            for call in message.get("tool_calls") or []
        ),
        tool_call_id=message.get("tool_call_id", ""),
        tools=_tools(message.get("tools")),
        response_format=message.get("response_format"),
        task=message.get("task"),
    )


def name_of(case: dict[str, Any]) -> str:
    return str(case["name"])


@pytest.mark.parametrize("case", CASES["prompts"], ids=name_of)
def test_the_encoder_writes_the_references_prompt(case: dict[str, Any]) -> None:
    messages = [encoder_message(m) for m in prompt_messages(CASES, case)]
    prompt = encode(
        messages,
        thinking=case["thinking_mode"] == "thinking",
        reasoning_effort=case["reasoning_effort"],
        drop_thinking=case["drop_thinking"],
    )
    assert prompt == case["expected"]


def test_deepseeks_own_transcripts_are_among_the_cases() -> None:
    for number, mode in DEEPSEEK_CASES.items():
        name = f"deepseek-{number}"
        whole = len(CASES["conversations"][name])
        [case] = [
            c
            for c in CASES["prompts"]
            if (c["conversation"], c["length"], c["thinking_mode"]) == (name, whole, mode)
        ]
        assert case["expected"] == golden_output(number)


def api_request(messages: list[dict[str, Any]], case: dict[str, Any]) -> dict[str, Any] | None:
    """The chat request that says what ``messages`` say, or None where none can: the
    request's tools and schema go on the first message, and the API has no
    ``latest_reminder`` role nor tasks."""
    first = messages[0]
    if any(m["role"] == "latest_reminder" or "task" in m for m in messages):
        return None
    if any("tools" in m or "response_format" in m for m in messages[1:]):
        return None
    if first["role"] == "developer" and "response_format" in first and "tools" not in first:
        return None  # a schema alone goes on a new system message (`encoding._attach`)
    body: dict[str, Any] = {
        "model": "m",
        "messages": [
            {key: value for key, value in m.items() if key not in ("tools", "response_format")}
            | ({"tool_call_id": ""} if m["role"] == "tool" and "tool_call_id" not in m else {})
            for m in messages
        ],
        "thinking": {"type": "enabled" if case["thinking_mode"] == "thinking" else "disabled"},
    }
    if "tools" in first:
        body["tools"] = first["tools"]
    if "response_format" in first:
        schema = {"name": "answer", "schema": first["response_format"]}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    if case["reasoning_effort"] is not None:
        body["reasoning_effort"] = case["reasoning_effort"]
    if not case["drop_thinking"]:
        body["chat_template_kwargs"] = {"drop_thinking": False}
    return body


class Dsv4Tokenizer:
    """What `build_prompt` asks of a DeepSeek-V4 model without a template."""

    has_chat_template = False
    prompt_format = "deepseek_v4"
    think_markers = ("<think>", "</think>")
    tool_markers = None
    tool_parser_name = None
    deepseek_release = "v4"  # the checkpoint the reference's cases are for

    def template_text(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        raise AssertionError("no template")

    def text_ids(self, text: str) -> list[int]:
        return []


SERVER_CASES = [
    (case, body)
    for case in CASES["prompts"]
    if (body := api_request(prompt_messages(CASES, case), case)) is not None
]


@pytest.mark.parametrize(("case", "body"), SERVER_CASES, ids=[c["name"] for c, _ in SERVER_CASES])
def test_the_server_writes_the_references_prompt(
    case: dict[str, Any], body: dict[str, Any]
) -> None:
    request = chat_request(ChatCompletionRequest.model_validate(body))
    prompt = build_prompt(request, Dsv4Tokenizer(), None)
    assert prompt.text == case["expected"]


def read(chunks: list[str], thinking: bool) -> tuple[str, str, list[tuple[str, str]], bool]:
    """Reasoning, content, calls (name, arguments) and whether anything came back
    malformed, from an answer streamed in ``chunks``."""
    output = ChatOutput(reasoning_end="</think>" if thinking else None, tools=DsmlParser())
    pieces = [piece for chunk in chunks for piece in output.push(chunk)] + output.finish()
    return (
        "".join(p.text for p in pieces if isinstance(p, Reasoning)),
        "".join(p.text for p in pieces if isinstance(p, Content)),
        [(p.name, p.arguments) for p in pieces if isinstance(p, ParsedToolCall)],
        output.malformed,
    )


@pytest.mark.parametrize("case", CASES["completions"], ids=name_of)
def test_the_parser_reads_what_the_reference_reads(case: dict[str, Any]) -> None:
    """The answer ends at the end-of-sentence token, which the engine stops at."""
    text = case["text"].removesuffix(EOS)
    thinking = case["thinking_mode"] == "thinking"
    wanted = case["expected"]
    expected = (
        wanted["reasoning_content"],
        wanted["content"],
        [tuple(call) for call in wanted["tool_calls"]],
        False,
    )
    assert read([text], thinking) == expected
    assert read(list(text), thinking) == expected
    for cut in range(1, len(text)):
        assert read([text[:cut], text[cut:]], thinking) == expected, cut
