"""`InFlight`: each piece queued, the host waiting for the piece before it."""

from typing import Any

import mlx.core as mx
import pytest

from mlxserve.models import in_flight
from mlxserve.models.in_flight import InFlight


def test_each_piece_is_queued_and_the_one_before_it_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, list[Any]]] = []
    queue_async, wait = mx.async_eval, mx.eval

    def spy_async(*arrays: Any) -> None:
        calls.append(("queue", [float(a.item()) for a in arrays]))
        queue_async(*arrays)

    def spy_wait(*arrays: Any) -> None:
        calls.append(("wait", [float(a.item()) for a in arrays[0]]))
        wait(*arrays)

    monkeypatch.setattr(in_flight.mx, "async_eval", spy_async)
    monkeypatch.setattr(in_flight.mx, "eval", spy_wait)
    pieces = InFlight()
    for value in (1.0, 2.0, 3.0):
        pieces.queue(mx.array(value) * 1, mx.array(value) * 10)
    assert calls == [
        ("queue", [1.0, 10.0]),
        ("queue", [2.0, 20.0]),
        ("wait", [1.0, 10.0]),
        ("queue", [3.0, 30.0]),
        ("wait", [2.0, 20.0]),
    ]


def test_queued_pieces_compute_what_the_lazy_graph_does() -> None:
    x = mx.random.normal((64, 64), key=mx.random.key(0))
    lazy = x
    for _ in range(4):
        lazy = mx.tanh(lazy @ x)
    pieces, queued = InFlight(), x
    for _ in range(4):
        queued = mx.tanh(queued @ x)
        pieces.queue(queued)
    assert mx.array_equal(lazy, queued).item()
