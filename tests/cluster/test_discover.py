"""Joining a group: a port taken meanwhile is worth a restart, bad settings are not."""

import socket

import mlx.core as mx
import pytest

from mlxserve.cluster.discover import GroupPortTaken, _distributed
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


def test_free_port_run_is_free_below_the_ephemeral_range() -> None:
    start = free_port_run(3)
    assert start >= 20000 and start + 2 < 32768
    with socket.socket() as a, socket.socket() as b, socket.socket() as c:
        for sock, port in zip((a, b, c), range(start, start + 3), strict=True):
            sock.bind(("127.0.0.1", port))  # each port of the run binds
