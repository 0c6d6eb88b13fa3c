"""The clock that times model work on this device (depth calibration, round times),
and whether times taken at different moments compare.

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
    from mlxserve.hardware.device import on_cpu  # MLX loads only when a clock is asked for

    if on_cpu():
        return time.process_time
    return time.perf_counter


def observed_times_comparable() -> bool:
    """Whether round times observed at different moments may rank the depths.

    Not on a CPU device: there other processes share the cores, caches and memory
    bandwidth, and even CPU time moved 2-3x between consecutive requests on the
    2-core machine these docs are built on (a depth-1 round 10.6 ms, then 27.7 ms),
    so the automatic depth followed whichever depth was timed during a quiet spell
    (it chose depth 0 for a prompt whose first draft is kept 88% of the time). The
    calibration's probes are interleaved and agreed within 10% across three runs:
    there only the calibration ranks the depths. A GPU is not shared that way.
    """
    from mlxserve.hardware.device import on_cpu

    return not on_cpu()
