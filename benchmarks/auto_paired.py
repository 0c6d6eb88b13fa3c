"""Automatic depth against fixed depths, paired request by request; prints one JSON document.

`depths.py` compares depths by the median of a few repeats, each a whole reply per
depth. On the H200 single replies of one engine ranged 154-251 tok/s (stop 22), far
more than the 3 % the targets ask to resolve (`auto` >= 0.97 x depth 0 and >= 0.97 x
the best fixed depth). This pairs finely instead: each of ``--rounds`` rounds runs
one reply on every engine, in a shuffled order (seeded), so drift and a slow moment
hit the engines alike; the ratio ``auto`` / depth d is taken within each round.
Per prompt and depth it reports the median of those ratios and a bootstrap interval
of that median (``--confidence``), and a verdict against 0.97: ``met`` when the
interval lies above it, ``missed`` when below, ``unresolved`` when it straddles it.
The best fixed depth of a prompt is the one with the highest median rate. It is
chosen from the same rounds it is then compared in, so the noise that favoured it
counts against ``auto``: the verdict against it leans towards missed.

Every engine runs a warm-up reply first and then forgets it (`Engine.forget_warm_up`,
as ``mlxserve serve`` does). Each engine's last reply reports its acceptance per draft
position (``auto_last_reply``, ``fixed_last_reply``), and ``auto_depths_per_round``
lists the depths ``auto`` ran in each of its timed replies.

It also times Python's garbage collections during the timed replies (``gc.callbacks``):
a collection of the oldest generation walks every object the process holds, and a
pause of that kind lands on one reply and not its pair.

``--observations`` also records every step of ``auto``'s timed replies that its
depth picker times (`DepthPicker.observe`), per prompt in ``auto_observations``: the
plain ones grouped by how many plain steps came before them since the request last
drafted (``streak``) and by round, beside depth 0's time per token in the same
rounds, so plain steps whose times mislead the picker can be told apart. On an
H100 (stop 25, `auto_paired_h100_stop25.json`) the picker's windows of timed plain
steps held medians of 6-10 ms while depth 0 decoded at 3.7-4.1 ms a token. (This
was `plain_observations.py`, which timed depth 0 before and after ``auto`` rather
than in the same rounds.)

Run: python benchmarks/auto_paired.py [--tokens 128] [--rounds 12] [--prompts 5]
[--first-prompt 0] [--depths 0,1,2,3] [--confidence 0.9] [--seed 0] [--observations]
"""

import argparse
import contextlib
import gc
import json
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

from depths import PROMPTS, decode_rate, picker_costs, warmed_engines

from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device

TARGET = 0.97
BOOTSTRAP_SAMPLES = 2000
#: ``--observations``' streak buckets: (label, lowest streak, highest streak)
STREAKS = (
    ("1", 1, 1),
    ("2", 2, 2),
    ("3", 3, 3),
    ("4-7", 4, 7),
    ("8-31", 8, 31),
    ("32+", 32, 10**9),
)


def median_interval(
    values: list[float], confidence: float, rng: random.Random
) -> tuple[float, float]:
    """A bootstrap interval of the median of `values` (percentile method)."""
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(BOOTSTRAP_SAMPLES)
    )
    tail = (1 - confidence) / 2
    low = medians[int(tail * (BOOTSTRAP_SAMPLES - 1))]
    high = medians[int((1 - tail) * (BOOTSTRAP_SAMPLES - 1))]
    return low, high


def verdict(interval: tuple[float, float]) -> str:
    low, high = interval
    return "met" if low >= TARGET else "missed" if high < TARGET else "unresolved"


class CollectionTimer:
    """Counts Python's garbage collections per generation and their total time."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest_s = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        elif self.started is not None:
            spent = time.perf_counter() - self.started
            generation = info["generation"]
            self.counts[generation] += 1
            self.seconds[generation] += spent
            self.longest_s = max(self.longest_s, spent)
            self.started = None

    def report(self) -> dict[str, Any]:
        return {
            "count_per_generation": self.counts,
            "ms_per_generation": [s * 1e3 for s in self.seconds],
            "longest_ms": self.longest_s * 1e3,
        }


class Observations:
    """Every step of an engine's replies that its depth picker times, by round."""

    def __init__(self) -> None:
        self.round = 0
        self.records: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def recording(self, engine: Any) -> Iterator[None]:
        """Within the block, record each `picker.observe` with the speculative step
        that made it (the request's plain streak before the step, its length)."""
        picker, runner = engine.depth_picker, engine.runner
        observe, speculate = picker.observe, runner._speculate
        current: dict[str, tuple[int, float]] = {}

        def recording_observe(depth: int, seconds: float) -> None:
            current["observed"] = (depth, seconds)
            observe(depth, seconds)

        def recording_speculate(sequence: Any, depth: int) -> Any:
            current.clear()
            streak = sequence.plain_streak
            out = speculate(sequence, depth)
            if "observed" in current:
                kind, seconds = current["observed"]
                self.records.append(
                    {
                        "round": self.round,
                        "depth": kind,
                        "streak": streak,
                        "s": seconds,
                        "at": len(sequence.generated),
                    }
                )
            return out

        picker.observe, runner._speculate = recording_observe, recording_speculate
        try:
            yield
        finally:
            del picker.observe, runner._speculate

    def report(self, depth0_rates: list[float]) -> dict[str, Any]:
        plain = [r for r in self.records if r["depth"] == 0]
        return {
            "depth0_ms_per_token": [1e3 / rate for rate in depth0_rates],
            "timed_plain_by_streak": {
                label: summary([r["s"] for r in plain if low <= r["streak"] <= high])
                for label, low, high in STREAKS
            },
            "timed_plain_by_round": [
                summary([r["s"] for r in plain if r["round"] == i])
                for i in range(len(depth0_rates))
            ],
            "timed_rounds_by_depth": {
                str(k): summary([r["s"] for r in self.records if r["depth"] == k])
                for k in sorted({r["depth"] for r in self.records if r["depth"] > 0})
            },
            "plain_trace": [
                (r["round"], r["at"], r["streak"], round(r["s"] * 1e3, 2)) for r in plain
            ],
        }


