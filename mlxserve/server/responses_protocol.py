"""The OpenAI Responses request shape, and its translation to the internal chat request.

mlxserve keeps no conversation state: ``previous_response_id``, ``conversation`` and
stored responses are refused; the client sends the whole input, as with chat.
Unknown fields are refused by name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxserve.server.errors import InvalidRequest
from mlxserve.server.protocol import (
    SEED_RANGE,
    ChatCompletionRequest,
    function_tool,
    translated_chat,
)


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
    strict: bool | None = Field(None, description="arguments always follow the schema when forced")


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
    if body.tools:
        chat["tools"] = [
            function_tool(tool.name, tool.description, tool.parameters) for tool in body.tools
        ]
    choice = body.tool_choice
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
            chat["response_format"]["json_schema"] = {
                "name": fmt.name or "output",
                "schema": fmt.schema_,
                "strict": fmt.strict,
            }
    for key, value in (
        ("max_tokens", body.max_output_tokens),
        ("temperature", body.temperature),
        ("top_p", body.top_p),
        ("seed", body.seed),
    ):
        if value is not None:
            chat[key] = value
    return translated_chat(chat)
