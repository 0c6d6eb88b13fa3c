"""The engine's speculative depths on the built-in demo model; prints one JSON document.

- per prompt: decode tok/s with MTP depth 0..5 and "auto" (greedy), the speedup
  over depth 0, acceptance per depth, the depths auto chose, and auto's ratio to
  the best fixed depth and to depth 0 (targets >= 0.97); medians over prompts,
- TTFT of a long prompt cold vs prefix-reused,
- our decode tok/s at depth 0 over `mlx_lm.generate`'s on the same model
  (target >= 0.95). Every figure is a ratio measured in this one run.

Run: python benchmarks/depths.py [--tokens 128] [--repeats 3] [--prompts 5]
(on Linux, LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 speeds it up)
"""

import argparse
import json
import statistics
from typing import Any

from mlxserve.channel.request import GenerationParams
from mlxserve.engine.core.drive import run_to_completion
from mlxserve.engine.core.request import FinishEvent, GenerationRequest
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device

PROMPTS = (
    "Explain how the assert statement works and when it is removed.",
    "What does the with statement do, and how does a context manager work?",
    "Describe list comprehensions and generator expressions.",
    "How are exceptions raised and handled in Python?",
    "What is the difference between a module and a package?",
)
PROMPT = PROMPTS[0]
DEPTHS: tuple[int | str, ...] = (0, 1, 2, 3, 4, 5, "auto")


def run_one(
    engine: Engine, request: GenerationRequest
) -> tuple[list[int], FinishEvent, float, float]:
    done = run_to_completion(engine, request)
    return done.tokens, done.finish, done.ttft_s, done.total_s


#: "wall" or "cpu" (this process's CPU time: steadier on a CPU shared with other work)
CLOCK = ["wall"]


def decode_rate(engine: Engine, prompt: tuple[int, ...], n: int, repeats: int) -> tuple[float, Any]:
    rates = []
    finish = None
    for i in range(repeats):
        done = run_to_completion(engine, GenerationRequest(f"d{i}", GenerationParams(prompt, n)))
        finish = done.finish
        if CLOCK[0] == "cpu":
            seconds = done.cpu_total_s - done.cpu_ttft_s
        else:
            seconds = done.total_s - done.ttft_s
        rates.append((len(done.tokens) - 1) / seconds)
    return statistics.median(rates), finish


def picker_costs(engine: Engine) -> dict[str, Any] | None:
    """What the automatic depth weighed, in the calibration's plain steps: its round
    per depth, the median of the rounds it observed (where it follows them), and the
    engine's time between steps that it adds to each. ``observed_window``: each
    depth's timed rounds, oldest first (a median counts from MIN_OBSERVED of them)."""
    picker = engine.depth_picker
    if picker is None:
        return None
    plain = picker.calibrated.plain
    return {
        "calibrated_plain_ms": plain * 1e3,
        "calibrated": {
            k: picker.calibrated.round(k) / plain for k in range(1, picker.max_depth + 1)
        },
        "observed": {k: t / plain for k, t in sorted(picker.observed.items())},
        "observed_window": {
            k: [round(t / plain, 3) for t in window] for k, window in sorted(picker.samples.items())
        },
        "between_steps": picker.overhead() / plain,
        "follow_observed": picker.follow_observed,
    }


def warmed_engines(
    model: Any, prompt: tuple[int, ...], depths: list[int | str], tokens: int
) -> dict[str, Engine]:
    """One engine per depth (no prefix cache), each having run one untimed reply of
    `prompt` (kernels compile on a shape's first use) and then forgotten it, as
    ``mlxserve serve`` forgets its warm-up."""
    from mlxserve.engine.core.build import adapter_for

    engines = {
        str(depth): Engine(
            adapter_for(model, depth),  # type: ignore[arg-type]
            EngineConfig(speculative_depth=depth, prefix_cache_entries=0),  # type: ignore[arg-type]
        )
        for depth in depths
    }
    for engine in engines.values():
        run_one(engine, GenerationRequest("warm-up", GenerationParams(prompt, tokens)))
        engine.forget_warm_up()
    return engines


