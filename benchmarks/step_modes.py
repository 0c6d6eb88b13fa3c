"""Where a decode step's time goes on the host: building its graph, handing it to the
device, and waiting; one JSON.

A plain decode step of the Flash-shaped model is bound by the host on a GPU (stop 25:
host 42 ms of a 47 ms step on an H100), and queuing step n + 1 before reading step n
(as the engine and mlx-lm decode) made it slower there, not faster (60.8 against 46.9
ms; stop 32: 33.8 against 24.3). This times one model's greedy decode steps four
ways, in turns, in one process:

- ``synced``: built, queued (``mx.async_eval``) and waited for, one at a time; its
  parts: ``build`` (the Python forward making the lazy graph), ``queue`` (the
  ``async_eval`` call: MLX encoding the graph's kernels and launching them) and
  ``wait`` (until the token can be read);
- ``pipelined``: each step built from the last one's lazy token and queued before that
  token is read (`pipelined.pipelined_steps`), with the same three parts;
- ``built_ahead``: step n + 1's graph built while step n runs, but queued only after
  step n's token is read.

MLX's CUDA back-end commits a CUDA graph every ``MLX_MAX_OPS_PER_BUFFER`` kernels (a
small default); run this under several values to see what the commits cost.

Run: python benchmarks/step_modes.py [--model flash|real|generic] [--layers 43] [--rows 1]
         [--context 300] [--steps 8] [--rounds 5] [--dense mxfp8]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device


class Timer:
    """Seconds spent in each named part, summed."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {"build": 0.0, "queue": 0.0, "wait": 0.0}

    def run(self, part: str, call: Callable[..., Any], *args: Any) -> Any:
        began = time.perf_counter()
        out = call(*args)
        self.parts[part] += time.perf_counter() - began
        return out


def prefilled(model: Any, rows: int, context: int) -> list[list[Any]]:
    """`rows` caches, each prefilled with `context` random tokens: DeepSeek-V4's own
    (`graph_nodes.prefilled_rows`), or mlx-lm's for a generic model."""
    from graph_nodes import prefilled_rows  # beside this file

    if hasattr(model, "forward_hidden"):  # mlxserve's DeepSeek-V4
        return prefilled_rows(model, rows, context, margin=0)
    from mlx_lm.models.cache import make_prompt_cache

    caches = []
    for row in range(rows):
        cache = make_prompt_cache(model)
        prompt = mx.random.randint(0, model.args.vocab_size, (1, context), key=mx.random.key(row))
        mx.eval(model(prompt, cache=cache), [c.state for c in cache])
        caches.append(cache)
    return caches


def decode_modes(model: Any, rows: int, context: int, steps: int) -> dict[str, Any]:
    """One round of each mode: milliseconds per step, whole and by part."""
    caches = prefilled(model, rows, context)
    per_layer: list[Any] = caches[0]
    if rows > 1:
        per_layer = [
            type(caches[0][i]).stack([c[i] for c in caches]) for i in range(len(model.layers))
        ]
        mx.eval([c.state for c in per_layer])

    def build(tokens: mx.array) -> mx.array:
        return mx.argmax(model(tokens, per_layer)[:, -1], axis=-1)[:, None]

    def queue(out: mx.array) -> None:
        mx.async_eval(out, [c.state for c in per_layer])  # type: ignore[no-untyped-call]

    first = mx.array([[(17 * r + 5) % model.args.vocab_size] for r in range(rows)])
    result: dict[str, Any] = {}

    timer = Timer()
    current = first
    began = time.perf_counter()
    for _ in range(steps):
        out = timer.run("build", build, current)
        timer.run("queue", queue, out)
        current = mx.array(timer.run("wait", out.tolist))
    result["synced"] = _report(time.perf_counter() - began, timer, steps)

    def ahead(queue_first: bool) -> dict[str, float]:
        """Each step built from the last one's lazy token before that token is read;
        queued before the read (``queue_first``: pipelined) or after it (built ahead)."""
        timer = Timer()
        current = build(first)
        queue(current)
        began = time.perf_counter()
        for _ in range(steps):
            following = timer.run("build", build, current)
            if queue_first:
                timer.run("queue", queue, following)
            timer.run("wait", current.tolist)
            if not queue_first:
                timer.run("queue", queue, following)
            current = following
        elapsed = time.perf_counter() - began
        current.tolist()
        return _report(elapsed, timer, steps)

    result["pipelined"] = ahead(queue_first=True)
    result["built_ahead"] = ahead(queue_first=False)
    return result


