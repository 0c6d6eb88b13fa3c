"""Joining a group: a port taken meanwhile is worth a restart, bad settings are not."""

import json
import socket
from pathlib import Path

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


def _ring_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rank: int, size: int) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{5000 + i}"] for i in range(size)]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    monkeypatch.setenv("MLX_RANK", str(rank))


def test_a_peer_not_up_yet_is_joined_again_then_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """ECONNREFUSED: the peer lags (a front still starting its engine); the ring's
    last rank calls MLX's init again, up to JOIN_ATTEMPTS, then names the failure
    with the count."""
    _ring_rank(monkeypatch, tmp_path, rank=2, size=3)
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


def test_only_the_rings_last_rank_joins_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Any other rank has accepted its left neighbour before it connects: a retry
    would wait for a connection that never comes again. It fails at once."""
    calls: list[int] = []

    def refused(**_: object) -> None:
        calls.append(1)
        raise RuntimeError("[ring] Couldn't connect (error: 111)")

    monkeypatch.setattr(mx.distributed, "init", refused)
    for rank in (0, 1):
        _ring_rank(monkeypatch, tmp_path, rank=rank, size=3)
        calls.clear()
        with pytest.raises(UsageError, match=r"cannot join the ring cluster: .*error: 111"):
            _distributed(ClusterSettings(backend="ring"))
        assert len(calls) == 1


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
