"""What the router needs from a backend, whatever runs behind it.

A backend streams token ids for one request at a time per call, many calls at
once. When it cannot finish a request it raises a `BackendError` that says whose
failure it is, once, where it is known:

- `BackendUnavailable`: the backend's own (process gone, connection lost, silent
  for too long): the router resumes the request elsewhere;
- `BackendRequestFailed`: this request's (a grammar the engine could not apply, a
  step that raised for it), on a backend that goes on serving the others: not
  retried, since the same inputs fail the same way anywhere, and a client told
  "unavailable" would only send it again;
- `BackendRejected`: the backend refused the request before starting it (a
  remote's 4xx, a field it cannot honour): not retried either.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from mlxserve.channel.request import GenerationParams, TokenLogprob


class BackendError(Exception):
    """A backend could not finish a request; the subclass says whose failure it is."""


class BackendUnavailable(BackendError):
    """The backend cannot serve this request now; another backend may."""


class BackendRequestFailed(BackendError):
    """The backend failed this one request but is otherwise fine (e.g. a step raised):
    a request-level failure, never retried elsewhere and never an outage."""


class BackendRefused(BackendUnavailable):
    """The backend refuses to start with its settings (an engine's exit 2): retrying can't help."""


class BackendRejected(BackendError):
    """The backend refused the request itself (a 4xx from a remote): retrying won't help."""


@dataclass(frozen=True)
class Tokens:
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class Finished:
    reason: Literal["stop", "length", "cancelled"]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    speculative: dict[str, Any] | None = None
    memory: dict[str, int] | None = None


BackendEvent = Tokens | Finished


@dataclass(frozen=True)
class BackendInfo:
    """What a backend told us about itself (an engine's Hello)."""

    model: str
    context_length: int
    eos_token_ids: tuple[int, ...]
    speculative_depth: int = 0
    plan: dict[str, Any] | None = None
    pid: int | None = None
    speculative_auto: bool = False  # the depth is chosen per round, up to `speculative_depth`

    @property
    def plan_hash(self) -> str:
        return str((self.plan or {}).get("plan_hash", "none"))


HealthListener = Callable[["Backend", bool], None]


@dataclass
class BackendState:
    """Health as the supervisor and the router see it."""

    healthy: bool = False
    last_ok: float = 0.0  # monotonic time of the last proof of life (probe or token)
    in_flight: int = 0
    listeners: list[HealthListener] = field(default_factory=list)


class Backend(ABC):
    kind: str = "backend"

    def __init__(self, name: str) -> None:
        self.name = name
        self.info: BackendInfo | None = None
        self.state = BackendState()

    # -- health -------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self.state.healthy

    def set_healthy(self, healthy: bool) -> None:
        if healthy == self.state.healthy:
            return
        self.state.healthy = healthy
        for listener in list(self.state.listeners):
            listener(self, healthy)

    def proof_of_life(self) -> None:
        self.state.last_ok = time.monotonic()

    @property
    def watches_progress(self) -> bool:
        """Whether the backend reports its step counter, so a busy one needs no probe."""
        return False

    # -- lifecycle ------------------------------------------------------------------

    @abstractmethod
    async def start(self) -> BackendInfo:
        """Start or connect; return what the backend says about itself."""

    @abstractmethod
    async def stop(self) -> None:
        """Stop (a local engine) or disconnect; in-flight requests fail."""

    @property
    @abstractmethod
    def connected(self) -> bool:
        """Whether requests can be sent at all (a process up, a client open)."""

    @abstractmethod
    def generate(
        self, request_id: str, params: GenerationParams
    ) -> AsyncGenerator[BackendEvent, None]:
        """Tokens, then one `Finished`; closing the iterator early cancels the request."""

    async def cancel_all(self) -> None:
        """Ask the backend to stop every in-flight request (used when draining)."""
        return None