def profile_build(model: Any, rows: int, context: int, steps: int, top: int) -> dict[str, Any]:
    """Where building a decode step's graph spends the host's time: ``cProfile`` over
    the Python forward of `steps` steps (each evaluated before the next is built, so
    only building is profiled), the `top` functions by own time and by time inside.
    MLX's calls are not Python functions to the profiler: their time is their
    caller's own. Profiling slows the build itself, so shares matter, not totals."""
    caches = prefilled(model, rows, context)
    per_layer: list[Any] = caches[0]
    tokens = mx.array([[(17 * r + 5) % model.args.vocab_size] for r in range(rows)])
    profiler = cProfile.Profile()
    for _ in range(steps):
        profiler.enable()
        out = mx.argmax(model(tokens, per_layer)[:, -1], axis=-1)[:, None]
        profiler.disable()
        mx.eval(out, [c.state for c in per_layer])
        tokens = out
    stats = pstats.Stats(profiler)
    table: dict[tuple[str, int, str], Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in table.values())

    def name(key: tuple[str, int, str]) -> str:
        path, line, function = key
        return f"{path.split('mlxserve/')[-1].split('site-packages/')[-1]}:{line}({function})"

    def ranked(column: int) -> list[dict[str, Any]]:
        best = sorted(table.items(), key=lambda kv: -kv[1][column])[:top]
        return [
            {
                "function": name(key),
                "calls_per_step": e[1] / steps,
                "ms_per_step": e[column] / steps * 1e3,
            }
            for key, e in best
        ]

    return {
        "steps": steps,
        "profiled_ms_per_step": total / steps * 1e3,
        "by_own_time": ranked(2),
        "by_time_inside": ranked(3),
    }


def fast_paths(model: Any, rows: int, context: int) -> dict[str, int]:
    """Which of the model's fast paths one decode step took: its custom-kernel nodes
    (the CUDA hyper-connection kernel, the Sinkhorn's; each checks itself and steps
    aside with a warning) and the MoE blocks whose decode ran as one compiled function
    (`moe.MoE._decode_plan`)."""
    from graph_nodes import count_nodes  # beside this file

    caches = prefilled(model, rows, context)
    per_layer: list[Any] = caches[0]
    tokens = mx.array([[(17 * r + 5) % model.args.vocab_size] for r in range(rows)])
    counts = count_nodes([model(tokens, per_layer)])
    plans = [getattr(getattr(layer, "ffn", None), "_decode_plan", None) for layer in model.layers]
    return {
        "custom_kernel_nodes": counts.get("CustomKernel", 0),
        "moe_blocks_compiled": sum(1 for plan in plans if plan is not None and plan.block),
    }


def launch_directly() -> None:
    """Call the CUDA hyper-connection kernel without `_compiled_launch`'s ``mx.compile``
    (as before stop 33), for an A/B of that alone."""
    from mlxserve.kernels import hyper_connection

    hyper_connection._compiled_launch = hyper_connection._launcher  # type: ignore[assignment]


def _report(elapsed: float, timer: Timer, steps: int) -> dict[str, float]:
    out = {"step_ms": elapsed / steps * 1e3}
    out.update({f"{part}_ms": s / steps * 1e3 for part, s in timer.parts.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["flash", "real", "generic"], default="flash")
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--context", type=int, default=300, help="prefilled tokens per row")
    parser.add_argument("--steps", type=int, default=8, help="steps per mode per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dense", choices=["mxfp8", "float"], default="mxfp8")
    parser.add_argument(
        "--profile", type=int, default=0, help="also profile the build of this many steps"
    )
    parser.add_argument(
        "--hc-launch",
        choices=["compiled", "direct"],
        default="compiled",
        help="the CUDA hyper-connection kernel called through mx.compile (as served) or directly",
    )
    parser.add_argument(
        "--moe",
        choices=["compiled", "ops"],
        default="compiled",
        help="DeepSeek-V4's decode MoE block as one compiled function (as served) or op by op",
    )
    args = parser.parse_args()
    configure_cuda_graphs()  # as the CLI does, before any device work
    if args.model == "generic":  # serve.py's generic Qwen3-MoE, float32: cuBLAS matmuls
        from serve import GENERIC, random_model  # beside this file

        model = random_model(GENERIC["qwen3-moe"])
        mx.eval(model.parameters())
    elif args.model == "flash":
        from mtp_cost import flash_shaped  # beside this file

        model = flash_shaped(args.layers, 512, 64, 8192, dense=args.dense)
    else:
        from real_width import build  # beside this file

        model = build(args.layers)
    if args.hc_launch == "direct":
        launch_directly()
    for layer in model.layers:  # DeepSeek-V4's MoE blocks (`moe.MoE.compile_decode`)
        block: Any = getattr(layer, "ffn", None)
        if hasattr(block, "compile_decode"):
            block.compile_decode = args.moe == "compiled"
    decode_modes(model, args.rows, args.context, 2)  # compilations, first uses
    rounds = [decode_modes(model, args.rows, args.context, args.steps) for _ in range(args.rounds)]
    medians = {
        mode: {key: statistics.median(r[mode][key] for r in rounds) for key in rounds[0][mode]}
        for mode in rounds[0]
    }
    result = {
        "benchmark": "step_modes",
        "model": args.model,
        "layers": len(model.layers),
        "rows": args.rows,
        "context": args.context,
        "dense_projections": args.dense if args.model == "flash" else args.model,
        "max_ops_per_buffer": os.environ.get("MLX_MAX_OPS_PER_BUFFER", "default"),
        "moe": args.moe,
        "hc_launch": args.hc_launch,
        "median_ms": medians,
        "rounds": rounds,
        "fast_paths": fast_paths(model, args.rows, args.context),
        "build_profile": (
            profile_build(model, args.rows, args.context, args.profile, top=30)
            if args.profile
            else None
        ),
        "device": benchmark_device(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
