"""DeepSeek-V4 decode-step benchmark on the built-in demo model; prints one JSON document.

For batches of 1, 2, 4 and 8 rows of different lengths (past the sliding window, at
different compressor phases), one decode step (one token per row) two ways, in this
one process, interleaved over repeats so drift hits them alike:

- ``per_row``: ``RowCaches``, the attention core (window, compressors, indexer) run
  row by row, the projections, MoE and head once for the batch;
- ``stacked``: ``RowBatch.step``, the rows' caches stacked (``stacked.py``), the
  core once for the batch.

Per batch size: the median step time, tokens/s (rows / step time), the scaling over
the same path at batch 1, the stacked path's speed-up, and the MLX primitives in
a step's graph (``mx.export_to_dot`` of the logits and the updated caches; the mean
over 16 steps, a period of the compressors): all of them, and those that launch a
kernel (views such as reshapes and slices left out; ``top`` lists the commonest of
the last counted step). A GPU at these sizes is bound by launches, so the primitive counts say more
about the gain there than a CPU's timings do.

Per path it also reports MLX's peak over ``--steps`` steps above the memory held before
them (``step_peak_over_held_bytes_synced`` / ``_pipelined``): what a step's activations
add, with each step evaluated alone and queued as the engine queues them.

Then the same comparison through the engine (``engine``): 1 / 2 / 4 / 8 requests of
``--engine-tokens`` greedy tokens at once, served as ``mlxserve serve`` serves the
demo (MTP at the default depth: a lone request drafts, two draft together, more
decode in a plain batch), aggregate tok/s and its ratio to one request's, with the
batch's rows stacked and (``RowBatch.decode_caches`` swapped for the row-by-row
caches) not: the demo's targets, without the HTTP server around it.

Run: python benchmarks/batch_step.py [--batches 1,2,4,8] [--steps 32] [--repeats 3]
[--clock wall|cpu] (about a minute on a 2-core CPU)
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

from mlxserve.channel.request import GenerationParams
from mlxserve.engine.core.build import DEFAULT_MTP_DEPTH, adapter_for
from mlxserve.engine.core.drive import drain
from mlxserve.engine.core.request import FinishEvent, GenerationRequest, TokensEvent
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.runner.adapter import PlainAdapter, PlainState
from mlxserve.engine.runner.batch import RowBatch
from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device
from mlxserve.hardware.tuning import EngineTuning, default_tuning
from mlxserve.models.deepseek_v4.cache import RowCaches

#: primitives that make a view (or nothing) rather than launch a kernel
VIEWS = {"Broadcast", "Reshape", "Slice", "Transpose", "ExpandDims", "Squeeze", "StopGradient"}


#: steps whose graphs are counted: a whole period of the demo's compressors (ratios 4, 16)
COUNTED_STEPS = 16


def prompt(row: int, length: int) -> list[int]:
    return [(7 * i + 13 * row + 3) % 1000 + 6 for i in range(length)]


def prefill(adapter: PlainAdapter, batch: int, base: int) -> list[PlainState]:
    """``batch`` rows, row ``i`` of ``base + 11 * i`` tokens (different compressor phases)."""
    states = []
    for row in range(batch):
        state = adapter.new_state(0)
        adapter.prefill(state, prompt(row, base + 11 * row))
        states.append(state)
    return states


class PerRow:
    """The row-by-row core (``RowCaches``), as decode batches ran before stacking."""

    def __init__(self, model: Any, states: list[PlainState]) -> None:
        self.model, self.states = model, states

    def step(self, tokens: mx.array) -> mx.array:
        layers = [
            RowCaches(list(layer)) for layer in zip(*(s.cache for s in self.states), strict=True)
        ]
        logits: mx.array = self.model(tokens[:, None], cache=layers)
        return logits[:, -1]

    def arrays(self) -> list[mx.array]:
        return [a for s in self.states for c in s.cache for a in c.state]


class Stacked(RowBatch):
    def arrays(self) -> list[mx.array]:
        return [a for layer in self.decode_caches() for a in layer.state]


def count_primitives(outputs: list[mx.array]) -> dict[str, Any]:
    """The primitives in the (unevaluated) graph of ``outputs``."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "step.dot")
        mx.export_to_dot(path, *outputs)
        with open(path) as handle:
            labels = [
                line.split('label ="', 1)[1].split('"', 1)[0]
                for line in handle
                if "shape=rectangle" in line
            ]
    kinds = Counter(labels)
    return {
        "primitives": len(labels),
        "kernels": sum(n for kind, n in kinds.items() if kind not in VIEWS),
        "top": dict(kinds.most_common(8)),
    }


