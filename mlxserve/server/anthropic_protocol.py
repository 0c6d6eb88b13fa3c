"""The Anthropic Messages request shapes, and their translation to the one internal
chat request (`ChatCompletionRequest`) every API shares.

Unknown fields are refused by name, as in the OpenAI codec. Content blocks, which
clients echo back whole, accept an unknown key only empty (an SDK field nobody
filled, as ``citations`` or ``caller``) and ``cache_control`` (the prefix cache is
automatic). Content blocks mlxserve cannot read
(images, documents, server tools) are refused by their position.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxserve.server.errors import InvalidRequest
from mlxserve.server.protocol import (
    ChatCompletionRequest,
    Echoing,
    function_tool,
    translated_chat,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Block(Echoing):
    """A content block; the ``type`` decides what is read."""

    cache_control: dict[str, Any] | None = Field(
        None, description="accepted; changes nothing (the prefix cache is automatic)"
    )


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool | None = None

    def text(self) -> str:
        body = (
            self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        )
        return f"Error: {body}" if self.is_error else body


#: Told apart by ``type``, so a bad block's error comes from its own kind only.
Block = Annotated[
    TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock,
    Field(discriminator="type"),
]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDefinition(_Strict):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = Field(None, description="accepted; changes nothing")


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Strict):
    """``adaptive`` leaves the switch to the server's default ([chat] thinking);
    ``budget_tokens`` (``enabled`` only, as Anthropic's) bounds the reasoning: there the
    engine forces its end and the answer follows."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(
        None, ge=1, description="the reasoning's most tokens, its end marker included"
    )
    display: str | None = Field(None, description="accepted; thinking is always shown")


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    """``format``: the answer follows the JSON schema (a grammar); ``effort`` is the
    reasoning effort (chat's ``reasoning_effort``: DeepSeek-V4's encoder has levels)."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class MessagesRequest(_Strict):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = Field(None, max_length=16)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = False
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = Field(None, description="accepted; changes nothing")
    service_tier: str | None = Field(None, description="accepted; changes nothing")


class CountTokensRequest(_Strict):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


def to_chat(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The internal chat request for an Anthropic one (what the OpenAI codec builds too)."""
    messages: list[dict[str, Any]] = []
    if body.system:
        system = (
            body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        )
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(body.messages):
        messages += _turn(index, message)
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        chat["tools"] = [
            function_tool(tool.name, tool.description, tool.input_schema) for tool in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise InvalidRequest("tool_choice: type 'tool' needs a name", param="tool_choice")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    thinking = body.thinking
    if thinking is not None and thinking.budget_tokens is not None and thinking.type != "enabled":
        raise InvalidRequest(
            f"thinking.budget_tokens goes with type 'enabled', not '{thinking.type}'",
            param="thinking.budget_tokens",
        )
    if thinking is not None and thinking.type != "adaptive":
        chat["thinking"] = {"type": thinking.type, "budget_tokens": thinking.budget_tokens}
    if isinstance(body, MessagesRequest) and body.output_config is not None:
        output = body.output_config
        if output.format is not None:
            chat["response_format"] = {
                "type": "json_schema",
                # Not OpenAI's strict subset (Anthropic takes optional properties): the
                # grammar enforces the schema as it is.
                "json_schema": {"name": "output", "schema": output.format.schema_},
            }
        if output.effort is not None:
            chat["reasoning_effort"] = output.effort
    if isinstance(body, MessagesRequest):
        chat["max_tokens"] = body.max_tokens
        for key in ("temperature", "top_p", "top_k"):
            if getattr(body, key) is not None:
                chat[key] = getattr(body, key)
        if body.stop_sequences:
            chat["stop"] = body.stop_sequences
    return translated_chat(chat)


def _turn(index: int, message: Message) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become ``tool`` messages."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for number, block in enumerate(message.content):
        where = f"messages.{index}.content.{number}"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock | RedactedThinkingBlock):
            if message.role != "assistant":
                raise InvalidRequest("thinking blocks belong to assistant turns", param=where)
            if isinstance(block, ThinkingBlock):
                reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise InvalidRequest("tool_use blocks belong to assistant turns", param=where)
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": arguments},
                }
            )
        else:
            if message.role != "user":
                raise InvalidRequest("tool_result blocks belong to user turns", param=where)
            results.append(
                {"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()}
            )
    if message.role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        if reasoning:
            turn["reasoning_content"] = "".join(reasoning)
        return [turn]
    text = "".join(texts)
    return [*results, *([{"role": "user", "content": text}] if text or not results else [])]
