"""Time to first token of the first requests after the server's warm-up, and what each
compiled; one JSON.

On the GPU the first GuideLLM request to mlxserve took 236 ms to its first token and
later ones about 10 ms (docs/compatibility.md, stop 31), although the engine warms up
before it says hello (`mlxserve.engine.process.warmup`). This builds the engine as
`mlxserve serve` does, on a generic model (`serve.GENERIC`, random weights), runs the
server's warm-up, then sends requests one at a time (sampled, as an API request with
no temperature is) with prompts of ``--lengths`` tokens, and gives each one's time to
first token. Where ``MLX_PTX_CACHE_DIR`` is set (MLX's CUDA backend keeps the kernels
it compiles there, one file each), it also names the kernels each request compiled:
the files that appeared in that folder during it. A length first seen after the
warm-up that is slower than its repeat points at what the warm-up leaves out.

Run: MLX_PTX_CACHE_DIR=/tmp/ptx python benchmarks/first_request.py
         [--generic tiny-llama] [--lengths 8,64,64,200,200,1000,1000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from serve import GENERIC, build_generic
from servers import free_port, mlxserve

from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.config import load_settings
from mlxserve.engine.core.build import build_engine
from mlxserve.engine.core.drive import run_to_completion
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.process.warmup import warm_up
from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device

#: The server's warm-up prompt (`mlxserve.engine.process.loop._warm_up`).
WARM_UP_TEXT = "Warm up: say hello."


def kernel_files() -> set[str]:
    """The names of the kernels MLX has compiled into its PTX cache, if one is set."""
    folder = os.environ.get("MLX_PTX_CACHE_DIR")
    if not folder or not Path(folder).is_dir():
        return set()
    return {path.name for path in Path(folder).rglob("*") if path.is_file()}


def prompt_of(length: int, vocab: int, salt: int) -> tuple[int, ...]:
    """A prompt of ``length`` ids that shares no start with the others (no cache hit)."""
    return tuple((7919 * (i + 1) + 104729 * salt) % (vocab - 2) + 1 for i in range(length))


def _has_text(chunk: str) -> bool:
    """Whether a streamed chat chunk carries text (the role chunk's content is empty)."""
    choices = json.loads(chunk).get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content"))


def first_chunk_ms(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[float, float]:
    """(milliseconds to the first chunk with text, to the end) of a streamed chat."""
    began = time.perf_counter()
    first = None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"chat request failed: {response.status_code} {response.read()!r}")
        for line in response.iter_lines():
            if first is None and line.startswith("data: {") and _has_text(line[6:]):
                first = time.perf_counter()
    end = time.perf_counter()
    return ((first or end) - began) * 1e3, (end - began) * 1e3


def through_server(model_dir: Path, lengths: list[int], max_tokens: int) -> list[dict[str, Any]]:
    """Streamed, sampled chat requests to a fresh `mlxserve serve`, one at a time."""
    server = mlxserve(str(model_dir), free_port())
    try:
        server.wait_ready()
        out = []
        with httpx.Client(timeout=120) as client:
            for index, length in enumerate(lengths):
                words = " ".join(f"w{index}x{i}" for i in range(length))
                body = {  # as GuideLLM sends them (docs/compatibility.md)
                    "model": str(model_dir),
                    "messages": [{"role": "user", "content": [{"type": "text", "text": words}]}],
                    "max_completion_tokens": max_tokens,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                }
                seen = kernel_files()
                ttft, total = first_chunk_ms(client, server.url, body)
                out.append(
                    {
                        "words": length,
                        "ttft_ms": ttft,
                        "total_ms": total,
                        "kernels_compiled": sorted(kernel_files() - seen),
                    }
                )
        return out
    except Exception:
        print(server.tail(), file=sys.stderr)
        raise
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generic", choices=sorted(GENERIC), default="tiny-llama")
    parser.add_argument("--lengths", default="8,64,64,200,200,1000,1000")
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()
    lengths = [int(part) for part in args.lengths.split(",")]
    configure_cuda_graphs()  # as the CLI does, before any device work

    from mlxserve.startup.plan import build_plan

    config = GENERIC[args.generic]
    with tempfile.TemporaryDirectory() as root:
        model_dir = build_generic(Path(root) / args.generic, config)
        settings = load_settings(None, {"model": str(model_dir)})
        settings = settings.model_copy(
            update={"server": settings.server.model_copy(update={"state_dir": Path(root) / "s"})}
        )
        plan, membership = build_plan(settings)
        engine, loaded = build_engine(settings, plan, membership.rank, membership.group)
        before = kernel_files()
        began = time.perf_counter()
        warm_up(engine, tuple(loaded.tokenizer.encode(WARM_UP_TEXT)) or (0,))
        warm_s = time.perf_counter() - began
        after_warm_up = kernel_files()
        requests: list[dict[str, Any]] = []
        seen = after_warm_up
        for index, length in enumerate(lengths):
            prompt = prompt_of(length, int(config["vocab_size"]), index)
            params = GenerationParams(
                prompt, args.max_tokens, SamplingParams(temperature=1.0, seed=index)
            )
            done = run_to_completion(engine, GenerationRequest(f"r{index}", params))
            now = kernel_files()
            requests.append(
                {
                    "prompt_tokens": length,
                    "ttft_ms": done.ttft_s * 1e3,
                    "total_ms": done.total_s * 1e3,
                    "kernels_compiled": sorted(now - seen),
                }
            )
            seen = now
        del engine, loaded
        served = through_server(model_dir, lengths, args.max_tokens)
    result = {
        "benchmark": "first_request",
        "model": args.generic,
        "warm_up_s": warm_s,
        "kernels_compiled_by_warm_up": len(after_warm_up - before),
        "ptx_cache": os.environ.get("MLX_PTX_CACHE_DIR"),
        "requests": requests,
        "server_chat_requests": served,
        "device": benchmark_device(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