#: time.perf_counter (wall) or time.process_time (this process's CPU time: steadier on
#: a CPU shared with other work)
CLOCK = [time.perf_counter]


def run_steps(runner: Any, tokens: mx.array, steps: int) -> tuple[float, mx.array]:
    """Seconds per step over ``steps`` greedy steps (each evaluated, caches included)."""
    start = CLOCK[0]()
    for _ in range(steps):
        logits = runner.step(tokens)
        tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
        mx.eval(tokens, runner.arrays())
    return (CLOCK[0]() - start) / steps, tokens


def step_memory(runner: Any, tokens: mx.array, steps: int, pipelined: bool) -> tuple[int, mx.array]:
    """MLX's peak over ``steps`` greedy steps, above what was held before them: each
    step evaluated before the next is built, or (``pipelined``, as the engine decodes)
    the next step queued before the current one's tokens are read."""
    mx.eval(tokens, runner.arrays())
    held = int(mx.get_active_memory())
    mx.reset_peak_memory()
    for _ in range(steps):
        logits = runner.step(tokens)
        tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
        if pipelined:
            mx.async_eval(tokens, runner.arrays())  # type: ignore[no-untyped-call]
        else:
            mx.eval(tokens, runner.arrays())
    mx.eval(tokens, runner.arrays())
    return int(mx.get_peak_memory()) - held, tokens


@contextmanager
def rows_unstacked() -> Iterator[None]:
    """Decode batches run the attention core row by row, as before stacking."""
    stacked = RowBatch.decode_caches

    def per_row(self: RowBatch) -> list[Any]:
        return self.layer_rows([state.cache for state in self.states])

    setattr(RowBatch, "decode_caches", per_row)  # noqa: B010
    try:
        yield
    finally:
        setattr(RowBatch, "decode_caches", stacked)  # noqa: B010


def demo_engine(model: Any, clients: int, tuning: EngineTuning | None = None) -> Engine:
    """An engine set up as ``mlxserve serve`` sets one up for the demo (no prefix cache),
    with this device's tuning or ``tuning``."""
    tuning = tuning or default_tuning()
    config = EngineConfig(
        max_running=clients,
        speculative_depth=DEFAULT_MTP_DEPTH,
        prefix_cache_entries=0,
        max_speculative_batch=tuning.speculative_batch,
        batch_speculative_depth=tuning.speculative_batch_depth,
        tuning=tuning,
    )
    return Engine(adapter_for(model, DEFAULT_MTP_DEPTH), config)


def engine_rate(
    engine: Engine,
    clients: int,
    tokens: int,
    context: int,
    on_finish: Callable[[FinishEvent], None] | None = None,
) -> float:
    """Aggregate tok/s of ``clients`` greedy requests submitted at once (prefill included);
    ``on_finish`` sees every request's finish event."""
    start = CLOCK[0]()
    streams = [
        engine.submit(
            GenerationRequest(f"r{i}", GenerationParams(tuple(prompt(i, context + 11 * i)), tokens))
        )
        for i in range(clients)
    ]
    produced, finished = 0, 0
    for _ in range(100 * tokens * clients):  # a bound, not a budget
        engine.run_once()
        for stream in streams:
            for event in drain(stream):
                if isinstance(event, TokensEvent):
                    produced += len(event.token_ids)
                elif isinstance(event, FinishEvent):
                    finished += 1
                    if on_finish is not None:
                        on_finish(event)
        if finished == clients:
            return produced / (CLOCK[0]() - start)
    raise RuntimeError("the engine did not finish its requests")


