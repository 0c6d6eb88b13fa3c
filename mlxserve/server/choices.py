"""``n`` choices of one request: several generations, their deltas merged by index.

Choice 0 starts alone; the others start once its first delta came, when its
prompt is prefilled and stored in the engine's prefix cache, so they reuse that
prefill instead of repeating it. Each choice has its own seed (``seed + index``).
An error of choice 0's first delta (a bad request, no backend) is raised before
any other starts, so the client gets its real status.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from mlxserve.server.generation import Delta, Generations, Prepared

_DONE = object()


async def fan_out(
    generations: Generations, prepared: Prepared, n: int
) -> AsyncGenerator[tuple[int, Delta], None]:
    first_stream = generations.run(prepared)
    streams = [first_stream]
    try:
        first = await anext(first_stream)
    except BaseException:
        await first_stream.aclose()
        raise
    if n == 1:
        try:
            yield 0, first
            async for delta in first_stream:
                yield 0, delta
        finally:
            await first_stream.aclose()
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
    streams += [generations.run(generations.again(prepared, i)) for i in range(1, n)]

    async def pump(index: int, stream: AsyncGenerator[Delta, None]) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))
        finally:
            await queue.put((index, _DONE))

    tasks = [asyncio.create_task(pump(0, first_stream))]
    tasks += [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams[1:], start=1)]
    try:
        yield 0, first
        running = n
        while running:
            index, item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                assert isinstance(item, Delta)
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for stream in streams:
            await stream.aclose()
