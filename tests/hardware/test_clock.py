"""The clock that times model work: CPU time on a CPU device."""

import time

import mlx.core as mx

from mlxserve.hardware.clock import cost_clock, observed_times_comparable


def test_a_cpu_device_is_timed_by_this_process_cpu_time() -> None:
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        assert cost_clock() is time.process_time
    finally:
        mx.set_default_device(previous)


def test_a_cpu_device_ranks_depths_by_the_calibration_only() -> None:
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        assert observed_times_comparable() is False
    finally:
        mx.set_default_device(previous)
