"""Which of the automatic depth's timed plain steps agree with depth 0's pace; prints JSON.

On an H100 (stop 25, `auto_paired_h100_stop25.json`) the automatic engine's windows
of timed plain steps held 2.9-30 ms, medians 6-10 ms, while a depth-0 engine on the
same prompt decoded at 3.7-4.1 ms a token, all its overhead included. The chooser
then priced plain decoding at 2-3 times its cost and drafted where depth 0 was best.
This records every step of the automatic engine's replies that the chooser times
(`DepthChooser.observe`) and groups the plain ones by how many plain steps came
before them since the request last drafted (``streak``) and by the reply they fell
in, beside depth 0's time per token, so the steps whose times mislead can be told
apart.

Run: python benchmarks/plain_observations.py [--tokens 128] [--replies 6] [--prompts 2]
"""

import argparse
import json
import statistics
from typing import Any

from engine import PROMPTS, chooser_costs, decode_rate, warmed_engines

from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device

#: streak buckets: (label, lowest streak, highest streak)
BUCKETS = (
    ("1", 1, 1),
    ("2", 2, 2),
    ("3", 3, 3),
    ("4-7", 4, 7),
    ("8-31", 8, 31),
    ("32+", 32, 10**9),
)


def summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"count": 0}
    ms = sorted(v * 1e3 for v in values)
    return {
        "count": len(ms),
        "median_ms": statistics.median(ms),
        "min_ms": ms[0],
        "max_ms": ms[-1],
    }


def traced_replies(engine: Any, ids: tuple[int, ...], tokens: int, replies: int) -> dict[str, Any]:
    """Run `replies` replies, recording every observation the chooser receives."""
    chooser = engine.chooser
    runner = engine.runner
    observe = chooser.observe
    speculate = runner._speculate
    records: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    reply = [0]

    def recording_observe(depth: int, seconds: float) -> None:
        current["observed"] = (depth, seconds)
        observe(depth, seconds)

    def recording_speculate(sequence: Any, depth: int) -> Any:
        current.clear()
        streak = sequence.plain_streak
        out = speculate(sequence, depth)
        if "observed" in current:
            kind, seconds = current["observed"]
            records.append(
                {
                    "reply": reply[0],
                    "depth": kind,
                    "streak": streak,
                    "s": seconds,
                    "at": len(sequence.generated),
                }
            )
        return out

    chooser.observe = recording_observe
    runner._speculate = recording_speculate
    rates, depths = [], []
    try:
        for index in range(replies):
            reply[0] = index
            rate, finish = decode_rate(engine, ids, tokens, 1)
            rates.append(rate)
            depths.append(finish.speculative["depths_chosen"])
    finally:
        del chooser.observe, runner._speculate
    plain = [r for r in records if r["depth"] == 0]
    return {
        "ms_per_token": [1e3 / r for r in rates],
        "depths_per_reply": depths,
        "timed_plain_by_streak": {
            label: summary([r["s"] for r in plain if low <= r["streak"] <= high])
            for label, low, high in BUCKETS
        },
        "timed_plain_by_reply": [
            summary([r["s"] for r in plain if r["reply"] == i]) for i in range(replies)
        ],
        "timed_rounds_by_depth": {
            str(k): summary([r["s"] for r in records if r["depth"] == k])
            for k in sorted({r["depth"] for r in records if r["depth"] > 0})
        },
        "plain_trace": [(r["reply"], r["at"], r["streak"], round(r["s"] * 1e3, 2)) for r in plain],
        "chooser": chooser_costs(engine),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--replies", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=2)
    args = parser.parse_args()
    if min(args.tokens, args.replies) < 2 or not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--tokens and --replies must be >= 2, --prompts in 1..{len(PROMPTS)}")
    configure_cuda_graphs()

    from mlxserve.commands.generate import encode_prompt
    from mlxserve.engine.core.build import materialize
    from mlxserve.models import load

    model, tokenizer = load("demo")
    materialize(model)
    prompts = []
    for text in PROMPTS[: args.prompts]:
        ids = tuple(encode_prompt(tokenizer, text, chat=True))
        engines = warmed_engines(model, ids, [0, "auto"], args.tokens)
        depth0 = [1e3 / decode_rate(engines["0"], ids, args.tokens, 1)[0] for _ in range(3)]
        auto = traced_replies(engines["auto"], ids, args.tokens, args.replies)
        depth0 += [1e3 / decode_rate(engines["0"], ids, args.tokens, 1)[0] for _ in range(3)]
        prompts.append({"prompt": text, "depth0_ms_per_token": depth0, "auto": auto})
    result = {
        "device": benchmark_device(),
        "tokens": args.tokens,
        "replies": args.replies,
        "prompts": prompts,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
