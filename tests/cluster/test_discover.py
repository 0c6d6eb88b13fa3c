"""Joining a group: a port taken meanwhile is worth a restart, bad settings are not."""

import socket

import mlx.core as mx
import pytest

from mlxserve.cluster.discover import JOIN_ATTEMPTS, GroupPortTaken, _distributed
from mlxserve.cluster.launch import free_port_run
from mlxserve.config import ClusterSettings
from mlxserve.errors import UsageError


def _failing_init(message: str):  # type: ignore[no-untyped-def]
    def init(**_: object) -> None:
        raise RuntimeError(message)

    return init


def test_a_taken_port_is_retryable_and_other_failures_are_usage_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = ClusterSettings(backend="ring")
    monkeypatch.setattr(
        mx.distributed, "init", _failing_init("[ring] Couldn't bind socket (error: 98)")
    )
    with pytest.raises(GroupPortTaken, match="cannot join the ring cluster"):
        _distributed(settings)
    monkeypatch.setattr(mx.distributed, "init", _failing_init("[ring] Invalid hostfile"))
    with pytest.raises(UsageError, match="Invalid hostfile"):
        _distributed(settings)


def test_a_peer_not_up_yet_is_joined_again_then_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ECONNREFUSED: the peer lags (a front still starting its engine); MLX's init is
    called again, up to JOIN_ATTEMPTS, then the failure is named with the count."""
    calls: list[int] = []

    def refused(**_: object) -> None:
        calls.append(1)
        raise RuntimeError("[ring] Couldn't connect (error: 111)")

    monkeypatch.setattr(mx.distributed, "init", refused)
    with pytest.raises(UsageError, match=f"{JOIN_ATTEMPTS} attempts.*error: 111"):
        _distributed(ClusterSettings(backend="ring"))
    assert len(calls) == JOIN_ATTEMPTS
    # Refused once, then another failure: that one ends it, at once.
    answers = iter(["[ring] Couldn't connect (error: 111)", "[ring] Invalid hostfile"])
    monkeypatch.setattr(mx.distributed, "init", _failing_init_from(answers))
    with pytest.raises(UsageError, match=r"\(2 attempts\).*Invalid hostfile"):
        _distributed(ClusterSettings(backend="ring"))


def _failing_init_from(messages):  # type: ignore[no-untyped-def]
    def init(**_: object) -> None:
        raise RuntimeError(next(messages))

    return init


def test_free_port_run_is_free_below_the_ephemeral_range() -> None:
    start = free_port_run(3)
    assert start >= 20000 and start + 2 < 32768
    with socket.socket() as a, socket.socket() as b, socket.socket() as c:
        for sock, port in zip((a, b, c), range(start, start + 3), strict=True):
            sock.bind(("127.0.0.1", port))  # each port of the run binds