def summary(seconds: list[float]) -> dict[str, Any]:
    if not seconds:
        return {"count": 0}
    ms = sorted(s * 1e3 for s in seconds)
    return {"count": len(ms), "median_ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1]}


def parse_depths(text: str) -> tuple[int, ...]:
    depths = tuple(int(part) for part in text.split(","))
    if 0 not in depths or any(not 0 <= d <= 5 for d in depths):
        raise ValueError("--depths must name depth 0 and depths in 0..5, e.g. 0,1,2,3")
    return depths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument(
        "--first-prompt", type=int, default=0, help="index of the first prompt (split a long run)"
    )
    parser.add_argument("--depths", default="0,1,2,3", help="fixed depths beside auto")
    parser.add_argument("--confidence", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--observations",
        action="store_true",
        help="record the steps auto's depth picker times (auto_observations)",
    )
    args = parser.parse_args()
    try:
        depths = parse_depths(args.depths)
    except ValueError as error:
        parser.error(str(error).replace("invalid literal for int() with base 10", "--depths"))
    if min(args.tokens, args.rounds) < 2 or not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--tokens and --rounds must be >= 2, --prompts in 1..{len(PROMPTS)}")
    if not 0 <= args.first_prompt <= len(PROMPTS) - args.prompts:
        parser.error(f"--first-prompt + --prompts must be at most {len(PROMPTS)}")
    if not 0 < args.confidence < 1:
        parser.error("--confidence must be between 0 and 1")
    configure_cuda_graphs()  # as the CLI does, before any device work

    from mlxserve.commands.generate import encode_prompt
    from mlxserve.engine.core.build import materialize
    from mlxserve.models import load

    model, tokenizer = load("demo")
    materialize(model)
    rng = random.Random(args.seed)
    timer = CollectionTimer()
    prompts: list[dict[str, Any]] = []
    for text in PROMPTS[args.first_prompt : args.first_prompt + args.prompts]:
        ids = tuple(encode_prompt(tokenizer, text, chat=True))
        engines = warmed_engines(model, ids, [*depths, "auto"], args.tokens)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        last_reply: dict[str, Any] = {}
        auto_depths: list[dict[str, int]] = []
        observations = Observations()
        gc.callbacks.append(timer)
        try:
            for index in range(args.rounds):
                observations.round = index
                order = list(engines)
                rng.shuffle(order)
                for name in order:
                    with contextlib.ExitStack() as stack:
                        if name == "auto" and args.observations:
                            stack.enter_context(observations.recording(engines[name]))
                        rate, finish = decode_rate(engines[name], ids, args.tokens, 1)
                    rates[name].append(rate)
                    last_reply[name] = finish.speculative
                    if name == "auto":
                        auto_depths.append(finish.speculative["depths_chosen"])
        finally:
            gc.callbacks.remove(timer)
        medians = {name: statistics.median(values) for name, values in rates.items()}
        best = max((str(d) for d in depths), key=lambda name: medians[name])
        against: dict[str, Any] = {}
        for name in [str(d) for d in depths]:
            ratios = [a / b for a, b in zip(rates["auto"], rates[name], strict=True)]
            interval = median_interval(ratios, args.confidence, rng)
            against[name] = {
                "median": statistics.median(ratios),
                "interval": interval,
                "verdict": verdict(interval),
            }
        prompts.append(
            {
                "prompt": text,
                "median_tok_s": medians,
                "best_fixed_depth": int(best),
                "auto_over": against,
                "auto_over_depth0": against["0"]["verdict"],
                "auto_over_best_fixed": against[best]["verdict"],
                "auto_last_reply": last_reply["auto"],
                "auto_depths_per_round": auto_depths,
                "fixed_last_reply": {str(d): last_reply[str(d)] for d in depths if d},
                "auto_costs_in_plain_steps": picker_costs(engines["auto"]),
            }
        )
        if args.observations:
            prompts[-1]["auto_observations"] = observations.report(rates["0"])
    result = {
        "device": benchmark_device(),
        "tokens": args.tokens,
        "rounds": args.rounds,
        "confidence": args.confidence,
        "seed": args.seed,
        "first_prompt": args.first_prompt,
        "target": TARGET,
        "prompts": prompts,
        "gc_during_timed_replies": timer.report(),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
