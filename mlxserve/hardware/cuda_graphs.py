"""MLX CUDA's graph cache, sized for a DeepSeek-V4 decode step.

MLX's CUDA backend records kernels into CUDA graphs, commits one every 20
operations, keys each by its topology and keeps at most
``MLX_CUDA_GRAPH_CACHE_SIZE`` instantiated graphs (100 by default), clearing them
*all* when the cache overflows. A 43-layer DeepSeek-V4-shaped decode step is some
8,000 operations, ~400 commits, with more distinct topologies than 100: the cache
is cleared over and over and nearly every commit instantiates its graph anew on
the host. With 4096 a step, a verify forward and the engine's calibration took half
or less of their time on an H200, and committing more operations at once or launching
without graphs was slower (docs/engine.md#tuning: the measurements).

MLX reads the variable once per process, at its first graph commit, so it is set
before anything runs on the device: at the CLI's start (the engine processes and
``mlx.launch``'s local ranks inherit it) and by benchmarks that time the engine in
their own process. A value the user exported is kept. Other backends ignore it.
"""

import os

#: environment variable -> value mlxserve runs with unless the user set one
CUDA_GRAPH_SETTINGS = {"MLX_CUDA_GRAPH_CACHE_SIZE": "4096"}


def configure_cuda_graphs(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set mlxserve's CUDA graph settings where the user has not; return those in effect.

    ``environ``: the mapping to update (``os.environ`` by default, which child
    processes inherit).
    """
    env: dict[str, str] | os._Environ[str] = os.environ if environ is None else environ
    for name, value in CUDA_GRAPH_SETTINGS.items():
        env.setdefault(name, value)
    return {name: env[name] for name in CUDA_GRAPH_SETTINGS}
