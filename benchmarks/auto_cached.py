"""`generate --speculative-depth auto` with its calibration kept: prints one JSON document.

What one `mlxserve generate` run costs, in one process on the demo model: a fresh
engine (as `generate` builds it, with the state directory's round costs) runs one
short prompt, at depth 0, at "auto" on an empty state directory (it measures the
round costs and keeps them) and at "auto" again (it reads them). Each repeat uses a
new state directory, the three runs interleaved, so drift hits them alike; the
model is loaded once (its load is the same for every run). Timed like
`generate --json`'s `timing.seconds` (submit to the last token), by the wall clock
and by this process's CPU time; `engine_build_s` is the engine's construction (the
model fingerprint of the store's key included). Target: auto cached / depth 0 <= 1.

Run: python benchmarks/auto_cached.py [--tokens 25] [--repeats 5]
"""

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from mlxserve.channel.request import GenerationParams
from mlxserve.config import Settings, load_settings
from mlxserve.engine.core.build import (
    LoadedModel,
    adapter_for,
    costs_place,
    engine_config,
    load_for_serving,
)
from mlxserve.engine.core.drive import run_to_completion
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.stepper import Engine
from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device
from mlxserve.policy.plan import Plan

PROMPT = "hello there"


def one_run(
    settings: Settings,
    plan: Plan,
    base: LoadedModel,
    depth: int | str,
    prompt: tuple[int, ...],
    n: int,
) -> dict[str, Any]:
    """A fresh engine at ``depth`` (as `build_engine` makes it) and one request."""
    began = time.perf_counter()
    loaded = dataclasses.replace(
        base,
        adapter=adapter_for(base.model, depth),  # type: ignore[arg-type]
        speculative_depth=depth,  # type: ignore[arg-type]
    )
    config = dataclasses.replace(
        engine_config(settings, plan, loaded),
        round_costs=costs_place(settings, plan, loaded, 0, 1),
    )
    engine = Engine(loaded.adapter, config)
    built = time.perf_counter() - began
    stop = tuple(sorted(base.tokenizer.eos_token_ids))
    request = GenerationRequest(f"d{depth}", GenerationParams(prompt, n, stop_token_ids=stop))
    done = run_to_completion(engine, request)
    return {
        "seconds": done.total_s,
        "cpu_seconds": done.cpu_total_s,
        "ttft_s": done.ttft_s,
        "engine_build_s": built,
        "tokens": len(done.tokens),
        "calibrations": engine.calibrations,
        "speculative": done.finish.speculative,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    configure_cuda_graphs()  # as the CLI does, before any device work

    from mlxserve.commands.generate import encode_prompt
    from mlxserve.startup.plan import build_plan

    with tempfile.TemporaryDirectory() as root:
        settings = load_settings(None, {"model": "demo"})
        settings = settings.model_copy(
            update={"server": settings.server.model_copy(update={"state_dir": Path(root) / "w"})}
        )
        plan, membership = build_plan(settings)
        base = load_for_serving(settings, plan, membership.rank)
        prompt = tuple(encode_prompt(base.tokenizer, PROMPT, chat=True))
        # Untimed: every path once (first uses allocate and page in).
        for depth in (0, "auto"):
            one_run(settings, plan, base, depth, prompt, args.tokens)
        runs: dict[str, list[dict[str, Any]]] = {"depth0": [], "auto_first": [], "auto_cached": []}
        for repeat in range(args.repeats):
            where = Path(root) / f"r{repeat}"
            settings = settings.model_copy(
                update={"server": settings.server.model_copy(update={"state_dir": where})}
            )
            runs["depth0"].append(one_run(settings, plan, base, 0, prompt, args.tokens))
            runs["auto_first"].append(one_run(settings, plan, base, "auto", prompt, args.tokens))
            runs["auto_cached"].append(one_run(settings, plan, base, "auto", prompt, args.tokens))

    def median(name: str, field: str) -> float:
        return float(statistics.median(run[field] for run in runs[name]))

    def ratios(name: str, field: str) -> list[float]:
        return [a[field] / b[field] for a, b in zip(runs[name], runs["depth0"], strict=True)]

    result: dict[str, Any] = {
        "model": "demo",
        "prompt": PROMPT,
        "prompt_tokens": len(prompt),
        "tokens": args.tokens,
        "repeats": args.repeats,
        "device": benchmark_device(),
        "median": {
            name: {
                field: median(name, field)
                for field in ("seconds", "cpu_seconds", "ttft_s", "engine_build_s")
            }
            for name in runs
        },
        "calibrations": {name: [run["calibrations"] for run in runs[name]] for name in runs},
        "over_depth0": {
            name: {
                "wall_median": statistics.median(ratios(name, "seconds")),
                "cpu_median": statistics.median(ratios(name, "cpu_seconds")),
                "wall_per_repeat": [round(r, 3) for r in ratios(name, "seconds")],
            }
            for name in ("auto_first", "auto_cached")
        },
        "runs": runs,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
