"""A chat request through DeepSeek-V4's encoder, for ``deepseek_v4`` and ``deepseek_v41``
models without a template.

The published checkpoints ship no chat template: the prompt is DeepSeek-V4's own
format (`encoding`), with thinking on or off, ``reasoning_effort`` (`EFFORT_LEVELS`),
``drop_thinking``, tools, whose calls the answer writes in DSML (`dsml`), and a
``json_schema`` response format's schema, which the prompt shows as the reference does.
The checkpoint (``release``) picks the effort prompts and, for V4.1, its dialect: its
system token and spaced DSML tags, in the prompt and in the parser of the answer.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from mlxserve.chat.deepseek_v4 import encoding as dsv4
from mlxserve.chat.deepseek_v4.dsml import DsmlParser
from mlxserve.chat.prompt import ChatPrompt, Encode
from mlxserve.chat.request import ChatRequest, Message, ReasoningEffort, Refused

#: The model's effort level each ``reasoning_effort`` asks for, as DeepSeek's API maps
#: them (its thinking-mode guide): OpenAI's levels and DeepSeek's ``ultra`` fold into
#: low / high / max, whose prompts depend on the checkpoint (`encoding.effort_prompt`:
#: V4.1 writes them as its numbers 50 / 75 / 100).
EFFORT_LEVELS: dict[ReasoningEffort, dsv4.ReasoningEffort] = {
    "minimal": "low",
    "low": "low",
    "medium": "high",
    "high": "high",
    "xhigh": "high",
    "max": "max",
    "ultra": "max",
}


def deepseek_v4_prompt(
    body: ChatRequest,
    encode: Encode,
    thinking: bool,
    tools: list[dict[str, Any]],
    release: dsv4.DeepSeekRelease = "v4",
) -> ChatPrompt:
    """``body`` through the encoder (``reasoning_effort`` "none" is thinking off, which
    the caller has decided: here it is no level)."""
    messages = [_dsv4_message(i, m) for i, m in enumerate(body.messages)]
    kwargs = body.chat_template_kwargs
    drop = kwargs is None or kwargs.drop_thinking is not False
    try:
        text = dsv4.encode(
            messages,
            thinking=thinking,
            tools=tools,
            response_format=body.response_schema,
            reasoning_effort=EFFORT_LEVELS.get(body.reasoning_effort or "none"),
            drop_thinking=drop,
            release=release,
        )
    except dsv4.PromptError as exc:
        raise Refused(f"messages: {exc}", param="messages") from None
    return ChatPrompt(
        encode(text),
        text,
        reasoning_end=dsv4.THINK_END if thinking else None,
        tool_parser=partial(DsmlParser, dsv4.dialect_of(release)) if tools else None,
    )


def _dsv4_message(index: int, message: Message) -> dsv4.Message:
    calls = tuple(dsv4.ToolCall(call.name, call.arguments, call.id) for call in message.tool_calls)
    if calls and message.role != "assistant":
        raise Refused(
            "only assistant messages carry tool_calls", param=f"messages.{index}.tool_calls"
        )
    if message.role == "tool" and message.tool_call_id is None:
        raise Refused(
            "a tool message needs the tool_call_id it answers",
            param=f"messages.{index}.tool_call_id",
        )
    tool_result_parts = message.parts if message.role == "tool" else None
    return dsv4.Message(
        message.role,
        message.content if tool_result_parts is None else tool_result_parts,
        reasoning_content=message.reasoning_content if message.role == "assistant" else None,
        tool_calls=calls,
        tool_call_id=message.tool_call_id or "",
    )
