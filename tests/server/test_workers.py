"""The preparation pool: work runs off the event loop, bounded, and is refused past the bound."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from starlette.testclient import TestClient

from mlxserve.server.app import create_app
from mlxserve.server.errors import QueueFull
from mlxserve.server.tokenizer import FrontTokenizer
from mlxserve.server.workers import Workers
from tests.server.conftest import make_runtime
from tests.server.fakes import FakeBackend


def test_work_runs_in_a_thread_and_raises_there() -> None:
    async def main() -> None:
        workers = Workers(2, 2, 1000, 1)
        assert await workers.run(0, threading.get_ident) != threading.get_ident()
        with pytest.raises(ZeroDivisionError):
            await workers.run(0, divmod, 1, 0)
        assert workers.pending == 0
        workers.shutdown()

    asyncio.run(main())


def test_the_loop_runs_while_a_job_blocks() -> None:
    async def main() -> float:
        workers = Workers(1, 0, 1000, 1)
        job = asyncio.ensure_future(workers.run(0, time.sleep, 0.5))
        began, ticks = time.monotonic(), 0
        while not job.done() and time.monotonic() - began < 5:
            await asyncio.sleep(0.01)
            ticks += 1
        await job
        workers.shutdown()
        return ticks

    assert asyncio.run(main()) >= 10  # the loop kept turning during the 0.5 s job


def test_past_the_bound_the_answer_is_429() -> None:
    async def main() -> None:
        workers = Workers(1, 1, 1000, 3)
        gate = threading.Event()
        running = asyncio.ensure_future(workers.run(10, gate.wait, 5))
        waiting = asyncio.ensure_future(workers.run(10, gate.wait, 5))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as refused:
            await workers.run(10, gate.wait, 5)
        assert refused.value.status == 429
        assert refused.value.headers["Retry-After"] == "3"
        gate.set()
        assert await running and await waiting
        assert workers.pending == 0
        assert await workers.run(10, len, "ok") == 2  # room again
        workers.shutdown()

    asyncio.run(main())


def test_past_the_bytes_the_answer_is_429_but_a_lone_job_always_runs() -> None:
    async def main() -> None:
        workers = Workers(2, 8, 100, 1)
        assert await workers.run(500, len, "big") == 3  # alone: taken, however large
        gate = threading.Event()
        first = asyncio.ensure_future(workers.run(60, gate.wait, 5))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull, match="60 bytes"):
            await workers.run(50, gate.wait, 5)  # 110 bytes together: over 100
        second = asyncio.ensure_future(workers.run(40, gate.wait, 5))  # 100: fits
        await asyncio.sleep(0)
        assert workers.pending_bytes == 100
        gate.set()
        assert await first and await second
        assert (workers.pending, workers.pending_bytes) == (0, 0)
        workers.shutdown()

    asyncio.run(main())


def test_a_cancelled_caller_frees_its_place() -> None:
    async def main() -> None:
        workers = Workers(1, 1, 1000, 1)
        gate = threading.Event()
        running = asyncio.ensure_future(workers.run(10, gate.wait, 5))
        waiting = asyncio.ensure_future(workers.run(10, gate.wait, 5))
        await asyncio.sleep(0.05)
        waiting.cancel()  # not started: it never runs
        await asyncio.sleep(0.05)
        assert (workers.pending, workers.pending_bytes) == (1, 10)
        gate.set()
        await running
        await asyncio.sleep(0.05)
        assert workers.pending == 0
        workers.shutdown()

    asyncio.run(main())


def test_shutdown_refuses_new_work() -> None:
    async def main() -> None:
        workers = Workers(1, 1, 1000, 1)
        await workers.run(10, len, "x")
        workers.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            await workers.run(10, len, "x")

    asyncio.run(main())


def test_a_request_past_the_bound_gets_the_apis_429(
    tokenizer: FrontTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests tokenizing and max_running + max_queue (2) waiting: the next is a 429."""
    fake = FakeBackend("primary").up()
    runtime = make_runtime(tokenizer, [fake], max_queue=0)
    gate, entered = threading.Event(), threading.Semaphore(0)
    encode = tokenizer.text_ids

    def held(text: str) -> list[int]:
        entered.release()
        gate.wait(10)
        return encode(text)

    monkeypatch.setattr(tokenizer, "text_ids", held)
    body = {"model": "demo", "prompt": "Hello", "max_tokens": 1}
    with (
        TestClient(create_app(runtime), raise_server_exceptions=False) as client,
        ThreadPoolExecutor(4) as senders,
    ):
        held_requests = [senders.submit(client.post, "/v1/completions", json=body) for _ in "1234"]
        assert entered.acquire(timeout=10) and entered.acquire(timeout=10)  # two running
        deadline = time.monotonic() + 10
        while runtime.workers.pending < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "queue_full"
        assert refused.headers["Retry-After"] == "1"
        gate.set()
        statuses = sorted(r.result(10).status_code for r in held_requests)
        assert statuses[:2] == [200, 200]  # then admission's own bound (2 running, none queued)
        assert set(statuses) <= {200, 429}
    assert runtime.workers.pending == 0
