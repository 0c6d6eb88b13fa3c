"""The OpenAI request and response shapes, as pydantic models.

Requests accept unknown fields (clients send many we do not use) but validate
every field we act on; a few OpenAI features we do not implement are refused
with a 400 rather than silently ignored, so a client never gets an answer to a
different question than it asked.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 16
SEED_RANGE = 1 << 63


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Lenient):
    include_usage: bool | None = False


class ContentPart(_Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(_Lenient):
    name: str = Field(min_length=1)
    arguments: str


class ToolCall(_Lenient):
    """An assistant message's call, as the client sends it back in the history."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    reasoning_content: str | None = Field(
        None, description="assistant: its reasoning (thinking mode), fed back by the prompt rules"
    )
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _GenerationRequest(_Lenient):
    """Fields shared by chat completions and completions."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-SEED_RANGE, lt=SEED_RANGE)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=1, description="only 1 is supported")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(None, ge=0, le=0, description="only 0 is supported")
    presence_penalty: float | None = Field(None, ge=0, le=0, description="only 0 is supported")
    ignore_eos: bool | None = Field(
        False, description="vendor extension (as in vLLM): keep generating past EOS"
    )

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


class FunctionDefinition(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class Thinking(_Lenient):
    """DeepSeek's API control: ``{"type": "enabled" | "disabled"}``."""

    type: Literal["enabled", "disabled"]


class ChatTemplateKwargs(BaseModel):
    """The keys of ``chat_template_kwargs`` mlxserve acts on; any other is refused."""

    model_config = ConfigDict(extra="forbid")
    thinking: bool | None = None
    enable_thinking: bool | None = None
    drop_thinking: bool | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(None, description="only false is supported")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto"] | None = Field(
        None, description="only 'auto' and 'none' are supported"
    )
    thinking: Thinking | None = None
    reasoning_effort: Literal["high", "max"] | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("logprobs are not supported")
        return value

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


TokenPrompt = list[int]


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | TokenPrompt | list[TokenPrompt]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool | None = Field(False, description="only false is supported")
    logprobs: int | None = Field(None, le=0, description="logprobs are not supported")
    suffix: str | None = Field(None, max_length=0, description="suffix is not supported")

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


class DetokenizeRequest(_Lenient):
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
    logprobs: None = None


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
    logprobs: None = None


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
    logprobs: None = None


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
