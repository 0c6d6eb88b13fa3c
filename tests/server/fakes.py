"""In-process stand-ins for backends, so the front's logic is tested without MLX.

`FakeBackend` "generates" a deterministic function of the whole context (prompt
plus tokens so far), like greedy decoding: resuming on another fake with the
tokens already sent continues exactly as an uninterrupted run would.
"""

import asyncio
from collections.abc import AsyncGenerator

from mlxserve.channel.request import GenerationParams
from mlxserve.server.backends.base import (
    Backend,
    BackendEvent,
    BackendInfo,
    BackendRejected,
    BackendRequestFailed,
    BackendUnavailable,
    Finished,
    Tokens,
)

FIRST_TOKEN = 100
SPREAD = 50


def next_token(context: list[int]) -> int:
    return FIRST_TOKEN + (sum(context) * 31 + len(context)) % SPREAD


def greedy(prompt: list[int], count: int) -> list[int]:
    context = list(prompt)
    for _ in range(count):
        context.append(next_token(context))
    return context[len(prompt) :]


class FakeBackend(Backend):
    kind = "fake"

    def __init__(
        self,
        name: str,
        *,
        context_length: int = 256,
        delay_s: float = 0.0,
        fail_after: int | None = None,
        reject: bool = False,
        crash: bool = False,
        step_fails: bool = False,
        plan: dict[str, object] | None = None,
    ) -> None:
        super().__init__(name)
        self.context_length = context_length
        self.delay_s = delay_s
        self.fail_after = fail_after
        self.reject = reject
        self.crash = crash
        self.step_fails = step_fails
        self.plan = plan
        self.calls: list[GenerationParams] = []
        self.cancelled: list[str] = []
        # Tokens to generate first, in place of the made-up ones (a test's own text).
        self.script: list[int] = []
        self._connected = False

    @property
    def connected(self) -> bool:
        return self._connected

    async def start(self) -> BackendInfo:
        self._connected = True
        self.info = BackendInfo("fake", self.context_length, (5,), 0, self.plan, 1234)
        return self.info

    def up(self) -> "FakeBackend":
        """Started and healthy, without an event loop (for app tests)."""
        self._connected = True
        self.info = BackendInfo("fake", self.context_length, (5,), 0, self.plan, 1234)
        self.proof_of_life()
        self.set_healthy(True)
        return self

    async def stop(self) -> None:
        self._connected = False
        self.set_healthy(False)

    def fail(self) -> None:
        self._connected = False
        self.set_healthy(False)

    async def generate(
        self, request_id: str, params: GenerationParams
    ) -> AsyncGenerator[BackendEvent, None]:
        self.calls.append(params)
        if self.reject:
            raise BackendRejected("fake refuses")
        if self.crash:
            raise RuntimeError("fake bug")
        context = list(params.prompt_ids)
        done = False
        try:
            for count in range(params.max_tokens):
                if self.fail_after is not None and count == self.fail_after:
                    self.fail_after = None
                    if self.step_fails:  # this request's step raised; the backend is fine
                        raise BackendRequestFailed(f"fake '{self.name}': step failed")
                    self.fail()
                    raise BackendUnavailable(f"fake '{self.name}' died")
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                token = self.script[count] if count < len(self.script) else next_token(context)
                context.append(token)
                self.proof_of_life()
                yield Tokens((token,))
            done = True
            yield Finished("length", len(params.prompt_ids), params.max_tokens)
        finally:
            if not done:
                self.cancelled.append(request_id)
