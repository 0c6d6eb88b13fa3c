"""Admission: a bounded number running, a bounded queue, 429 past it, 503 while draining."""

import asyncio

import pytest

from mlxserve.server.admission import Admission
from mlxserve.server.errors import QueueFull, ServiceUnavailable
from mlxserve.server.metrics import Metrics


def test_running_then_queued_then_refused() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=1, max_queue=1, retry_after_s=2, metrics=Metrics())
        release = asyncio.Event()
        order: list[str] = []

        async def hold(name: str) -> None:
            async with admission.slot():
                order.append(name)
                await release.wait()

        first = asyncio.create_task(hold("first"))
        await asyncio.sleep(0)
        second = asyncio.create_task(hold("second"))
        await asyncio.sleep(0)
        assert (admission.running, admission.waiting) == (1, 1)
        with pytest.raises(QueueFull) as refused:
            async with admission.slot():
                pass
        assert refused.value.headers["Retry-After"] == "2"
        release.set()
        await asyncio.gather(first, second)
        assert order == ["first", "second"]
        assert await admission.wait_idle(0.1)

    asyncio.run(scenario())


def test_draining_refuses_with_503() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=1, max_queue=1, retry_after_s=1, metrics=Metrics())
        admission.draining = True
        with pytest.raises(ServiceUnavailable):
            async with admission.slot():
                pass

    asyncio.run(scenario())
