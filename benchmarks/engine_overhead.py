"""The engine's own cost per token at depth 0 against bare decode loops; prints one JSON document.

Why: on the small DeepSeek-V4-Flash-shaped model of `vs_mlx_vlm.py` (stop 30) the engine
decoded one greedy request at depth 0 at 39.7 tok/s, the same model in a bare queued-ahead
loop over a one-row `RowBatch` at 42.0 and over one sequence's caches at 45.4 (medians of
two runs each), as if the engine spent 1.5-3 ms of a ~23 ms token of its own. This
measures that gap alone, quickly, in one process, interleaved over ``--rounds`` rounds
(one run of each per round, medians). (A lone plain request does not decode in a batch
of one: `Runner._alone` steps it on its own caches, the ``one_sequence`` loop's path.)

- ``engine``: one request through an `Engine` at depth 0, prefix cache off (as
  `vs_mlx_vlm.mlxserve_runners` builds it), timed as `vs_mlx_vlm.mlxserve_run` times it
  (``decode_tok_s``: tokens after the first over the time after the first, the finish
  included) and from its second token to its last but one (``steady_tok_s``: the
  pipeline full, as the bare loops are timed);
- ``batch_of_one`` and ``one_sequence``: `vs_mlx_vlm.loop_runners`' bare loops
  (``mlxserve_decode_batch_of_one``, ``mlxserve_one_sequence``);

with each one's ms per token, the engine's excess over each loop and the median of the
per-round ratios (``paired_engine_over``: the figure to read, single runs vary by 10 %
here), whether the greedy tokens agree, and the load average before and after.
``null_model``: the engine's own host cost, apart from any model's: the engine on
`NullAdapter` (a "forward" of one tiny op) against the same bare loop, µs per token over
a long request (``--null-tokens``).
``--profile N`` then runs the engine N more times on the real model under cProfile: own
time per token by area (the model's graph building, the engine, MLX's blocking calls
apart as `engine_profile.py` shows them) and the top functions.

Run: python benchmarks/engine_overhead.py [--rounds 8] [--tokens 24] [--profile 3]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_profile import visible_waits
from vs_mlx_vlm import (
    add_model_arguments,
    flash_config,
    flash_model,
    load_mlxserve,
    loop_runners,
    write,
)

from mlxserve.channel.request import GenerationParams
from mlxserve.engine.core.drive import run_to_completion
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.runner.adapter import PlainAdapter
from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device
from mlxserve.hardware.tuning import EngineTuning, default_tuning


def depth0_engine(model: Any) -> Engine:
    """The engine `vs_mlx_vlm.mlxserve_runners` times at depth 0."""
    return Engine(PlainAdapter(model), EngineConfig(speculative_depth=0, prefix_cache_entries=0))


def engine_run(engine: Engine, prompt: list[int], tokens: int, name: str) -> dict[str, Any]:
    """One greedy request: `vs_mlx_vlm.mlxserve_run`'s rate and the steady rate (second
    token to the last but one, each token's arrival stamped as the drive loop hands it
    on)."""
    stamps: list[float] = []

    def seen(batch: tuple[int, ...]) -> bool:
        stamps.extend(time.perf_counter() for _ in batch)
        return False

    request = GenerationRequest(name, GenerationParams(tuple(prompt), tokens))
    done = run_to_completion(engine, request, seen)
    # Token k (k >= 2) arrives once the forward after it is computed (the next step is
    # queued before a token is read), so token 2 waits for two forwards and the last
    # for none: from the second to the last but one, one forward per token.
    steady = (len(stamps) - 3) / (stamps[-2] - stamps[1]) if len(stamps) > 3 else 0.0
    return {
        "decode_tok_s": (len(done.tokens) - 1) / (done.total_s - done.ttft_s),
        "steady_tok_s": steady,
        "tokens": list(done.tokens),
    }


#: Where a profiled function's own time goes: the first of these its file path contains.
AREAS = (
    ("mlx_waits", "engine_profile.py"),  # `visible_waits`' wrapper of MLX's blocking calls
    ("engine", "mlxserve/engine/"),
    ("model", "mlxserve/models/"),
    ("model", "mlxserve/kernels/"),
    ("model", "mlx_lm/"),
    ("model", "mlx/nn/"),
)


def profile_engine(engine: Engine, prompt: list[int], tokens: int, runs: int) -> dict[str, Any]:
    """``runs`` engine runs under cProfile, in ms per emitted token (cProfile's own cost
    included): the wall, own time by area (`AREAS`; MLX's blocking calls apart, as
    `engine_profile.py` shows them; ``other``: the standard library, builtins, this
    script), and the top functions by own time, overall and the engine's."""
    profiler = cProfile.Profile()
    emitted = 0
    began = time.perf_counter()
    with visible_waits():
        profiler.enable()
        for index in range(runs):
            emitted += len(engine_run(engine, prompt, tokens, f"profile{index}")["tokens"])
        profiler.disable()
    wall = time.perf_counter() - began
    table: dict[tuple[str, int, str], tuple[Any, ...]] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    per = 1e3 / emitted
    areas: dict[str, float] = {}
    own: list[tuple[float, str, int, str]] = []
    for (filename, line, name), (_, calls, tottime, _, _) in table.items():
        area = next((a for a, part in AREAS if part in filename), "other")
        areas[area] = areas.get(area, 0.0) + tottime * per
        where = f"{filename.split('/site-packages/')[-1].split('/work/main/')[-1]}:{line}({name})"
        own.append((tottime * per, where, calls, area))
    own.sort(reverse=True)

    def rows(picked: list[tuple[float, str, int, str]]) -> list[dict[str, Any]]:
        return [
            {"function": w, "ms_per_token": round(t, 4), "calls_per_token": round(c / emitted, 2)}
            for t, w, c, _ in picked
        ]

    return {
        "runs": runs,
        "tokens": emitted,
        "wall_ms_per_token": round(wall * per, 3),
        "own_ms_per_token_by_area": {k: round(v, 3) for k, v in sorted(areas.items())},
        "top_own_time": rows(own[:15]),
        "top_own_time_engine": rows([o for o in own if o[3] == "engine"][:15]),
    }


