"""MLX CUDA's graph cache and graph size, set for a DeepSeek-V4 decode step.

MLX's CUDA backend records kernels into CUDA graphs, commits one every 20
operations, keys each by its topology and keeps at most
``MLX_CUDA_GRAPH_CACHE_SIZE`` instantiated graphs (100 by default), clearing them
*all* when the cache overflows. A 43-layer DeepSeek-V4-shaped decode step is some
8,000 operations, ~400 commits, with more distinct topologies than 100: the cache
is cleared over and over and nearly every commit instantiates its graph anew on
the host. With 4096 a step, a verify forward and the engine's calibration took half
or less of their time on an H200, and committing more operations at once or launching
without graphs was slower then (docs/engine.md#tuning: the measurements).

A decode step now launches ~1,400 kernels at 43 layers (stop 28 cut the ops), and
its time on a GPU is the host's: building the graph in Python and MLX encoding it
(`benchmarks/step_modes.py`, H100, stop 32: 10.5 ms building and 21.5 ms encoding
of a 31.8 ms step, the device idle by the time the token is read). A step decoded as
the engine decodes it (queued before the last token is read) took 33.6 and 34.9 ms
at 20 operations a graph against 28.2 and 29.0 at 2,000 (MXFP8 projections, two
machines); with float projections (cuBLAS matmuls) 55.8 against 43.7, and on a
generic 5-layer Qwen3-MoE 1.17 against 1.08 ms; prefill memory at 4K-100K stayed
within 5 % of the prediction. So mlxserve commits at most 2,000 operations a graph:
one or two graphs a decode step. Metal reads the same variable for its command
buffers, where nothing was measured, so it is set only where MLX runs on CUDA.

MLX reads these variables once per process, at its first graph commit, so they are set
before anything runs on the device: at the CLI's start (the engine processes and
``mlx.launch``'s local ranks inherit it) and by benchmarks that time the engine in
their own process. A value the user exported is kept.
"""

import os

#: environment variable -> value mlxserve runs with unless the user set one
CUDA_GRAPH_SETTINGS = {"MLX_CUDA_GRAPH_CACHE_SIZE": "4096", "MLX_MAX_OPS_PER_BUFFER": "2000"}


def configure_cuda_graphs(
    environ: dict[str, str] | None = None, cuda: bool | None = None
) -> dict[str, str]:
    """Set mlxserve's CUDA graph settings where the user has not; return those in effect
    (none where MLX has no CUDA back-end).

    ``environ``: the mapping to update (``os.environ`` by default, which child
    processes inherit); ``cuda``: whether MLX runs on CUDA here (asked of MLX if None;
    asking starts no device work).
    """
    if cuda is None:
        import mlx.core as mx  # here, not at import: the CLI imports this module first

        cuda = mx.cuda.is_available()
    if not cuda:
        return {}
    env: dict[str, str] | os._Environ[str] = os.environ if environ is None else environ
    for name, value in CUDA_GRAPH_SETTINGS.items():
        env.setdefault(name, value)
    return {name: env[name] for name in CUDA_GRAPH_SETTINGS}
