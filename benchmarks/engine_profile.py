"""Where an engine step's host time goes, on the demo model; prints one JSON document.

On a GPU the demo's steps are small: the host's work per step (the engine's Python,
building the lazy graph, MLX encoding it) is what batching and speculation have to
beat, so this shows where it goes. This runs the engine in this one process, as
``batch_step.py``'s engine part does (requests submitted at once, greedy, served as
``mlxserve serve`` serves the demo), and for each level:

- aggregate tok/s (median over ``--repeats`` runs) and where the engine's time went,
  from ``cProfile`` over one more run: the time inside MLX's blocking calls
  (``tolist``, ``item``, ``mx.eval``, ``mx.async_eval``: waiting for the device, and
  MLX's own encoding of the graph on a GPU; the computation itself on a CPU) against
  the rest (``host_s``: the engine's Python, building the graph included), the
  engine's phases by their cumulative time (prefill, decode steps, speculative
  rounds, the MTP backlog's flushes, scheduling), and the top functions by own time;
- the engine's MLX memory: the weights as MLX holds them (``active_after_load``)
  against their ``nbytes``, and the level's peak.

``--ab-fill`` also times, interleaved with the engine as it is, the engine building the
MTP entries of decoded positions with a whole MTP forward (``mtp_forward``) instead of
``mtp_fill``, as it did before, and reports the paired ratios per level.

Run: python benchmarks/engine_profile.py [--levels 1,8] [--tokens 64] [--repeats 3]
[--ab-fill]
"""

import argparse
import cProfile
import json
import pstats
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
from batch_step import demo_engine, engine_rate
from mlx.utils import tree_flatten

from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device

#: functions whose cumulative time names an engine phase (file suffix, function)
PHASES = {
    "prefill": ("engine/runner/runner.py", "_prefill"),
    "decode_step": ("engine/runner/runner.py", "_step"),
    "speculate_alone": ("engine/runner/runner.py", "_speculate"),
    "speculate_batch": ("engine/runner/runner.py", "_speculate_all"),
    "mtp_flush": ("engine/runner/batch.py", "flush"),
    "emit": ("engine/core/stepper.py", "_emit"),
    "schedule": ("engine/core/scheduler.py", "next_step"),
}
#: MLX calls that block until the device has computed what they read (``async_eval``
#: only queues on a GPU, but computes the whole graph before it returns on a CPU)
WAITS = {"eval": mx, "async_eval": mx, "synchronize": mx, "tolist": mx.array, "item": mx.array}


@contextmanager
def visible_waits() -> Iterator[None]:
    """Wrap the MLX calls in ``WAITS`` in Python functions, which cProfile sees (it does
    not see nanobind's, so their time would land in their callers' own time)."""
    originals = {name: getattr(owner, name) for name, owner in WAITS.items()}

    def wrapped(original: Any) -> Any:
        def device_wait(*args: Any, **kwargs: Any) -> Any:
            return original(*args, **kwargs)

        return device_wait

    for name, owner in WAITS.items():
        setattr(owner, name, wrapped(originals[name]))
    try:
        yield
    finally:
        for name, owner in WAITS.items():
            setattr(owner, name, originals[name])


def profile_run(engine: Any, clients: int, tokens: int, context: int) -> dict[str, Any]:
    """One run of ``clients`` requests under cProfile: its rate and where its time went."""
    profiler = cProfile.Profile()
    start = time.perf_counter()
    with visible_waits():
        profiler.enable()
        rate = engine_rate(engine, clients, tokens, context)
        profiler.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    table: dict[tuple[str, int, str], tuple[Any, ...]] = stats.stats  # type: ignore[attr-defined]
    phases: dict[str, float] = {}
    waits = 0.0
    own: list[tuple[float, str, int]] = []
    for (filename, line, name), (_, calls, tottime, cumtime, _) in table.items():
        for phase, (suffix, function) in PHASES.items():
            if filename.endswith(suffix) and name == function:
                phases[phase] = phases.get(phase, 0.0) + cumtime
        if name == "device_wait":
            waits += cumtime
        where = f"{filename.split('/site-packages/')[-1].split('/work/main/')[-1]}:{line}({name})"
        own.append((tottime, where, calls))
    own.sort(reverse=True)
    return {
        "profiled_tok_s": rate,
        "wall_s": wall,
        "phases_s": {k: round(v, 4) for k, v in sorted(phases.items())},
        "device_waits_s": round(waits, 4),
        "host_s": round(wall - waits, 4),
        "top_own_time": [
            {"function": where, "seconds": round(t, 4), "calls": calls}
            for t, where, calls in own[:25]
        ],
    }


@contextmanager
def whole_forward_fill(model: Any) -> Iterator[None]:
    """The MTP entries of decoded positions made by a whole MTP forward, as before."""

    def forward(streams: Any, tokens: Any, cache: Any, block: int = 0) -> None:
        model.mtp_forward(streams, tokens, cache, block)

    model.mtp_fill = forward
    try:
        yield
    finally:
        del model.mtp_fill


def ab_fill(model: Any, engine: Any, levels: list[int], args: Any) -> dict[str, Any]:
    """Per level, tok/s with ``mtp_fill`` and with the whole forward, alternating, and
    the median of the repeats' paired ratios (fill over forward)."""
    out: dict[str, Any] = {}
    for n in levels:
        fill, forward = [], []
        for _ in range(args.repeats):
            fill.append(engine_rate(engine, n, args.tokens, args.context))
            with whole_forward_fill(model):
                forward.append(engine_rate(engine, n, args.tokens, args.context))
        out[str(n)] = {
            "fill_tok_s": fill,
            "forward_tok_s": forward,
            "fill_over_forward": statistics.median(
                a / b for a, b in zip(fill, forward, strict=True)
            ),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,8", help="comma-separated request counts")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--context", type=int, default=40, help="the shortest prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ab-fill", action="store_true", help="pair mtp_fill with mtp_forward")
    args = parser.parse_args()
    configure_cuda_graphs()  # as the CLI does, before any device work
    levels = [int(n) for n in args.levels.split(",")]

    from mlxserve.engine.core.build import materialize
    from mlxserve.models import load

    model, _ = load("demo")
    materialize(model)
    parameters = tree_flatten(model.parameters())
    assert isinstance(parameters, list)
    weights = sum(v.nbytes for _, v in parameters)
    result: dict[str, Any] = {
        "model": "demo",
        "tokens": args.tokens,
        "repeats": args.repeats,
        "device": benchmark_device(),
        "memory": {"weights_nbytes": weights, "active_after_load": int(mx.get_active_memory())},
        "levels": {},
    }
    engine = demo_engine(model, max(levels))
    for n in levels:  # untimed: calibration, and kernels compile on a shape's first use
        engine_rate(engine, n, 8, args.context)
    if args.ab_fill:
        result["ab_fill"] = ab_fill(model, engine, levels, args)
    for n in levels:
        rates = [engine_rate(engine, n, args.tokens, args.context) for _ in range(args.repeats)]
        mx.reset_peak_memory()
        entry = profile_run(engine, n, args.tokens, args.context)
        entry["peak_memory"] = int(mx.get_peak_memory())
        entry["tok_s"] = statistics.median(rates)
        entry["tok_s_per_repeat"] = rates
        result["levels"][str(n)] = entry
    first = result["levels"][str(levels[0])]["tok_s"]
    for entry in result["levels"].values():
        entry["over_first_level"] = entry["tok_s"] / first
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
