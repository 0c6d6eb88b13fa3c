"""The dashboard's history: percentiles from buckets, rates from counters, a bounded ring."""

import pytest

from mlxserve.server.admission import Admission
from mlxserve.server.history import History, quantile
from mlxserve.server.metrics import Metrics
from mlxserve.server.router import RetryPolicy, Router
from tests.server.fakes import FakeBackend


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _history(keep: int = 5) -> tuple[History, Metrics, Clock]:
    metrics, clock = Metrics(), Clock()
    router = Router([FakeBackend("primary").up()], RetryPolicy(), metrics)
    admission = Admission(2, 4, 1, metrics)
    return (
        History(metrics, router, admission, interval_s=1.0, keep=keep, clock=clock),
        metrics,
        clock,
    )


def test_quantile_is_linear_within_its_bucket() -> None:
    cumulative = {0.1: 0.0, 0.2: 10.0, float("inf"): 10.0}
    assert quantile(0.5, cumulative) == pytest.approx(0.15)
    assert quantile(0.99, {0.1: 0.0, 0.2: 0.0, float("inf"): 3.0}) == 0.2  # open bucket
    assert quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None


def test_rates_percentiles_and_acceptance_per_position() -> None:
    history, metrics, clock = _history()
    first = history.sample()
    assert first["tokens_per_s"] == 0 and first["ttft_ms"] is None
    metrics.completion_tokens.inc(40)
    metrics.requests.labels("/v1/chat/completions", "200").inc(3)
    metrics.requests.labels("/v1/chat/completions", "503").inc(1)
    metrics.requests.labels("/v1/models", "200").inc(50)  # not a generation
    for value in (0.03, 0.03, 0.03, 0.3):
        metrics.ttft.observe(value)
    # one request: 4 rounds at depth 2, 2 plain steps; position 1 kept 3 of 4, position 2 1
    metrics.record_speculative(8, 4, {"2": 4, "0": 2}, [0.75, 0.25])
    clock.now += 2.0
    sample = history.sample()
    assert sample["tokens_per_s"] == 20.0
    assert sample["requests_per_s"] == 2.0 and sample["errors_per_s"] == 0.5
    assert 25 < sample["ttft_ms"]["p50"] <= 35 and sample["ttft_ms"]["p99"] > 250
    assert sample["acceptance_per_position"] == [0.75, 0.25]
    assert sample["depth_steps"] == {"0": 2, "2": 4}
    assert sample["depth_mean"] == round(8 / 6, 3)
    assert sample["backends"]["primary"]["healthy"] is True
    assert sample["backends"]["primary"]["active"] is True


def test_the_ring_is_bounded_and_since_filters() -> None:
    history, _, clock = _history(keep=3)
    for _ in range(7):
        clock.now += 1.0
        history.sample()
    assert len(history.samples) == 3
    assert [s["t"] for s in history.since(1005.0)] == [1006.0, 1007.0]
