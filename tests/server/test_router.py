"""Routing and resumption: first healthy backend, exact resume, bounded retries."""

import asyncio

import pytest

from mlxserve.channel.request import GenerationParams
from mlxserve.server.backends.base import (
    BackendRejected,
    BackendRequestFailed,
    BackendUnavailable,
    Tokens,
)
from mlxserve.server.metrics import Metrics
from mlxserve.server.router import Job, NoHealthyBackend, RetryPolicy, Router
from tests.server.fakes import FakeBackend, greedy

PROMPT = (1, 2, 3)
FAST = RetryPolicy(attempts=3, backoff_s=0.001, backoff_max_s=0.01, restart_wait_s=0.05)


async def run(router: Router, max_tokens: int = 12) -> list[int]:
    job = Job("r1", GenerationParams(prompt_ids=PROMPT, max_tokens=max_tokens))
    out: list[int] = []
    async for event in router.generate(job):
        if isinstance(event, Tokens):
            out.extend(event.token_ids)
    return out


def counter(metrics: Metrics, name: str) -> float:
    return sum(
        sample.value
        for metric in metrics.registry.collect()
        for sample in metric.samples
        if sample.name == name
    )


def test_first_healthy_backend_in_order() -> None:
    a, b = FakeBackend("a").up(), FakeBackend("b").up()
    router = Router([a, b], FAST, Metrics())
    assert router.active is a
    a.fail()
    assert router.active is b
    a.up()
    assert router.active is a


def test_resume_continues_exactly_with_the_remaining_budget() -> None:
    metrics = Metrics()
    a = FakeBackend("a", fail_after=5).up()
    b = FakeBackend("b").up()
    router = Router([a, b], FAST, metrics)
    out = asyncio.run(run(router))
    assert out == greedy(list(PROMPT), 12)  # nothing duplicated, nothing missing
    resumed = b.calls[0]
    assert resumed.prompt_ids == PROMPT + tuple(out[:5])
    assert resumed.max_tokens == 7
    assert counter(metrics, "mlxserve_failovers_total") == 1
    assert counter(metrics, "mlxserve_request_retries_total") == 1


def test_attempts_are_bounded_then_unavailable() -> None:
    a = FakeBackend("a").up()
    a.fail()
    router = Router([a], FAST, Metrics())
    with pytest.raises(NoHealthyBackend):
        asyncio.run(run(router))


def test_a_rejection_is_not_retried() -> None:
    a = FakeBackend("a", reject=True).up()
    b = FakeBackend("b").up()
    router = Router([a, b], FAST, Metrics())
    with pytest.raises(BackendRejected):
        asyncio.run(run(router))
    assert len(a.calls) == 1 and b.calls == []


def test_failure_after_the_last_token_finishes_with_length() -> None:
    a = FakeBackend("a", fail_after=4).up()
    b = FakeBackend("b").up()
    router = Router([a, b], FAST, Metrics())
    assert asyncio.run(run(router, max_tokens=4)) == greedy(list(PROMPT), 4)
    assert b.calls == []


def test_closing_the_stream_cancels_on_the_backend() -> None:
    a = FakeBackend("a", delay_s=0.01).up()
    router = Router([a], FAST, Metrics())

    async def take_two() -> None:
        job = Job("r1", GenerationParams(prompt_ids=PROMPT, max_tokens=50))
        stream = router.generate(job)
        await anext(stream)
        await anext(stream)
        await stream.aclose()

    asyncio.run(take_two())
    assert a.cancelled == ["r1.1"]


def test_unavailable_is_retryable() -> None:
    assert issubclass(NoHealthyBackend, BackendUnavailable)


def test_a_failed_step_fails_its_request_and_is_not_retried() -> None:
    """A request-level failure (a step that raised for it) is the request's, not an
    outage: no other backend is tried, no retry is counted, the backend stays active."""
    metrics = Metrics()
    a = FakeBackend("a", fail_after=3, step_fails=True).up()
    b = FakeBackend("b").up()
    router = Router([a, b], FAST, metrics)
    with pytest.raises(BackendRequestFailed, match="step failed"):
        asyncio.run(run(router))
    assert len(a.calls) == 1 and b.calls == []
    assert router.active is a and a.healthy
    assert counter(metrics, "mlxserve_request_retries_total") == 0
    assert counter(metrics, "mlxserve_failovers_total") == 0


def test_a_request_failure_is_not_unavailability() -> None:
    """Retries are for `BackendUnavailable` only; the request's own failure is not one."""
    assert not issubclass(BackendRequestFailed, BackendUnavailable)
    assert not issubclass(BackendRejected, BackendUnavailable)


def test_counters_start_at_zero_and_a_primary_that_comes_up_late_is_no_failback() -> None:
    """The fallback serves while the primary loads; the primary then coming up moves
    traffic to it, but nothing failed and nothing came back: both counters stay 0."""
    metrics = Metrics()
    primary, fallback = FakeBackend("primary"), FakeBackend("fallback").up()
    router = Router([primary, fallback], FAST, metrics)
    text = metrics.render().decode()
    assert 'mlxserve_failbacks_total{to_backend="primary"} 0.0' in text
    assert 'mlxserve_failovers_total{from_backend="primary",to_backend="fallback"} 0.0' in text
    assert router.active is fallback
    primary.up()
    assert router.active is primary
    assert counter(metrics, "mlxserve_failbacks_total") == 0
    assert counter(metrics, "mlxserve_failovers_total") == 0
    assert [s.kind for s in router.switches] == ["first", "up"]
    primary.fail()
    primary.up()
    assert counter(metrics, "mlxserve_failovers_total") == 1
    assert counter(metrics, "mlxserve_failbacks_total") == 1
    kinds = [(s.kind, s.from_backend, s.to_backend) for s in router.switches]
    assert kinds[2:] == [("failover", "primary", "fallback"), ("failback", "fallback", "primary")]
