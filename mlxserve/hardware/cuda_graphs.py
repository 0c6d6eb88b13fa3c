"""MLX CUDA's graph cache and graph size, set for a DeepSeek-V4 decode step.

MLX's CUDA backend records kernels into CUDA graphs, commits one every so many
operations (``MLX_MAX_OPS_PER_BUFFER``; MLX 0.32 picks it per architecture: 100 on an
H100 or H200, 20 on an A100) or once the graph's inputs pass a size budget
(``MLX_MAX_MB_PER_BUFFER``, counted in elements), keys each graph by its topology and
keeps ``MLX_CUDA_GRAPH_CACHE_SIZE`` instantiated ones. At stop 12 (an older MLX: 20
operations a graph, 100 graphs kept, all cleared on overflow) a 43-layer
DeepSeek-V4-shaped decode step was some 8,000 operations, ~400 commits, with more
distinct topologies than the cache held, and nearly every commit instantiated its
graph anew on the host. With 4096 a step, a verify forward and the engine's
calibration took half or less of their time on an H200 (docs/engine.md#tuning: the
measurements). MLX 0.32 keeps 400 by default; mlxserve keeps 4096.

A decode step now launches ~1,400 kernels at 43 layers (stop 28 cut the ops), and
its time on a GPU is the host's: building the graph in Python and MLX encoding it
(`benchmarks/step_modes.py`, H100, stop 32: 10.5 ms building and 21.5 ms encoding
of a 31.8 ms step, the device idle by the time the token is read). A step decoded as
the engine decodes it (queued before the last token is read) took 33.6 ms with MLX's
own setting and 32.3 at 100, against 28.2 at 2,000 (MXFP8 projections, one machine);
against 20 operations, 2,000 was faster on every model tried (float projections: cuBLAS
matmuls, 55.8 against 43.7 ms; a generic 5-layer Qwen3-MoE, 1.17 against 1.08), and
prefill memory at 4K-100K stayed within 5 % of the prediction. So mlxserve commits at
most 2,000 operations a graph. At V4-Flash's real width the size budget commits about
once a layer anyway (each routed projection's experts are ~270 M elements), and the
step did not move. Metal reads the same variable for its command buffers, where
nothing was measured, so it is set only where MLX runs on CUDA.

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
