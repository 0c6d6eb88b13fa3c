"""The runtime's startup line: "ready" names the backends that are up."""

import asyncio
import io
import time

from mlxserve.config import Settings
from mlxserve.server.backends.base import BackendInfo
from mlxserve.server.progress import Console
from mlxserve.server.runtime import Runtime
from mlxserve.server.tokenizer import FrontTokenizer
from tests.server.fakes import FakeBackend


class SlowStart(FakeBackend):
    """A primary still loading its model while the fallback already serves."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.go = asyncio.Event()

    async def start(self) -> BackendInfo:
        await self.go.wait()
        return await super().start()


async def _until(check: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_ready_names_the_fallback_when_only_it_is_up(tokenizer: FrontTokenizer) -> None:
    out = io.StringIO()

    async def main() -> None:
        primary, fallback = SlowStart("primary"), FakeBackend("standby")
        settings = Settings(server={"ready_interval_s": 0.2})  # type: ignore[arg-type]
        runtime = Runtime(settings, tokenizer, [primary, fallback], Console(out))
        runtime.url = "http://127.0.0.1:1"
        await runtime.start()
        try:
            await _until(lambda: "ready:" in out.getvalue())
            ready = out.getvalue()
            assert "up: 'standby'; not up yet: 'primary'" in ready
            primary.go.set()
            await _until(lambda: "backend 'primary' is up" in out.getvalue())
            assert "new requests go to it" in out.getvalue()
            text = runtime.metrics.render().decode()
            assert 'mlxserve_failbacks_total{to_backend="primary"} 0.0' in text
        finally:
            await runtime.stop()

    asyncio.run(main())
