"""The signal counter of the launcher and the follower ranks: wait, then leave at once."""

import signal

import pytest

from mlxserve.cluster.signals import SignalCounter


def test_the_follower_waits_once_then_exits_with_the_signal() -> None:
    waited: list[int] = []
    exits: list[int] = []
    counter = SignalCounter(2, on_wait=waited.append, exit=exits.append)
    counter.handle(signal.SIGINT)
    assert (waited, exits) == ([signal.SIGINT], [])
    counter.handle(signal.SIGTERM)
    assert (waited, exits) == ([signal.SIGINT], [128 + signal.SIGTERM])


def test_the_launcher_exits_130_on_the_third_whatever_the_signal() -> None:
    exits: list[int] = []
    counter = SignalCounter(3, exit_code=130, exit=exits.append)
    for _ in range(2):
        counter.handle(signal.SIGTERM)
    assert exits == [] and counter.received == 2
    counter.handle(signal.SIGTERM)
    assert exits == [130]


def test_exit_at_must_be_positive() -> None:
    with pytest.raises(ValueError, match="exit_at"):
        SignalCounter(0)
