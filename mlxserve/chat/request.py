"""A chat request as the chat formats read it: the conversation, its tools, its controls.

Every API the server speaks (chat completions, Anthropic Messages, the Responses API)
ends as one of these (`mlxserve.server.chat_request`), so the formats import nothing
of the server. Fields keep the API's names, and a format refuses what it cannot
honour by that name (`Refused`), which the server answers as a 400.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

Role = Literal["system", "developer", "user", "assistant", "tool"]
#: ``reasoning_effort``'s values: OpenAI's (``none`` turns thinking off), DeepSeek's
#: ``max`` and ``ultra``. Each format says what it makes of them.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra"]


class Refused(ValueError):
    """A request the model's format cannot honour; ``param`` names the field
    (``messages.2.tool_call_id``)."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class Call(NamedTuple):
    """A tool call in the history: its id, the function's name, its JSON arguments."""

    id: str
    name: str
    #: As the client sent them: JSON text, not checked yet.
    arguments: str


@dataclass(frozen=True)
class Message:
    role: Role
    #: The text, its parts joined.
    content: str
    name: str | None = None
    reasoning_content: str | None = None
    tool_calls: tuple[Call, ...] = ()
    tool_call_id: str | None = None
    #: The text parts as given (None: the content was a string). DeepSeek-V4's format
    #: joins a tool result's parts with a blank line.
    parts: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Function:
    """A tool the model may call."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    #: true: its calls must follow the parameters' schema (kept only by a forced call's grammar).
    strict: bool | None = None

    def declared(self) -> dict[str, Any]:
        """The function as the prompt shows it: its name, description and parameters
        (not ``strict``, nor a key without a value), a copy the template may keep."""
        shown: dict[str, Any] = {"name": self.name, "description": self.description}
        shown["parameters"] = copy.deepcopy(self.parameters)
        return {key: value for key, value in shown.items() if value is not None}


@dataclass(frozen=True)
class NamedTool:
    """``tool_choice`` naming the function to call."""

    name: str


ToolChoice = Literal["none", "auto", "required"] | NamedTool


@dataclass(frozen=True)
class TemplateKwargs:
    """The keys of ``chat_template_kwargs`` the formats act on."""

    thinking: bool | None = None
    enable_thinking: bool | None = None
    drop_thinking: bool | None = None


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[Message, ...]
    tools: tuple[Function, ...] = ()
    #: "auto" where the request names none.
    tool_choice: ToolChoice = "auto"
    #: false only where the request says so.
    parallel_tool_calls: bool = True
    #: ``response_format.type`` (None: no response_format).
    response_format: str | None = None
    #: ``response_format.json_schema.schema`` (None: no JSON schema given).
    response_schema: dict[str, Any] | None = None
    #: ``thinking.type``: True for "enabled", False for "disabled" (None: not given).
    thinking: bool | None = None
    #: ``thinking.budget_tokens``: the reasoning's most tokens, its end marker included.
    thinking_budget: int | None = None
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: TemplateKwargs | None = None