class _NullState:
    """A state with nothing in it (`NullAdapter`)."""

    offset = 0


class NullAdapter:
    """A model that costs nothing: ``step`` is one small op on its input token. The
    engine on it against `null_loop` is the engine's own host cost per token."""

    max_draft_depth = 0

    def __init__(self, vocab: int = 64) -> None:
        self.tuning = default_tuning()
        self.weights = mx.arange(vocab, dtype=mx.float32)

    def tune(self, tuning: EngineTuning) -> None:
        self.tuning = tuning

    def new_state(self, max_rollback: int) -> _NullState:
        return _NullState()

    def prefill(self, state: Any, tokens: list[int]) -> None:
        return None

    def step(self, state: Any, tokens: mx.array) -> mx.array:
        return self.weights * tokens[-1].astype(mx.float32)

    def snapshot(self, state: Any) -> _NullState:
        return _NullState()

    def compact(self, state: Any) -> None:
        return None

    def nbytes(self, state: Any) -> int:
        return 0


def null_loop(adapter: NullAdapter, tokens: int) -> float:
    """Seconds per token of `NullAdapter`'s step in the bare queued-ahead loop
    (`pipelined.pipelined_steps`, as `vs_mlx_vlm.hand_loop` runs the models)."""
    from pipelined import pipelined_steps  # beside this file

    state = adapter.new_state(0)
    first = mx.argmax(adapter.weights)
    seconds, _ = pipelined_steps(
        lambda y: mx.argmax(adapter.step(state, y.reshape(1))), first, tokens - 1
    )
    return seconds


