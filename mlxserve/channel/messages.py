"""Messages between the front and an engine process: newline-delimited JSON.

Why JSON lines over a unix socket: the front must outlive a wedged engine,
so they are separate processes; the records are small and plain, and JSON is
inert (no pickle). Every message is one JSON object with a "type".

engine -> front, once, first:   hello
front  -> engine:                generate, cancel, status
engine -> front:                 tokens, finish (per request), status, error,
                                 progress (while it has work: its step counter)
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from mlxserve.channel.request import GenerationParams, TokenLogprob


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Hello(_Message):
    type: Literal["hello"] = "hello"
    model: str
    pid: int
    context_length: int
    eos_token_ids: list[int]
    speculative_depth: int
    # `speculative_depth` is then the most drafts a round may make.
    speculative_auto: bool = False
    plan: dict[str, Any]


class Generate(_Message):
    """A generation for the engine: the request's record as the front built it."""

    type: Literal["generate"] = "generate"
    id: str
    params: GenerationParams
    # None: the engine's configured depth (0 when the model has no MTP module).
    speculative_depth: int | None = Field(default=None, ge=0, le=5)


class Cancel(_Message):
    type: Literal["cancel"] = "cancel"
    id: str


class StatusRequest(_Message):
    type: Literal["status"] = "status"


class Tokens(_Message):
    type: Literal["tokens"] = "tokens"
    id: str
    token_ids: list[int]
    logprobs: tuple[TokenLogprob, ...] | None = None


class Finish(_Message):
    type: Literal["finish"] = "finish"
    id: str
    finish_reason: Literal["stop", "length", "cancelled", "error"]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    speculative: dict[str, Any] | None = None
    error: str | None = None
    memory: dict[str, int] | None = None


class Status(_Message):
    type: Literal["status"] = "status"
    running: int
    queued: int
    progress: int


class Progress(_Message):
    """The engine's step counter, sent a few times a second while it has work.

    The front reads hangs from it: a counter that stops while requests wait is
    a wedged step, whatever the process's other threads still do.
    """

    type: Literal["progress"] = "progress"
    steps: int
    busy: bool
    #: p99 duration of recent steps like the one in flight (0: none measured yet)
    expected_step_s: float = 0.0
    #: the kind of the step in flight (prefill, decode, speculate), if one is
    step_kind: str | None = None


class Error(_Message):
    """A message the engine could not act on (bad JSON, unknown id); never fatal."""

    type: Literal["error"] = "error"
    id: str | None = None
    message: str


FrontMessage = Annotated[Generate | Cancel | StatusRequest, Field(discriminator="type")]
EngineMessage = Annotated[
    Hello | Tokens | Finish | Status | Progress | Error, Field(discriminator="type")
]

_FRONT: TypeAdapter[FrontMessage] = TypeAdapter(FrontMessage)
_ENGINE: TypeAdapter[EngineMessage] = TypeAdapter(EngineMessage)


def encode(message: _Message) -> bytes:
    return message.model_dump_json().encode() + b"\n"


def decode_front(line: bytes) -> FrontMessage:
    """Raises pydantic.ValidationError on anything malformed."""
    return _FRONT.validate_json(line)


def decode_engine(line: bytes) -> EngineMessage:
    return _ENGINE.validate_json(line)
