"""What the prefix cache holds against what it counts, on the demo; one JSON.

Eight chat requests decode together through the engine (the demo model, MTP at the
automatic depth, the prefix cache on), once to warm up and once measured: MLX's
peak over the weights plus the eight requests' caches (the prefix cache's counted
bytes left out, as memory of its own), and, idle afterwards, the MLX memory the
prefix cache's entries hold beside the bytes they count. An evaluated slice shares
its source's whole buffer, so a state kept as slices of a larger tensor (a stacked
batch, a step's concatenation) holds more than it counts.

Run: python benchmarks/prefix_memory.py [--tokens 64]
"""

import argparse
import gc
import json

import mlx.core as mx

from mlxserve.engine.core.drive import run_until_finished
from mlxserve.engine.core.engine import Engine, EngineConfig
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.spec.mtp import MTPAdapter
from mlxserve.hardware.probe import benchmark_device
from mlxserve.models.demo import load_demo

WORDS = ("for", "while", "with", "try", "class", "def", "import", "return")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    model, tokenizer = load_demo()
    engine = Engine(MTPAdapter(model), EngineConfig(speculative_depth="auto"))
    assert engine.prefix_cache is not None
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Explain Python's {word} statement, with an example."}],
            add_generation_prompt=True,
        )
        for word in WORDS
    ]

    def run(tag: str) -> list[dict[str, int]]:
        requests = [
            GenerationRequest(f"{tag}{i}", tuple(p), args.tokens) for i, p in enumerate(prompts)
        ]
        return [event.memory for event in run_until_finished(engine, requests).values()]

    run("warm")
    engine.prefix_cache.clear()
    gc.collect()
    idle = mx.get_active_memory()
    mx.reset_peak_memory()
    memory = run("measured")
    weights = memory[0]["weights_bytes"]
    caches = sum(m["cache_bytes"] for m in memory)
    peak = max(m["busy_peak_bytes"] for m in memory)
    counted = engine.prefix_cache.nbytes
    gc.collect()
    held = mx.get_active_memory() - idle
    print(
        json.dumps(
            {
                "benchmark": "prefix_memory",
                "device": benchmark_device(),
                "requests": len(prompts),
                "tokens": args.tokens,
                "weights_bytes": weights,
                "caches_bytes": caches,
                "peak_bytes": peak,
                "peak_ratio": round((peak - counted) / (weights + caches), 3),
                "prefix_cache_entries": len(engine.prefix_cache),
                "prefix_cache_counted_bytes": counted,
                "prefix_cache_held_bytes": held,
                "held_over_counted": round(held / counted, 3) if counted else None,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