def null_model(tokens: int, rounds: int) -> dict[str, Any]:
    """The engine's own host cost: µs per token of a depth-0 engine on `NullAdapter`
    (a request of ``tokens`` tokens, timed as `engine_run` times it) against
    `null_loop`, interleaved over ``rounds`` rounds, medians."""
    adapter = NullAdapter()
    engine = Engine(adapter, EngineConfig(speculative_depth=0, prefix_cache_entries=0))
    prompt = [5, 6, 7]
    engine_run(engine, prompt, tokens, "warm-up")
    null_loop(adapter, tokens)
    engine_s: list[float] = []
    loop_s: list[float] = []
    for index in range(rounds):
        engine_s.append(1 / engine_run(engine, prompt, tokens, f"null{index}")["decode_tok_s"])
        loop_s.append(null_loop(adapter, tokens))
    engine_us, loop_us = statistics.median(engine_s) * 1e6, statistics.median(loop_s) * 1e6
    return {
        "tokens": tokens,
        "rounds": rounds,
        "engine_us_per_token": engine_us,
        "bare_loop_us_per_token": loop_us,
        "engine_excess_us_per_token": engine_us - loop_us,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The whole measurement (see the module docstring), as a dict."""
    started = time.perf_counter()
    load_before = os.getloadavg()
    prompt = [random.Random(1).randrange(2, args.vocab) for _ in range(args.prompt)]
    config = flash_config(args.layers, args.hidden, args.experts, args.vocab)
    with tempfile.TemporaryDirectory() as folder:
        model = load_mlxserve(write(flash_model(config), Path(folder) / "flash"))
    engine = depth0_engine(model)
    # Only mlxserve's loops: mlx-vlm's model is not built (its runners are left unused).
    loops = loop_runners(model, types.SimpleNamespace(language_model=None), prompt, args.tokens)
    runners = {
        "engine": lambda name: engine_run(engine, prompt, args.tokens, name),
        "batch_of_one": loops["mlxserve_decode_batch_of_one"],
        "one_sequence": loops["mlxserve_one_sequence"],
    }
    for run in runners.values():
        run("warm-up")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    for index in range(args.rounds):
        for name, run in runners.items():
            runs[name].append(run(f"r{index}"))
        rates = {n: round(r[-1]["decode_tok_s"], 2) for n, r in runs.items()}
        print(json.dumps({"round": index, "decode_tok_s": rates}), file=sys.stderr, flush=True)
    rate = {n: statistics.median(r["decode_tok_s"] for r in rs) for n, rs in runs.items()}
    steady = statistics.median(r["steady_tok_s"] for r in runs["engine"])
    ms = {n: 1e3 / v for n, v in rate.items()}
    result: dict[str, Any] = {
        "benchmark": "engine_overhead",
        "device": benchmark_device(),
        "model": {"layers": args.layers, "hidden": args.hidden, "experts": args.experts},
        "vocab": args.vocab,
        "prompt_tokens": args.prompt,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "decode_tok_s": {**rate, "engine_steady": steady},
        "ms_per_token": {**ms, "engine_steady": 1e3 / steady},
        "engine_excess_ms_per_token": {
            "over_batch_of_one": ms["engine"] - ms["batch_of_one"],
            "over_one_sequence": ms["engine"] - ms["one_sequence"],
            "steady_over_one_sequence": 1e3 / steady - ms["one_sequence"],
        },
        "engine_over_one_sequence": rate["engine"] / rate["one_sequence"],
        # Per round, the engine's rate over the loop's run just after it: the machine's
        # drift between rounds (the CPU is shared) cancels out of these.
        "paired_engine_over": {
            loop: statistics.median(
                e["decode_tok_s"] / o["decode_tok_s"]
                for e, o in zip(runs["engine"], runs[loop], strict=True)
            )
            for loop in ("batch_of_one", "one_sequence")
        },
        "greedy_tokens_agree": {
            n: runs[n][-1]["tokens"] == runs["engine"][-1]["tokens"]
            for n in ("batch_of_one", "one_sequence")
        },
        "load_average_before": load_before,
        "null_model": null_model(args.null_tokens, args.rounds),
    }
    if args.profile:
        result["profile"] = profile_engine(engine, prompt, args.tokens, args.profile)
    result["load_average_after"] = os.getloadavg()
    result["wall_s"] = time.perf_counter() - started
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--profile", type=int, default=0, help="engine runs under cProfile")
    parser.add_argument(
        "--null-tokens", type=int, default=2000, help="tokens of a request on the null model"
    )
    args = parser.parse_args()
    configure_cuda_graphs()  # as the CLI does, before any device work
    if args.rounds < 1 or args.tokens < 4 or args.null_tokens < 4:
        parser.error("--rounds must be >= 1, --tokens and --null-tokens >= 4")
    print(json.dumps(measure(args), indent=1))


if __name__ == "__main__":
    main()
