"""The local engine backend against a real engine process: hello, stream, cancel, death."""

import asyncio
import os
import signal
import stat

import pytest

from mlxserve.channel.request import GenerationParams
from mlxserve.config import Settings
from mlxserve.server.backends.base import BackendUnavailable, Finished, Tokens
from mlxserve.server.backends.local import LocalEngine
from mlxserve.server.runtime import engine_env, inherited_env
from tests.server.live import MODEL

pytestmark = pytest.mark.slow


def make_engine() -> LocalEngine:
    settings = Settings(model=MODEL)
    env = {**inherited_env(), **engine_env(settings, MODEL, None)}
    return LocalEngine("primary", env=env, startup_timeout_s=300, request_timeout_s=60)


def test_engine_lifecycle() -> None:
    async def scenario() -> None:
        engine = make_engine()
        info = await engine.start()
        try:
            assert info.context_length > 0 and info.eos_token_ids and info.plan
            assert engine._dir is not None
            assert stat.S_IMODE(engine._dir.stat().st_mode) == 0o700
            socket_mode = (engine._dir / "engine.sock").stat().st_mode
            assert stat.S_ISSOCK(socket_mode) and stat.S_IMODE(socket_mode) == 0o600
            # Its own process group (signalled whole), in the front's session (one
            # autogroup CPU share with the front; see `_signal_group`).
            assert engine.pid is not None
            assert os.getpgid(engine.pid) == engine.pid
            assert os.getsid(engine.pid) == os.getsid(0)

            params = GenerationParams(prompt_ids=(3, 45, 453), max_tokens=4, stop_token_ids=())
            events = [e async for e in engine.generate("a", params)]
            assert sum(len(e.token_ids) for e in events if isinstance(e, Tokens)) == 4
            assert isinstance(events[-1], Finished) and events[-1].reason == "length"

            # Closing a stream cancels it in the engine, within a step or so.
            long = GenerationParams(prompt_ids=(3, 45, 453), max_tokens=3000, stop_token_ids=())
            stream = engine.generate("b", long)
            await anext(stream)
            await anext(stream)
            await stream.aclose()
            for _ in range(50):
                status = await engine.status()
                if status.running == 0 and status.queued == 0:
                    break
                await asyncio.sleep(0.01)
            assert (status.running, status.queued) == (0, 0)

            # A dead engine fails its in-flight requests as "unavailable" (retry elsewhere).
            stream = engine.generate("c", long)
            await anext(stream)
            assert engine.pid is not None
            os.kill(engine.pid, signal.SIGKILL)
            with pytest.raises(BackendUnavailable):
                async for _ in stream:
                    pass
            assert await engine.wait_exit() == -signal.SIGKILL
            assert not engine.connected and not engine.healthy
        finally:
            await engine.stop()
        assert engine._dir is None

    asyncio.run(scenario())
