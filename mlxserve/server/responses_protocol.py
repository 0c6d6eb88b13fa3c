"""The OpenAI Responses request shape, and its translation to the internal chat request.

mlxserve keeps no conversation state: ``previous_response_id``, ``conversation`` and
stored responses are refused; the client sends the whole input, as with chat.
Unknown fields are refused by name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mlxserve.chat.request import ReasoningEffort
from mlxserve.server.errors import InvalidRequest
from mlxserve.server.protocol import (
    SEED_RANGE,
    ChatCompletionRequest,
    function_tool,
    translated_chat,
)
from mlxserve.server.strict_schema import refuse_unstrict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Item(BaseModel):
    """Input items are often output items echoed back, with ids and statuses: lenient."""

    model_config = ConfigDict(extra="allow", strict=True)


class TextPart(_Item):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str


class ReasoningItem(_Item):
    """A reasoning item sent back: its text (``content``) feeds the next turn's prompt."""

    type: Literal["reasoning"]
    content: list[dict[str, Any]] | None = None

    def text(self) -> str:
        return "".join(str(part.get("text", "")) for part in self.content or [])


InputItem = FunctionCallItem | FunctionCallOutputItem | ReasoningItem | MessageItem


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(
        None, description="true: OpenAI's strict schema rules; kept exactly where forced"
    )


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = Field(None, description="only the default")


class ReasoningConfig(_Strict):
    """OpenAI's ``reasoning``: ``effort`` is chat's ``reasoning_effort`` ("none": thinking
    off; the levels: DeepSeek-V4's encoder); ``budget_tokens``, a vendor extension (the
    Responses API has no budget field), is chat's ``thinking.budget_tokens``."""

    effort: ReasoningEffort | None = None
    budget_tokens: int | None = Field(
        None, ge=1, description="vendor extension: the reasoning's most tokens"
    )
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, description="accepted; no summary is written: the reasoning comes whole"
    )
    generate_summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, description="accepted (summary's old name); no summary is written"
    )


class ResponsesRequest(_Strict):
    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    store: bool | None = Field(None, description="accepted; nothing is stored")
    metadata: dict[str, str] | None = Field(None, description="echoed back; changes nothing")
    user: str | None = Field(None, description="accepted; changes nothing")
    safety_identifier: str | None = Field(None, description="accepted; changes nothing")
    service_tier: str | None = Field(None, description="accepted; changes nothing")
    truncation: Literal["disabled"] | None = Field(None, description="only 'disabled'")
    seed: int | None = Field(None, ge=-SEED_RANGE, lt=SEED_RANGE, description="vendor extension")
    ignore_eos: bool | None = Field(
        None, description="vendor extension (as in vLLM; GuideLLM sends it): generate past EOS"
    )
    stop: str | list[str] | None = Field(
        None, description="vendor extension (as in vLLM): chat's stop strings"
    )
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = Field(
        None, description="empty only (openai-agents sends []): no extra output is written"
    )

    @field_validator("include")
    @classmethod
    def _include_nothing(cls, value: list[str] | None) -> list[str] | None:
        """An item asks for output mlxserve does not write (encrypted reasoning, logprobs,
        search results): refused, so the client is never missing what it asked for."""
        if value:
            raise ValueError(f"only [] is supported: mlxserve writes no {value[0]!r}")
        return value


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The internal chat request for a Responses one."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    items = (
        [MessageItem(role="user", content=body.input)]
        if isinstance(body.input, str)
        else body.input
    )
    reasoning: list[str] = []
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning.append(item.text())
        elif isinstance(item, MessageItem):
            turn: dict[str, Any] = {"role": item.role, "content": item.text()}
            if item.role == "assistant" and reasoning:
                turn["reasoning_content"] = "".join(reasoning)
            reasoning = []
            messages.append(turn)
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if reasoning:
                    messages[-1]["reasoning_content"] = "".join(reasoning)
                    reasoning = []
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    if not messages:
        raise InvalidRequest("input: there is nothing to answer", param="input")
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    choice = body.tool_choice
    if body.tools:
        chat["tools"] = [_function(i, tool, choice) for i, tool in enumerate(body.tools)]
    if isinstance(choice, NamedFunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        chat["tool_choice"] = choice
    if body.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type != "text":
        chat["response_format"] = {"type": fmt.type}
        if fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise InvalidRequest("text.format: json_schema needs a schema", param="text.format")
            if fmt.strict:
                refuse_unstrict(fmt.schema_, "text.format.schema")
            chat["response_format"]["json_schema"] = {
                "name": fmt.name or "output",
                "schema": fmt.schema_,
                "strict": fmt.strict,
            }
    if body.reasoning is not None:
        if body.reasoning.effort is not None:
            chat["reasoning_effort"] = body.reasoning.effort
        if body.reasoning.budget_tokens is not None:
            chat["thinking"] = {"type": "enabled", "budget_tokens": body.reasoning.budget_tokens}
    for key, value in (
        ("max_tokens", body.max_output_tokens),
        ("temperature", body.temperature),
        ("top_p", body.top_p),
        ("seed", body.seed),
        ("ignore_eos", body.ignore_eos),
        ("stop", body.stop),
    ):
        if value is not None:
            chat[key] = value
    return translated_chat(chat)


def _function(index: int, tool: FunctionTool, choice: Any) -> dict[str, Any]:
    """A function as the chat request's tool. ``strict: true`` holds its schema to
    OpenAI's strict subset (a 400 naming the part, as OpenAI answers) and keeps its
    arguments to the schema exactly where ``tool_choice`` forces its call. Responses
    clients send ``strict`` with every function (the ``openai`` SDK's type requires the
    field, and true is the common value), so with ``auto`` it is accepted, where chat
    refuses it; nothing keeps those calls."""
    chat = function_tool(tool.name, tool.description, tool.parameters)
    if tool.strict:
        if tool.parameters:
            refuse_unstrict(tool.parameters, f"tools.{index}.parameters")
        named = isinstance(choice, NamedFunctionChoice) and choice.name == tool.name
        if choice == "required" or named:
            chat["function"]["strict"] = True
    return chat