def mlx_lm_rate(model: Any, tokenizer: Any, prompt: list[int], n: int, repeats: int) -> float:
    from mlx_lm.generate import stream_generate

    rates = []
    for _ in range(repeats):
        last = None
        for response in stream_generate(model, tokenizer, prompt, max_tokens=n):
            last = response
        assert last is not None
        rates.append(last.generation_tps)
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many prompts")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="time decoding by the wall clock, or by this process's CPU time (a CPU "
        "device shared with other work)",
    )
    args = parser.parse_args()
    configure_cuda_graphs()  # as the CLI does, before any device work
    CLOCK[0] = args.clock

    from mlxserve.commands.generate import encode_prompt
    from mlxserve.engine.core.build import adapter_for, materialize
    from mlxserve.models import load

    model, tokenizer = load("demo")
    materialize(model)
    prompt = tuple(encode_prompt(tokenizer, PROMPT, chat=True))
    result: dict[str, Any] = {
        "model": "demo",
        "tokens": args.tokens,
        "repeats": args.repeats,
        "clock": args.clock,
        "device": benchmark_device(),
    }

    prompts: list[dict[str, Any]] = []
    for text in PROMPTS[: args.prompts]:
        ids = tuple(encode_prompt(tokenizer, text, chat=True))
        engines = warmed_engines(model, ids, list(DEPTHS), args.tokens)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        ratios: dict[str, list[float]] = {name: [] for name in engines}
        finishes: dict[str, Any] = {}
        for _ in range(args.repeats):  # depths interleaved: drift hits them alike
            for name, engine in engines.items():
                rate, finishes[name] = decode_rate(engine, ids, args.tokens, 1)
                rates[name].append(rate)
            for name in engines:
                ratios[name].append(rates[name][-1] / rates["0"][-1])
        depths: dict[str, Any] = {
            name: {
                "decode_tok_s": statistics.median(rates[name]),
                "decode_tok_s_per_repeat": rates[name],
                "speculative": finishes[name].speculative,
                "speedup_vs_depth0": statistics.median(ratios[name]),
            }
            for name in engines
        }
        depths["auto"]["costs_in_plain_steps"] = picker_costs(engines["auto"])
        fixed = [depths[str(d)]["speedup_vs_depth0"] for d in DEPTHS if d != "auto"]
        auto = depths["auto"]["speedup_vs_depth0"]
        prompts.append(
            {
                "prompt": text,
                "prompt_tokens": len(ids),
                "depths": depths,
                "auto_over_best_fixed": auto / max(fixed),
                "auto_over_depth0": auto,
            }
        )
    result["prompts"] = prompts
    result["median_speedup_vs_depth0"] = {
        str(d): statistics.median(p["depths"][str(d)]["speedup_vs_depth0"] for p in prompts)
        for d in DEPTHS
    }
    result["worst_auto_over_best_fixed"] = min(p["auto_over_best_fixed"] for p in prompts)
    result["worst_auto_over_depth0"] = min(p["auto_over_depth0"] for p in prompts)
    depths = prompts[0]["depths"]

    long_prompt = tuple(encode_prompt(tokenizer, PROMPT * 40, chat=True))
    engine = Engine(adapter_for(model, 0), EngineConfig(speculative_depth=0))
    _, _, cold, _ = run_one(engine, GenerationRequest("cold", GenerationParams(long_prompt, 1)))
    _, finish, warm, _ = run_one(
        engine, GenerationRequest("warm", GenerationParams(long_prompt, 1))
    )
    result["ttft"] = {
        "prompt_tokens": len(long_prompt),
        "cold_s": cold,
        "prefix_reused_s": warm,
        "cached_tokens": finish.usage.cached_tokens,
        "reused_over_cold": warm / cold,
    }

    ours = depths["0"]["decode_tok_s"]
    theirs = mlx_lm_rate(model, tokenizer, list(prompt), args.tokens, args.repeats)
    result["vs_mlx_lm_generate"] = {
        "ours_depth0_tok_s": ours,
        "mlx_lm_tok_s": theirs,
        # mlx_lm reports a wall-clock rate: no ratio against CPU time.
        "ratio": ours / theirs if args.clock == "wall" else None,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
