"""The OpenAI request and response shapes, as pydantic models.

Requests refuse every field they do not know (a 400 that names it), so a client
never gets an answer to a different question than it asked; fields that change
nothing in the answer (``user``, ``metadata``, ``store``...) are listed and accepted.
Nested objects (messages, content parts, tools, calls) do the same, but clients
echo them back whole, with fields their SDK has and mlxserve never fills
(``refusal``, ``annotations``, ``audio`` as null or empty): an unknown key there is
accepted empty and refused with a value (`Echoing`).
"""

from typing import Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from mlxserve.chat.request import ReasoningEffort
from mlxserve.server.errors import from_validation_error

MAX_STOP_STRINGS = 16
SEED_RANGE = 1 << 63


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class _Strict(BaseModel):
    """A request body: an unknown field is refused by name."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Echoing(BaseModel):
    """A nested object clients send back as they got it: a key mlxserve does not know
    is accepted empty (null, "", [], {}: an SDK field nobody filled) and refused, by
    name, with a value (error type ``unsupported_field``, its ``field`` in the context)."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _unknown_keys_empty(self) -> Self:
        for key, value in (self.model_extra or {}).items():
            if value not in (None, "", [], {}):
                raise PydanticCustomError(
                    "unsupported_field", "this field is not supported by mlxserve", {"field": key}
                )
        return self


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = Field(
        False,
        description="vendor extension (as in vLLM): with include_usage, usage on every chunk",
    )
    include_obfuscation: Literal[False] | None = Field(
        None, description="false only: mlxserve does not pad its events"
    )


class ContentPart(Echoing):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = Field(
        None, description="accepted; changes nothing (the prefix cache is automatic)"
    )


class FunctionCall(Echoing):
    name: str = Field(min_length=1)
    arguments: str


class ToolCall(Echoing):
    """An assistant message's call, as the client sends it back in the history."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = Field(None, description="accepted (a streamed call's position)")


class ChatMessage(Echoing):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    reasoning_content: str | None = Field(
        None, description="assistant: its reasoning (thinking mode), fed back by the prompt rules"
    )
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("reasoning_content", "tool_calls")
    @classmethod
    def _assistant_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value and info.data.get("role") not in (None, "assistant"):
            raise ValueError(f"only assistant messages carry {info.field_name}")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_only(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("role") not in (None, "tool"):
            raise ValueError("only tool messages carry a tool_call_id")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


MAX_CHOICES = 8


class GenerationBody(_Strict):
    """Fields shared by chat completions and completions."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-SEED_RANGE, lt=SEED_RANGE)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = Field(
        None, gt=0, le=10, description="vendor extension (as in vLLM)"
    )
    top_k: int | None = Field(None, ge=0, description="vendor extension; 0 or -1: off")
    min_p: float | None = Field(None, ge=0, le=1, description="vendor extension")
    ignore_eos: bool | None = Field(
        False, description="vendor extension (as in vLLM): keep generating past EOS"
    )
    user: str | None = Field(None, description="accepted; changes nothing")
    metadata: dict[str, Any] | None = Field(None, description="accepted; changes nothing")
    store: bool | None = Field(None, description="accepted; nothing is stored")
    service_tier: str | None = Field(None, description="accepted; changes nothing")

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k_off(cls, value: object) -> object:
        return 0 if value == -1 else value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids; {key!r} is not")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values are in [-100, 100]; {bias} is not")
        return value

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        return value

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's rule: ``continuous_usage_stats`` counts only with ``include_usage``."""
        options = self.stream_options
        return self.include_usage and bool(options and options.continuous_usage_stats)


class FunctionDefinition(Echoing):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(
        None, description="true: only where tool_choice forces a call (its grammar keeps it)"
    )


class Tool(Echoing):
    type: Literal["function"]
    function: FunctionDefinition


class Thinking(_Strict):
    """DeepSeek's API control, ``{"type": "enabled" | "disabled"}``, and Anthropic's
    ``budget_tokens``: the reasoning's most tokens, its end marker included (at the
    budget the engine forces the marker and the answer follows)."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(
        None, ge=1, description="the reasoning's most tokens (vendor extension, as Anthropic's)"
    )


class ChatTemplateKwargs(BaseModel):
    """The keys of ``chat_template_kwargs`` mlxserve acts on; any other is refused."""

    model_config = ConfigDict(extra="forbid", strict=True)
    thinking: bool | None = None
    enable_thinking: bool | None = None
    drop_thinking: bool | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: call this one."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    thinking: Thinking | None = None
    reasoning_effort: ReasoningEffort | None = Field(
        None, description="'none': thinking off; the levels: DeepSeek-V4's encoder only"
    )
    chat_template_kwargs: ChatTemplateKwargs | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


TokenPrompt = list[int]


class CompletionRequest(GenerationBody):
    prompt: str | list[str] | TokenPrompt | list[TokenPrompt]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool | None = Field(False, description="only false is supported")
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = Field(None, max_length=0, description="suffix is not supported")
    best_of: int | None = Field(None, ge=1, le=1, description="only 1 is supported")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("prompt")
    @classmethod
    def _one_prompt(
        cls, value: str | list[str] | TokenPrompt | list[TokenPrompt]
    ) -> str | list[str] | TokenPrompt | list[TokenPrompt]:
        batch = isinstance(value, list) and value and isinstance(value[0], str | list)
        if batch and len(value) != 1:
            raise ValueError("only one prompt per request is supported")
        if isinstance(value, list) and not value:
            raise ValueError("the prompt must not be empty")
        return value

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids (the batch forms hold exactly one)."""
        value = self.prompt
        if isinstance(value, str):
            return value
        first = value[0]
        if isinstance(first, str | list):
            return first
        return [int(token) for token in value if isinstance(token, int)]


class TokenizeKind(_Lenient):
    """/tokenize takes a chat body or a completion body: which one has this request?"""

    messages: Any = None
    prompt: Any = None


class DetokenizeRequest(_Strict):
    model: str = Field(min_length=1)
    tokens: list[int]


# -- responses -------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None
    completion_tokens_details: dict[str, int] | None = None


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(BaseModel):
    """A call in an answer; streamed, the first chunk has id and name, later ones arguments."""

    index: int | None = None
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: dict[str, Any] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculative: dict[str, Any] | None = Field(None, description="vendor extension")


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculative: dict[str, Any] | None = Field(None, description="vendor extension")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mlxserve"
    context_length: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def function_tool(name: str, description: str | None, parameters: Any) -> dict[str, Any]:
    """A ``tools`` entry of the chat request that another API's tool becomes."""
    function = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": function}


def translated_chat(chat: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request another API's request was translated to (Messages, Responses);
    what it cannot be is a 400 naming the field."""
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        raise from_validation_error(exc, chat) from None