def engine_scaling(
    model: Any, levels: list[int], tokens: int, context: int, repeats: int
) -> dict[str, Any]:
    """Aggregate tok/s per number of requests, stacked and row by row, interleaved.

    One engine for all: its depth picker calibrates once, in the untimed warm-up."""
    engine = demo_engine(model, max(levels))
    for n in levels:  # untimed: calibration, and kernels compile on a shape's first use
        engine_rate(engine, n, 8, context)
        with rows_unstacked():
            engine_rate(engine, n, 8, context)
    rates: dict[str, dict[int, list[float]]] = {"stacked": {}, "per_row": {}}
    for _ in range(repeats):
        for n in levels:
            rates["stacked"].setdefault(n, []).append(engine_rate(engine, n, tokens, context))
            with rows_unstacked():
                rate = engine_rate(engine, n, tokens, context)
            rates["per_row"].setdefault(n, []).append(rate)
    out: dict[str, Any] = {"tokens": tokens, "depth": DEFAULT_MTP_DEPTH}
    for name, by_level in rates.items():
        medians = {n: statistics.median(values) for n, values in by_level.items()}
        out[name] = {
            str(n): {"tok_s": rate, "over_1": rate / medians[levels[0]]}
            for n, rate in medians.items()
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,2,4,8", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=32, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context", type=int, default=40, help="the shortest row's prompt")
    parser.add_argument(
        "--engine-tokens", type=int, default=64, help="tokens per request (0: no engine part)"
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="time steps by the wall clock, or by this process's CPU time (a CPU device "
        "shared with other work)",
    )
    args = parser.parse_args()
    configure_cuda_graphs()  # as the CLI does, before any device work
    CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    batches = [int(b) for b in args.batches.split(",")]

    from mlxserve.engine.core.build import materialize
    from mlxserve.models import load

    model, _ = load("demo")
    materialize(model)
    adapter = PlainAdapter(model)
    result: dict[str, Any] = {
        "model": "demo",
        "steps": args.steps,
        "repeats": args.repeats,
        "context": args.context,
        "clock": args.clock,
        "device": benchmark_device(),
    }
    sizes: dict[str, Any] = {}
    for batch in batches:
        runners: dict[str, PerRow | Stacked] = {
            "per_row": PerRow(model, prefill(adapter, batch, args.context)),
            "stacked": Stacked(model, prefill(adapter, batch, args.context)),
        }
        first = mx.array([5 + row for row in range(batch)], dtype=mx.int32)
        tokens = {name: first for name in runners}
        counts = {}
        for name, runner in runners.items():
            logits = runner.step(tokens[name])  # builds the stacked state (and warms up)
            mx.eval(logits, runner.arrays())
            graphs = []
            for _ in range(COUNTED_STEPS):  # every phase of the compressors' windows
                logits = runner.step(tokens[name])
                graphs.append(count_primitives([logits, *runner.arrays()]))
                tokens[name] = mx.argmax(logits, axis=-1).astype(mx.int32)
                mx.eval(tokens[name], runner.arrays())
            counts[name] = {
                "primitives": statistics.mean(g["primitives"] for g in graphs),
                "kernels": statistics.mean(g["kernels"] for g in graphs),
                "kernels_max": max(g["kernels"] for g in graphs),
                "top": graphs[-1]["top"],
            }
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.repeats):
            for name, runner in runners.items():
                seconds, tokens[name] = run_steps(runner, tokens[name], args.steps)
                times[name].append(seconds)
        entry: dict[str, Any] = {}
        for name in runners:
            step_s = statistics.median(times[name])
            entry[name] = {"step_ms": 1000 * step_s, "tok_s": batch / step_s, **counts[name]}
            for mode in ("synced", "pipelined"):
                extra, tokens[name] = step_memory(
                    runners[name], tokens[name], args.steps, mode == "pipelined"
                )
                entry[name][f"step_peak_over_held_bytes_{mode}"] = extra
        entry["stacked_speedup"] = entry["per_row"]["step_ms"] / entry["stacked"]["step_ms"]
        entry["kernels_per_row_over_stacked"] = (
            entry["per_row"]["kernels"] / entry["stacked"]["kernels"]
        )
        sizes[str(batch)] = entry
    base = sizes[str(batches[0])]
    for entry in sizes.values():
        for name in ("per_row", "stacked"):
            entry[name]["tok_s_over_batch_" + str(batches[0])] = (
                entry[name]["tok_s"] / base[name]["tok_s"]
            )
    result["batches"] = sizes
    if args.engine_tokens > 0:
        result["engine"] = engine_scaling(
            model, batches, args.engine_tokens, args.context, args.repeats
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
