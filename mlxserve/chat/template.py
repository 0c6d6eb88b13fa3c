"""A chat request through the model's chat template, or a plain transcript without one.

What a template can honour, it is given: ``enable_thinking`` where its vocabulary has
``<think>`` / ``</think>``; tools, calls and tool results in the history where mlx-lm
knows its tool-call format (``TokenizerWrapper.tool_parser``), the answer then read
with mlx-lm's parser (`MarkedToolParser`). No template has reasoning levels. The
transcript, for base models, has neither thinking nor tools.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from mlxserve.chat.prompt import ChatPrompt, ChatTokenizer, Encode
from mlxserve.chat.request import ChatRequest, Message, Refused
from mlxserve.chat.tool_calls import MarkedToolParser

ROLE_ALIASES = {"developer": "system"}


def template_prompt(
    body: ChatRequest,
    tokenizer: ChatTokenizer,
    encode: Encode,
    thinking: bool | None,
    thinking_field: str,
    default_thinking: bool | None,
) -> ChatPrompt:
    """A template or the transcript: tools if mlx-lm knows the template's call format,
    no reasoning effort, thinking if the template has it."""
    where = (
        "the model's chat template" if tokenizer.has_chat_template else "this model (no template)"
    )
    markers = tokenizer.tool_markers
    if body.tools and markers is None:
        raise Refused(
            f"tools are not supported with {where}: it has no tool-call format mlx-lm knows",
            param="tools",
        )
    if body.reasoning_effort is not None:
        raise Refused(
            f"reasoning_effort is not supported with {where}; only DeepSeek-V4's "
            "encoder has reasoning levels",
            param="reasoning_effort",
        )
    if (
        body.chat_template_kwargs is not None
        and body.chat_template_kwargs.drop_thinking is not None
    ):
        raise Refused(
            "drop_thinking is a DeepSeek-V4 encoder setting",
            param="chat_template_kwargs.drop_thinking",
        )
    for i, message in enumerate(body.messages):
        if markers is None and (message.role == "tool" or message.tool_calls):
            field = "role" if message.role == "tool" else "tool_calls"
            raise Refused(
                f"tool messages and tool calls are not supported with {where}",
                param=f"messages.{i}.{field}",
            )
    think = tokenizer.think_markers if tokenizer.has_chat_template else None
    if think is None and thinking:
        raise Refused(f"{where} has no thinking mode", param=thinking_field)
    messages = [_template_message(i, m) for i, m in enumerate(body.messages)]
    if not tokenizer.has_chat_template:
        text = transcript(messages)
        return ChatPrompt(encode(text), text)
    on = thinking if thinking is not None else default_thinking
    extra: dict[str, Any] = {} if on is None or think is None else {"enable_thinking": on}
    tools = [{"type": "function", "function": tool.declared()} for tool in body.tools]
    if tools and body.tool_choice != "none":
        extra["tools"] = tools
    text = tokenizer.template_text(messages, **extra)
    end = think[1] if think is not None and text.rstrip().endswith(think[0]) else None
    parser = None
    if markers is not None and "tools" in extra:
        start, stop, parse = markers
        parser = functools.partial(MarkedToolParser, start, stop, parse, tools)
    return ChatPrompt(encode(text), text, reasoning_end=end, tool_parser=parser)


def _template_message(index: int, message: Message) -> dict[str, Any]:
    """A message as Hugging Face chat templates take it (call arguments as objects)."""
    out: dict[str, Any] = {"role": ROLE_ALIASES.get(message.role, message.role)}
    out["content"] = message.content
    if message.tool_calls:
        if message.role != "assistant":
            raise Refused(
                "only assistant messages carry tool_calls", param=f"messages.{index}.tool_calls"
            )
        calls = []
        for j, call in enumerate(message.tool_calls):
            try:
                arguments = json.loads(call.arguments or "{}")
            except json.JSONDecodeError:
                raise Refused(
                    "the arguments are not JSON",
                    param=f"messages.{index}.tool_calls.{j}.function.arguments",
                ) from None
            function = {"name": call.name, "arguments": arguments}
            calls.append({"id": call.id, "type": "function", "function": function})
        out["tool_calls"] = calls
    if message.role == "tool":
        if message.tool_call_id is None:
            raise Refused(
                "a tool message needs the tool_call_id it answers",
                param=f"messages.{index}.tool_call_id",
            )
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def transcript(messages: list[dict[str, Any]]) -> str:
    """No template and no encoder: a plain transcript, so base models still answer something."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
