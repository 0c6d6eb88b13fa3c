"""A short, bounded history of what the front measures, for the dashboard's charts.

Why here and not in Prometheus: many operators run no Prometheus, and the hosts
are often offline; the dashboard at /status must draw the last minutes by itself.
Every `interval_s` one `Sample` is taken from what the front already tracks (its
metrics registry, the admission queue, the router, each local engine's step
counter and the memory its engine reported): nothing is asked of a backend. At most
`keep` samples are held, so the memory is bounded whatever the uptime.

Rates are differences of counters over the interval. Latency percentiles and the
MTP acceptance are taken over a trailing window (`WINDOW_S`) of those differences,
so one quiet interval does not blank the chart; percentiles are read from the
histogram buckets as Prometheus's ``histogram_quantile`` does (linear within a bucket).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mlxserve.server.admission import Admission
from mlxserve.server.backends.base import Backend
from mlxserve.server.metrics import Metrics
from mlxserve.server.router import Router

#: The trailing window of latency percentiles, acceptance and depth.
WINDOW_S = 30.0
QUANTILES = (0.5, 0.9, 0.99)
#: Requests that generate (what "requests/s" counts); the rest are reads of the server.
GENERATION_ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
)

TTFT = "mlxserve_time_to_first_token_seconds"
ITL = "mlxserve_inter_token_latency_seconds"
COMPLETION = "mlxserve_completion_tokens_total"
PROMPT = "mlxserve_prompt_tokens_total"
REQUESTS = "mlxserve_requests_total"
DRAFTED = "mlxserve_speculative_position_drafted_total"
ACCEPTED = "mlxserve_speculative_position_accepted_total"
DEPTHS = "mlxserve_speculative_depth_steps_total"

K = TypeVar("K", str, float)
Counters = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def read_counters(metrics: Metrics) -> Counters:
    """Every sample of the registry, keyed by name and labels (one collection)."""
    values: Counters = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def _sum(values: Counters, name: str, **match: str) -> float:
    return sum(
        value
        for (key, labels), value in values.items()
        if key == name and all(dict(labels).get(k) == v for k, v in match.items())
    )


def _by_label(values: Counters, name: str, label: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for (key, labels), value in values.items():
        if key == name:
            tag = dict(labels).get(label)
            if tag is not None:
                found[tag] = found.get(tag, 0.0) + value
    return found


def buckets(values: Counters, histogram: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound (``inf`` last)."""
    return {
        float(le): count for le, count in _by_label(values, histogram + "_bucket", "le").items()
    }


def quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """The q-quantile from cumulative bucket counts, linear within the bucket it falls in;
    None without observations. One in the open last bucket reads as its lower bound."""
    bounds = sorted(cumulative)
    total = cumulative[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def _difference(now: dict[K, float], before: dict[K, float]) -> dict[K, float]:
    return {key: value - before.get(key, 0.0) for key, value in now.items()}


def _add(total: dict[Any, float], more: dict[Any, float]) -> None:
    for key, value in more.items():
        total[key] = total.get(key, 0.0) + value


@dataclass
class _Delta:
    """What changed in one interval, kept for the trailing window."""

    ttft: dict[float, float]
    itl: dict[float, float]
    drafted: dict[str, float]
    accepted: dict[str, float]
    depths: dict[str, float]


@dataclass
class _Previous:
    at: float
    counters: Counters
    steps: dict[str, int] = field(default_factory=dict)


class History:
    """The ring of samples, and the task that fills it."""

    def __init__(
        self,
        metrics: Metrics,
        router: Router,
        admission: Admission,
        *,
        interval_s: float,
        keep: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.metrics = metrics
        self.router = router
        self.admission = admission
        self.interval_s = interval_s
        self.samples: deque[dict[str, Any]] = deque(maxlen=keep)
        self._clock = clock
        self._window: deque[_Delta] = deque(maxlen=max(1, round(WINDOW_S / interval_s)))
        self._previous: _Previous | None = None

    @property
    def backends(self) -> Sequence[Backend]:
        return self.router.backends

    async def run(self) -> None:
        """Sample every `interval_s` until cancelled."""
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def sample(self) -> dict[str, Any]:
        """Take one sample now (the first only sets the baseline of the rates)."""
        now = self._clock()
        counters = read_counters(self.metrics)
        steps = {b.name: _steps(b) for b in self.backends}
        previous = self._previous or _Previous(now, counters, steps)
        self._previous = _Previous(now, counters, steps)
        dt = max(now - previous.at, 1e-9)
        before = previous.counters
        self._window.append(
            _Delta(
                ttft=_difference(buckets(counters, TTFT), buckets(before, TTFT)),
                itl=_difference(buckets(counters, ITL), buckets(before, ITL)),
                drafted=_difference(_positions(counters, DRAFTED), _positions(before, DRAFTED)),
                accepted=_difference(_positions(counters, ACCEPTED), _positions(before, ACCEPTED)),
                depths=_difference(
                    _by_label(counters, DEPTHS, "depth"), _by_label(before, DEPTHS, "depth")
                ),
            )
        )

        def rate(name: str, **match: str) -> float:
            return round(
                max(_sum(counters, name, **match) - _sum(before, name, **match), 0) / dt, 3
            )

        requests = sum(rate(REQUESTS, endpoint=e) for e in GENERATION_ENDPOINTS)
        ok = sum(rate(REQUESTS, endpoint=e, status="200") for e in GENERATION_ENDPOINTS)
        sample: dict[str, Any] = {
            "t": round(now, 3),
            "tokens_per_s": rate(COMPLETION),
            "prompt_tokens_per_s": rate(PROMPT),
            "requests_per_s": round(requests, 3),
            "errors_per_s": round(max(requests - ok, 0.0), 3),
            "running": self.admission.running,
            "waiting": self.admission.waiting,
            "ttft_ms": self._percentiles(d.ttft for d in self._window),
            "itl_ms": self._percentiles(d.itl for d in self._window),
            **self._speculation(),
            "backends": {
                b.name: self._backend(b, steps[b.name] - previous.steps.get(b.name, 0), dt)
                for b in self.backends
            },
        }
        self.samples.append(sample)
        return sample

    @staticmethod
    def _percentiles(deltas: Iterable[dict[float, float]]) -> dict[str, float] | None:
        total: dict[float, float] = {}
        for delta in deltas:
            _add(total, delta)
        values = {f"p{round(q * 100)}": quantile(q, total) for q in QUANTILES}
        if any(v is None for v in values.values()):
            return None
        return {key: round(1000 * v, 2) for key, v in values.items() if v is not None}

    def _speculation(self) -> dict[str, Any]:
        """Acceptance per draft position and the depth in use, over the window."""
        drafted: dict[str, float] = {}
        accepted: dict[str, float] = {}
        depths: dict[str, float] = {}
        for delta in self._window:
            _add(drafted, delta.drafted)
            _add(accepted, delta.accepted)
            _add(depths, delta.depths)
        positions = sorted((int(p) for p, n in drafted.items() if n > 0))
        acceptance = [round(accepted.get(str(p), 0.0) / drafted[str(p)], 4) for p in positions]
        steps = {d: n for d, n in depths.items() if n > 0 and d.isdigit()}
        total = sum(steps.values())
        mean = sum(int(d) * n for d, n in steps.items()) / total if total else None
        return {
            "acceptance_per_position": acceptance,
            "depth_mean": None if mean is None else round(mean, 3),
            "depth_steps": {d: int(n) for d, n in sorted(steps.items())},
        }

    def _backend(self, backend: Backend, steps: int, dt: float) -> dict[str, Any]:
        detector = getattr(backend, "detector", None)
        expected = getattr(detector, "expected_step_s", 0.0) if detector else 0.0
        memory = self.metrics.backend_memory.get(backend.name, {})
        return {
            "healthy": backend.healthy,
            "active": backend is self.router.active,
            "in_flight": backend.state.in_flight,
            "steps_per_s": round(max(steps, 0) / dt, 3) if detector else None,
            "step_p99_ms": round(1000 * expected, 3) if expected else None,
            "step_kind": getattr(detector, "step_kind", None) if detector else None,
            "memory_active_bytes": memory.get("active_bytes"),
            "memory_peak_bytes": memory.get("busy_peak_bytes"),
        }

    def since(self, after: float | None) -> list[dict[str, Any]]:
        """The samples taken after `after` (all of them for None)."""
        if after is None:
            return list(self.samples)
        return [s for s in self.samples if s["t"] > after]


def _steps(backend: Backend) -> int:
    """The backend's step counter (local engines report it; 0 for the others)."""
    detector = getattr(backend, "detector", None)
    steps = getattr(detector, "steps", 0) if detector is not None else 0
    return max(int(steps), 0)


def _positions(values: Counters, name: str) -> dict[str, float]:
    return _by_label(values, name, "position")
