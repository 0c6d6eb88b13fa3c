"""A chat request to the prompt the engine sees, and to how its answer is read back.

Three prompt formats (`Codec.prompt_format`): the model's chat template; DeepSeek-V4's
own encoder, for ``deepseek_v4`` models without a template (the published checkpoints
ship none); a plain transcript for base models. The thinking and tool controls mean
what each format can honour, and a control a format cannot honour is refused by name
rather than silently dropped:

- DeepSeek-V4 encoder: thinking on or off (default on, or ``[chat] thinking``),
  ``reasoning_effort`` "high" / "max", ``drop_thinking``, tools (DSML).
- A template whose vocabulary has ``<think>`` / ``</think>``: thinking on or off is
  passed to the template as ``enable_thinking``; no reasoning effort, no tools yet.
- Any other template, or the transcript: thinking can only be off; no tools.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlxserve.models.deepseek_v4 import encoding as dsv4
from mlxserve.models.deepseek_v4.dsml import DsmlParser
from mlxserve.models.tool_calls import ToolCallParser
from mlxserve.server.codec import Codec, transcript
from mlxserve.server.errors import InvalidRequest
from mlxserve.server.protocol import ChatCompletionRequest, ChatMessage

ROLE_ALIASES = {"developer": "system"}


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    text: str
    #: The marker that ends the reasoning the prompt opened; None: no reasoning part.
    reasoning_end: str | None = None
    #: A new parser for the answer's tool calls; None: the answer is all text.
    tool_parser: Callable[[], ToolCallParser] | None = None


def requested_thinking(body: ChatCompletionRequest) -> tuple[bool | None, str]:
    """The request's thinking switch (None: not asked) and the field that set it.

    ``thinking.type`` and ``chat_template_kwargs.thinking`` / ``enable_thinking`` mean
    the same; when they disagree the request is refused rather than one picked.
    """
    asked: list[tuple[bool, str]] = []
    if body.thinking is not None:
        asked.append((body.thinking.type == "enabled", "thinking"))
    kwargs = body.chat_template_kwargs
    if kwargs is not None:
        for key in ("thinking", "enable_thinking"):
            value = getattr(kwargs, key)
            if value is not None:
                asked.append((value, f"chat_template_kwargs.{key}"))
    if len({value for value, _ in asked}) > 1:
        names = " and ".join(name for _, name in asked)
        raise InvalidRequest(f"{names} disagree", param=asked[-1][1])
    return (asked[0][0], asked[0][1]) if asked else (None, "thinking")


def build_chat_prompt(
    body: ChatCompletionRequest, codec: Codec, default_thinking: bool | None
) -> ChatPrompt:
    thinking, thinking_field = requested_thinking(body)
    tools = [tool.function.model_dump(exclude_none=True) for tool in body.tools or []]
    if body.tool_choice == "none":
        tools = []
    if codec.prompt_format == "deepseek_v4":
        on = thinking if thinking is not None else default_thinking is not False
        return _deepseek_v4(body, codec, on, tools)
    return _generic(body, codec, thinking, thinking_field, default_thinking)


def _deepseek_v4(
    body: ChatCompletionRequest, codec: Codec, thinking: bool, tools: list[dict[str, Any]]
) -> ChatPrompt:
    messages = [_dsv4_message(i, m) for i, m in enumerate(body.messages)]
    kwargs = body.chat_template_kwargs
    drop = kwargs is None or kwargs.drop_thinking is not False
    try:
        text = dsv4.encode(
            messages,
            thinking=thinking,
            tools=tools,
            reasoning_effort=body.reasoning_effort,
            drop_thinking=drop,
        )
    except dsv4.PromptError as exc:
        raise InvalidRequest(f"messages: {exc}", param="messages") from None
    return ChatPrompt(
        codec.text_ids(text),
        text,
        reasoning_end=dsv4.THINK_END if thinking else None,
        tool_parser=DsmlParser if tools else None,
    )


def _dsv4_message(index: int, message: ChatMessage) -> dsv4.Message:
    calls = tuple(
        dsv4.ToolCall(call.function.name, call.function.arguments, call.id)
        for call in message.tool_calls or []
    )
    if calls and message.role != "assistant":
        raise InvalidRequest(
            "only assistant messages carry tool_calls", param=f"messages.{index}.tool_calls"
        )
    if message.role == "tool" and message.tool_call_id is None:
        raise InvalidRequest(
            "a tool message needs the tool_call_id it answers",
            param=f"messages.{index}.tool_call_id",
        )
    return dsv4.Message(
        message.role,
        message.text(),
        reasoning_content=message.reasoning_content if message.role == "assistant" else None,
        tool_calls=calls,
        tool_call_id=message.tool_call_id or "",
    )


def _generic(
    body: ChatCompletionRequest,
    codec: Codec,
    thinking: bool | None,
    thinking_field: str,
    default_thinking: bool | None,
) -> ChatPrompt:
    """A template or the transcript: no tools, no reasoning effort, thinking if the
    template has it."""
    where = "the model's chat template" if codec.has_chat_template else "this model (no template)"
    if body.tools:
        raise InvalidRequest(
            f"tools are not supported with {where}; mlxserve reads tool calls of "
            "DeepSeek-V4 models only",
            param="tools",
        )
    if body.reasoning_effort is not None:
        raise InvalidRequest(
            f"reasoning_effort is not supported with {where}; only DeepSeek-V4's "
            "encoder has reasoning levels",
            param="reasoning_effort",
        )
    if (
        body.chat_template_kwargs is not None
        and body.chat_template_kwargs.drop_thinking is not None
    ):
        raise InvalidRequest(
            "drop_thinking is a DeepSeek-V4 encoder setting",
            param="chat_template_kwargs.drop_thinking",
        )
    for i, message in enumerate(body.messages):
        if message.role == "tool" or message.tool_calls:
            field = "role" if message.role == "tool" else "tool_calls"
            raise InvalidRequest(
                f"tool messages and tool calls are not supported with {where}",
                param=f"messages.{i}.{field}",
            )
    markers = codec.think_markers if codec.has_chat_template else None
    if markers is None and thinking:
        raise InvalidRequest(f"{where} has no thinking mode", param=thinking_field)
    messages = [
        {"role": ROLE_ALIASES.get(m.role, m.role), "content": m.text()} for m in body.messages
    ]
    if not codec.has_chat_template:
        text = transcript(messages)
        return ChatPrompt(codec.text_ids(text), text)
    on = thinking if thinking is not None else default_thinking
    extra = {} if on is None or markers is None else {"enable_thinking": on}
    text = codec.template_text(messages, **extra)
    end = markers[1] if markers is not None and text.rstrip().endswith(markers[0]) else None
    return ChatPrompt(codec.text_ids(text), text, reasoning_end=end)
