"""What MLX's allocator counts for an array of n bytes on this device; prints one JSON.

The demo's memory target (peak at 8 clients <= 1.2 x weights + caches) is a ratio of
MLX's own counts (``mx.get_peak_memory``), on a model of 2.9 MB whose caches and
activations are thousands of arrays of a few hundred bytes to a few KB each. If the
allocator hands out (and counts) more than an array's ``nbytes`` (a minimum block, a
rounding), such small arrays make the ratio worse than the same model would at a real
size. This allocates ``--count`` arrays of each size, evaluated, and reports the
active memory they add per array, over their ``nbytes``.

Run: python benchmarks/allocation_sizes.py [--count 256]
"""

import argparse
import json
from typing import Any

import mlx.core as mx

from mlxserve.hardware.probe import benchmark_device

SIZES = (4, 64, 256, 1000, 4096, 16384, 65536, 1 << 20)


def added_per_array(nbytes: int, count: int) -> float:
    """Active bytes `count` fresh float32 arrays of `nbytes` each add, per array."""
    mx.synchronize()
    before = mx.get_active_memory()
    arrays = [mx.full((nbytes // 4,), float(i), dtype=mx.float32) for i in range(count)]
    mx.eval(arrays)
    mx.synchronize()
    added = mx.get_active_memory() - before
    del arrays
    return added / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=256)
    args = parser.parse_args()
    if args.count < 1:
        parser.error("--count must be >= 1")
    mx.set_cache_limit(0)  # freed buffers are returned, not kept for reuse
    sizes: dict[str, Any] = {}
    for nbytes in SIZES:
        added = added_per_array(nbytes, args.count)
        sizes[str(nbytes)] = {"counted_bytes": added, "over_nbytes": added / nbytes}
    print(json.dumps({"device": benchmark_device(), "count": args.count, "sizes": sizes}, indent=2))


if __name__ == "__main__":
    main()
