"""The clock that times model work on this device (depth calibration, round times).

On a GPU the host waits for the device, so the wall clock is what a step costs.
On a CPU device the work is this process's own: its CPU time is the cost, and
unlike the wall clock it does not count the time other processes held the cores.
Measured on a 2-core CPU shared with other work: wall-clock calibrations put a
verify forward of 2 tokens below a plain step of 1 and round times swung 2x, so
the automatic depth chased noise; CPU-time figures were steady.
"""

import time
from collections.abc import Callable


def cost_clock() -> Callable[[], float]:
    """`time.process_time` when MLX computes on the CPU, else `time.perf_counter`."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return time.process_time
    return time.perf_counter
