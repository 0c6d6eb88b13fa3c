"""A chat request to the prompt the engine sees, and to how its answer is read back.

Three prompt formats (`Codec.prompt_format`): the model's chat template; DeepSeek-V4's
own encoder, for ``deepseek_v4`` models without a template (the published checkpoints
ship none); a plain transcript for base models. The thinking and tool controls mean
what each format can honour, and a control a format cannot honour is refused by name
rather than silently dropped:

- DeepSeek-V4 encoder: thinking on or off (default on, or ``[chat] thinking``),
  ``reasoning_effort`` "high" / "max", ``drop_thinking``, tools (DSML).
- A template whose vocabulary has ``<think>`` / ``</think>``: thinking on or off is
  passed to the template as ``enable_thinking``; no reasoning effort.
- A template with a tool-call format mlx-lm knows (``TokenizerWrapper.tool_parser``):
  tools go to the template, calls and tool results in the history too, and the
  answer is read with mlx-lm's parser (`MarkedToolParser`).
- Any other template, or the transcript: thinking can only be off; no tools.

``tool_choice`` ``required`` or a named function becomes a grammar (the call syntax
of the format, the arguments' schema) for the syntaxes mlxserve can write one for:
DSML and mlx-lm's ``json_tools``; another format refuses those two choices by name.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlxserve.models.deepseek_v4 import encoding as dsv4
from mlxserve.models.deepseek_v4.dsml import DsmlParser
from mlxserve.models.tool_calls import MarkedToolParser, ToolCallParser
from mlxserve.server.codec import Codec, transcript
from mlxserve.server.constraints import ToolStyle, after_reasoning, forced_tool_grammar
from mlxserve.server.errors import InvalidRequest
from mlxserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    NamedToolChoice,
    Tool,
)

ROLE_ALIASES = {"developer": "system"}


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    text: str
    #: The marker that ends the reasoning the prompt opened; None: no reasoning part.
    reasoning_end: str | None = None
    #: A new parser for the answer's tool calls; None: the answer is all text.
    tool_parser: Callable[[], ToolCallParser] | None = None
    #: The grammar of a forced tool call (tool_choice required or named); None: free.
    grammar: str | None = None


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


#: How a prompt's text becomes its token ids (`Codec.text_ids`, or a generating
#: route's `Generations.prompt_ids`, which first refuses a text too large to fit).
Encode = Callable[[str], list[int]]


def build_chat_prompt(
    body: ChatCompletionRequest,
    codec: Codec,
    default_thinking: bool | None,
    encode: Encode | None = None,
) -> ChatPrompt:
    encode = codec.text_ids if encode is None else encode
    thinking, thinking_field = requested_thinking(body)
    seen: set[str] = set()
    for i, tool in enumerate(body.tools or []):
        if tool.function.name in seen:  # a call could not say which one it meant
            raise InvalidRequest(
                f"two tools are named {tool.function.name!r}", param=f"tools.{i}.function.name"
            )
        seen.add(tool.function.name)
    forced = forced_tools(body)
    _refuse_unkept_strict(body, forced)
    tools = [declared_function(tool) for tool in body.tools or []]
    if body.tool_choice == "none":
        tools = []
    if codec.prompt_format == "deepseek_v4":
        on = thinking if thinking is not None else default_thinking is not False
        prompt = _deepseek_v4(body, encode, on, tools)
        style: ToolStyle | None = "dsml"
    else:
        prompt = _generic(body, codec, encode, thinking, thinking_field, default_thinking)
        style = "json_tools" if codec.tool_parser_name == "json_tools" else None
    if forced is None:
        return prompt
    if style is None:
        raise InvalidRequest(
            f"tool_choice: mlxserve cannot force a call in this model's tool-call format "
            f"({codec.tool_parser_name}); use 'auto'",
            param="tool_choice",
        )
    parallel = body.parallel_tool_calls is not False
    where = {tool.function.name: i for i, tool in enumerate(body.tools or [])}  # unique names
    calls = [(f"tools.{where[tool.name]}.function.parameters", tool) for tool in forced]
    grammar = forced_tool_grammar(style, calls, parallel, codec)
    if prompt.reasoning_end is not None:
        grammar = after_reasoning(grammar, prompt.reasoning_end, codec, "tools")
    return ChatPrompt(prompt.ids, prompt.text, prompt.reasoning_end, prompt.tool_parser, grammar)


def forced_tools(body: ChatCompletionRequest) -> list[FunctionDefinition] | None:
    """The functions one of which the answer must call (None: the model chooses)."""
    choice = body.tool_choice
    if choice is None or choice in ("auto", "none"):
        return None
    tools = [tool.function for tool in body.tools or []]
    if not tools:
        raise InvalidRequest("tool_choice: there are no tools to call", param="tool_choice")
    if body.response_format is not None and body.response_format.type != "text":
        raise InvalidRequest(
            "response_format and a forced tool call cannot both shape the answer",
            param="response_format",
        )
    if isinstance(choice, NamedToolChoice):
        named = [tool for tool in tools if tool.name == choice.function.name]
        if not named:
            raise InvalidRequest(
                f"tool_choice: no tool is named {choice.function.name!r}",
                param="tool_choice.function.name",
            )
        return named
    return tools


def _refuse_unkept_strict(
    body: ChatCompletionRequest, forced: list[FunctionDefinition] | None
) -> None:
    """``strict: true`` promises arguments that follow the schema. A grammar keeps that
    promise where the answer must call the function; with ``auto`` nothing does, so
    there it is refused rather than accepted and broken."""
    for i, tool in enumerate(body.tools or []):
        if tool.function.strict and (forced is None or tool.function not in forced):
            raise InvalidRequest(
                "strict arguments are kept only where tool_choice forces a call of this "
                "function ('required' or its name); with 'auto' send strict: false",
                param=f"tools.{i}.function.strict",
            )


def declared_function(tool: Tool) -> dict[str, Any]:
    """The function as the prompt shows it: its name, description and parameters (not
    ``strict``, nor the empty keys a client echoed)."""
    return tool.function.model_dump(
        exclude_none=True, include={"name", "description", "parameters"}
    )


def _deepseek_v4(
    body: ChatCompletionRequest, encode: Encode, thinking: bool, tools: list[dict[str, Any]]
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
        encode(text),
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
    encode: Encode,
    thinking: bool | None,
    thinking_field: str,
    default_thinking: bool | None,
) -> ChatPrompt:
    """A template or the transcript: tools if mlx-lm knows the template's call format,
    no reasoning effort, thinking if the template has it."""
    where = "the model's chat template" if codec.has_chat_template else "this model (no template)"
    markers = codec.tool_markers
    if body.tools and markers is None:
        raise InvalidRequest(
            f"tools are not supported with {where}: it has no tool-call format mlx-lm knows",
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
        if markers is None and (message.role == "tool" or message.tool_calls):
            field = "role" if message.role == "tool" else "tool_calls"
            raise InvalidRequest(
                f"tool messages and tool calls are not supported with {where}",
                param=f"messages.{i}.{field}",
            )
    think = codec.think_markers if codec.has_chat_template else None
    if think is None and thinking:
        raise InvalidRequest(f"{where} has no thinking mode", param=thinking_field)
    messages = [_template_message(i, m) for i, m in enumerate(body.messages)]
    if not codec.has_chat_template:
        text = transcript(messages)
        return ChatPrompt(encode(text), text)
    on = thinking if thinking is not None else default_thinking
    extra: dict[str, Any] = {} if on is None or think is None else {"enable_thinking": on}
    tools = [{"type": "function", "function": declared_function(tool)} for tool in body.tools or []]
    if tools and body.tool_choice != "none":
        extra["tools"] = tools
    text = codec.template_text(messages, **extra)
    end = think[1] if think is not None and text.rstrip().endswith(think[0]) else None
    parser = None
    if markers is not None and "tools" in extra:
        start, stop, parse = markers
        parser = functools.partial(MarkedToolParser, start, stop, parse, tools)
    return ChatPrompt(encode(text), text, reasoning_end=end, tool_parser=parser)


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message as Hugging Face chat templates take it (call arguments as objects)."""
    out: dict[str, Any] = {"role": ROLE_ALIASES.get(message.role, message.role)}
    out["content"] = message.text()
    if message.tool_calls:
        if message.role != "assistant":
            raise InvalidRequest(
                "only assistant messages carry tool_calls", param=f"messages.{index}.tool_calls"
            )
        calls = []
        for j, call in enumerate(message.tool_calls):
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError:
                raise InvalidRequest(
                    "the arguments are not JSON",
                    param=f"messages.{index}.tool_calls.{j}.function.arguments",
                ) from None
            function = {"name": call.function.name, "arguments": arguments}
            calls.append({"id": call.id, "type": "function", "function": function})
        out["tool_calls"] = calls
    if message.role == "tool":
        if message.tool_call_id is None:
            raise InvalidRequest(
                "a tool message needs the tool_call_id it answers",
                param=f"messages.{index}.tool_call_id",
            )
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out
