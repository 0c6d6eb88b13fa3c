"""What a plain decode step costs an automatic-depth request; prints one JSON document.

With ``speculative_depth = "auto"`` a request that decodes plainly should cost what a
depth-0 request costs. On the H200 (stop 21) it did not: on the two demo prompts where
auto mostly decoded plainly it ran 6-13 % below depth 0, and its observed plain step
was 1.67 calibrated ones. The two take different paths: a depth-0 request decodes in a
one-row ``RowBatch`` of ``PlainAdapter`` states (stacked caches, no MTP), an automatic
one in ``MTPAdapter.step`` on its own caches (with the rollback margin and the carried
streams). This measures, in this one process, interleaved over ``--repeats``:

- ``paths``: one request's pipelined plain step, ms (median), through each path:
  ``mtp_alone`` (``MTPAdapter.step``, margin 5), ``plain_alone`` (``PlainAdapter.step``),
  ``mtp_row_batch`` (a one-row ``MTPRowBatch``: stacked caches, MTP entries flushed
  every 16 steps) and ``plain_row_batch`` (a one-row ``RowBatch``: depth 0's path);
  with each step graph's primitives that launch a kernel (views left out);
- ``engine``: per demo prompt, decode tok/s of a depth-0 engine, an automatic one, and
  an automatic one whose depth picker always picks 0 (``auto_plain``: its plain stretch
  alone, no probes), with the ratios to depth 0 and the depths auto chose; and the
  automatic engine's step times (ms, its last repeat) by kind: plain steps, rounds
  that leave plain decoding (``probe``), other rounds, and the plain step after a
  round (``after_round``: the pipeline starts again);
- ``first_shape``: an MTP forward over a carry of n rows, the first time that n is
  seen and again (ms): what a round whose first draft folds a carry of a new length
  pays where shapes compile.

Run: python benchmarks/plain_paths.py [--steps 128] [--tokens 128] [--repeats 5]
[--prompts 5]
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Literal

import mlx.core as mx
from batch_step import count_primitives
from depths import PROMPTS, decode_rate, run_one
from step_hook import Around, Run, around_steps

from mlxserve.channel.request import GenerationParams
from mlxserve.engine.core.build import adapter_for, materialize
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.runner.batch import new_batch
from mlxserve.engine.spec.depth import DepthPicker, Pick
from mlxserve.engine.spec.mtp import MTPAdapter
from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device

#: the rollback margin an automatic request's caches keep (the deepest draft)
MARGIN = 5

Stepper = Callable[[mx.array], mx.array]


def stepper(model: Any, path: str, prompt: list[int]) -> Stepper:
    """A one-row plain step, [1] token -> [vocab] logits, lazily, on a prefilled state."""
    mtp = path.startswith("mtp")
    adapter = adapter_for(model, "auto" if mtp else 0)
    state = adapter.new_state(max_rollback=MARGIN if mtp else 0)
    adapter.prefill(state, prompt)
    if path.endswith("alone"):
        return lambda token: adapter.step(state, token)
    batch = new_batch(adapter, [state], [1 << 20], 1)
    assert batch is not None
    return lambda token: batch.step(token)[0]


def step_ms(step: Stepper, steps: int) -> float:
    """Pipelined like the engine: the next step is queued before this token is read
    (`pipelined.pipelined_steps`)."""
    from pipelined import pipelined_steps  # beside this file

    token = mx.array([7], dtype=mx.int32)
    mx.eval(step(token))  # compiles the shapes
    seconds, _ = pipelined_steps(
        lambda t: mx.argmax(step(t), axis=-1).astype(mx.int32).reshape(1), token, steps
    )
    return seconds * 1e3


def paths(model: Any, steps: int, repeats: int) -> dict[str, Any]:
    names = ("mtp_alone", "plain_alone", "mtp_row_batch", "plain_row_batch")
    prompt = [5 + (i * 37) % 200 for i in range(40)]
    times: dict[str, list[float]] = {name: [] for name in names}
    primitives: dict[str, int] = {}
    for name in names:
        step = stepper(model, name, prompt)
        primitives[name] = count_primitives([step(mx.array([7], dtype=mx.int32))])["kernels"]
    for _ in range(repeats):
        for name in names:  # a fresh state per repeat: every repeat at the same context
            times[name].append(step_ms(stepper(model, name, prompt), steps))
    return {
        name: {
            "step_ms": statistics.median(times[name]),
            "step_ms_per_repeat": times[name],
            "kernels": primitives[name],
        }
        for name in names
    }


def tracer(trace: list[tuple[int, float]]) -> Around:
    """What goes around every step (`step_hook.around_steps`) to record (drafts,
    seconds) of every decode or speculative step in `trace`."""

    def timed(run: Run, plan: Any, sequences: Any) -> Any:
        started = time.perf_counter()
        emitted = run(plan, sequences)
        if plan.kind != "prefill":
            trace.append(
                (plan.num_tokens if plan.kind == "speculate" else 0, time.perf_counter() - started)
            )
        return emitted

    return timed


def step_kinds(trace: list[tuple[int, float]]) -> dict[str, Any]:
    """Median ms per kind of step (and how many), from a `traced` run."""
    kinds: dict[str, list[float]] = {"plain": [], "probe": [], "round": [], "after_round": []}
    for index, (drafts, seconds) in enumerate(trace[1:], start=1):
        before = trace[index - 1][0]
        if drafts == 0:
            kind = "after_round" if before > 0 else "plain"
        else:
            kind = "probe" if before == 0 else "round"
        kinds[kind].append(seconds * 1e3)
    return {
        kind: {
            "count": len(times),
            "median_ms": statistics.median(times) if times else None,
            "max_ms": max(times) if times else None,
        }
        for kind, times in kinds.items()
    }


def first_shape(model: Any, lengths: list[int]) -> dict[str, Any]:
    """An MTP forward over a carry of n rows: ms the first time n is seen, and again."""
    adapter = MTPAdapter(model)
    out: dict[str, Any] = {}
    for rows in lengths:
        times = []
        for _ in range(2):
            state = adapter.new_state(max_rollback=MARGIN)
            adapter.prefill(state, [5 + i % 200 for i in range(rows + 8)])
            streams = model.forward_hidden(mx.array([[7] * rows]), state.cache)
            tokens = mx.array([[9] * rows])
            mx.eval(streams)
            started = time.perf_counter()
            logits, _ = model.mtp_forward(streams, tokens, state.mtp_cache[0], 0)
            mx.eval(logits)
            times.append((time.perf_counter() - started) * 1e3)
        out[str(rows)] = {"first_ms": times[0], "again_ms": times[1]}
    return out


def always_plain(picker: DepthPicker) -> None:
    """The depth picker picks depth 0 for every round: no probes, no explorations."""
    picker.pick = lambda *args, **kwargs: Pick(0, 0)  # type: ignore[method-assign]


def engines(model: Any, tokens: int, repeats: int, count: int) -> list[dict[str, Any]]:
    from mlxserve.commands.generate import encode_prompt
    from mlxserve.models import load

    _, tokenizer = load("demo")
    out = []
    for text in PROMPTS[:count]:
        ids = tuple(encode_prompt(tokenizer, text, chat=True))
        setups: tuple[tuple[str, int | Literal["auto"]], ...] = (
            ("0", 0),
            ("auto", "auto"),
            ("auto_plain", "auto"),
        )
        built = {
            name: Engine(
                adapter_for(model, depth),
                EngineConfig(speculative_depth=depth, prefix_cache_entries=0),
            )
            for name, depth in setups
        }
        for engine in built.values():  # calibrates the pickers; compiles the shapes
            run_one(engine, GenerationRequest("warm-up", GenerationParams(ids, tokens)))
        picker = built["auto_plain"].depth_picker
        assert picker is not None
        always_plain(picker)
        rates: dict[str, list[float]] = {name: [] for name in built}
        chosen: dict[str, Any] = {}
        trace: list[tuple[int, float]] = []
        for _ in range(repeats):
            for name, engine in built.items():
                if name == "auto":
                    trace = []
                hook = around_steps(engine, tracer(trace)) if name == "auto" else nullcontext()
                with hook:
                    rate, finish = decode_rate(engine, ids, tokens, 1)
                rates[name].append(rate)
                chosen[name] = (finish.speculative or {}).get("depths_chosen")
        ratios = {
            name: statistics.median(r / d for r, d in zip(rates[name], rates["0"], strict=True))
            for name in built
        }
        out.append(
            {
                "prompt": text,
                "tok_s": {name: statistics.median(r) for name, r in rates.items()},
                "over_depth0": ratios,
                "depths_chosen": chosen,
                "auto_steps": step_kinds(trace),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    args = parser.parse_args()
    if min(args.steps, args.tokens, args.repeats, args.prompts) < 1:
        parser.error("--steps, --tokens, --repeats and --prompts must be >= 1")
    if args.prompts > len(PROMPTS):
        parser.error(f"--prompts: there are {len(PROMPTS)}")
    configure_cuda_graphs()  # as the CLI does, before any device work

    from mlxserve.models import load

    model, _ = load("demo")
    materialize(model)
    result: dict[str, Any] = {
        "device": benchmark_device(),
        "steps": args.steps,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "paths": paths(model, args.steps, args.repeats),
        "engine": engines(model, args.tokens, args.repeats, args.prompts),
        "first_shape": first_shape(model, [3, 5, 9, 17, 33, 47]),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
