"""Streaming latency and throughput of `mlxserve` against `mlx_lm.server`, as JSON.

    python benchmarks/serve.py [--clients 1,2,4,8,16] [--requests 3] [--max-tokens 128]
                               [--generic {qwen3-moe,tiny-llama}] [--out results.json]
                               [--skip-demo]

For 1, 2, 4, 8 and 16 concurrent streaming clients (each sending `--requests`
requests one after the other), it measures aggregate tokens/s, time to first
token (TTFT) p50/p95 and inter-token latency (ITL, the gap between streamed
chunks) p50/p95, and for mlxserve the engine's MLX memory (`memory` in each
level: its peak during the level, the weights, one request's caches, the prefix
cache; `memory_before`: the same after the level's warm-up):

- `comparison`: mlxserve and mlx_lm.server serving the same model in the same
  run, both up at once, and their ratios (mlxserve / mlx_lm). Per level each
  server warms up, then `--rounds` rounds run each server once in turn (which
  one goes first alternates): a ratio of tok/s is the median of the rounds'
  paired ratios, so a machine whose speed drifts (a shared CPU, a GPU's clocks)
  slows both servers alike; a level's row is its median round. mlx_lm.server cannot load the
  demo model (DeepSeek-V4 is not an mlx-lm model type), so both serve a random
  float32 mlx-lm model saved to a temporary directory with the demo's
  tokenizer (`--generic`): by default the continuous-batching issue's 35.8M
  Qwen3-MoE, or a tiny llama (2 layers, width 64), quick but too small for the
  memory ratio to be about the caches. Speculative decoding is off (neither
  has an MTP module); the report names the model and its parameter count,
  mlxserve's engine line and whether both servers' greedy texts agree.
- `demo`: mlxserve alone on the built-in demo model (MTP speculative decoding
  on), the model the README serves.

`targets` holds the ratios the continuous-batching issue asks for: mlxserve over
mlx_lm.server tok/s at every level and ITL p50 at 8 clients, the demo's tok/s
at 4 (and 8) clients over one client, and the engine's peak memory during the
8-client level over the weights plus eight one-request caches (`memory_ratio`
says what is counted). `machine` records the device
MLX ran on (the servers run on the same default device).

Greedy decoding; mlxserve gets `ignore_eos` so every request generates
`--max-tokens` tokens; mlx_lm.server has no such switch, so its token counts
come from its usage report (or its chunks). Servers listen on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from servers import REPO, Server, free_port, mlx_lm_server, mlxserve, percentile

from mlxserve.hardware.probe import benchmark_device_apart

PROMPT = "Python reference: the for statement. Explain how iteration works, with an example."


#: transport failures before any token is streamed: retried this many times
RETRIES = 2


async def one_request(
    client: httpx.AsyncClient, server: Server, max_tokens: int, extra: dict[str, Any]
) -> dict[str, Any]:
    body = {
        "model": server.model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    started = time.perf_counter()
    for attempt in range(1 + RETRIES):
        times: list[float] = []
        usage_tokens = None
        try:
            async with client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"].get("completion_tokens")
                    if any(choice.get("text") for choice in chunk.get("choices") or []):
                        times.append(time.perf_counter())
            break
        except httpx.TransportError:
            # mlx_lm.server (a threading HTTP server) may drop a connection under
            # 16 clients; the retry is counted and its time stays in the level's.
            if attempt == RETRIES or times:
                raise
    return {
        "ttft": times[0] - started if times else None,
        "decode_s": times[-1] - times[0] if len(times) > 1 else None,
        "gaps": [b - a for a, b in itertools.pairwise(times)],
        "tokens": usage_tokens if usage_tokens is not None else len(times),
        "retries": attempt,
    }


#: Prompts of the greedy check, and the tokens it asks each for.
GREEDY_PROMPTS = (PROMPT, "The quick brown fox")
GREEDY_TOKENS = 16


def greedy_texts(server: Server) -> list[str]:
    """Each greedy prompt's completion, alone and unstreamed: both servers should agree."""
    texts = []
    for prompt in GREEDY_PROMPTS:
        body = {"model": server.model, "prompt": prompt, "max_tokens": GREEDY_TOKENS}
        response = httpx.post(
            f"{server.url}/v1/completions", json={**body, "temperature": 0}, timeout=600
        )
        response.raise_for_status()
        texts.append(response.json()["choices"][0]["text"])
    return texts


def engine_memory(server: Server) -> dict[str, int] | None:
    """The engine's MLX memory as its last finished request reported it (mlxserve only)."""
    try:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    memory = {}
    for line in text.splitlines():
        if line.startswith("mlxserve_engine_memory_bytes{"):
            kind = line.split('kind="')[1].split('"')[0]
            memory[kind] = int(float(line.rsplit(" ", 1)[1]))
    return memory or None


def tree_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) of process ``pid`` and its descendants so far: for
    mlxserve the front and its engine, for mlx_lm.server its one process. None where
    /proc cannot tell (not Linux, a process gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    try:
        while todo:
            current = todo.pop()
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
    except (OSError, ValueError, IndexError):
        return None
    return total


async def run_level(
    server: Server, clients: int, requests: int, max_tokens: int, extra: dict[str, Any]
) -> dict[str, Any]:
    cpu_before = tree_cpu_s(server.proc.pid)
    async with httpx.AsyncClient(timeout=600) as client:

        async def worker() -> list[dict[str, Any]]:
            return [await one_request(client, server, max_tokens, extra) for _ in range(requests)]

        began = time.perf_counter()
        results = [
            r for batch in await asyncio.gather(*(worker() for _ in range(clients))) for r in batch
        ]
        elapsed = time.perf_counter() - began
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in results)
    retries = sum(r["retries"] for r in results)
    decoding = [r for r in results if r["decode_s"]]
    decode_s = sum(r["decode_s"] for r in decoding)
    cpu_after = tree_cpu_s(server.proc.pid)
    cpu_s = cpu_after - cpu_before if cpu_after is not None and cpu_before is not None else None
    memory = engine_memory(server)
    return {
        "clients": clients,
        "requests": len(results),
        "retries": retries,
        "memory": memory,
        "tokens": tokens,
        "seconds": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 2),
        # After each request's first token: decoding alone, whatever the TTFT.
        "decode_tokens_per_s": (
            round(sum(r["tokens"] - 1 for r in decoding) / decode_s, 2) if decode_s else None
        ),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p95_s": percentile(ttfts, 0.95),
        "itl_p50_s": percentile(gaps, 0.5),
        "itl_p95_s": percentile(gaps, 0.95),
        # Chunks that arrive together (one read) have gaps near 0, which pulls the
        # p50 down; the mean gap is decode time over tokens, whatever the grouping.
        "itl_mean_s": sum(gaps) / len(gaps) if gaps else None,
        # The server's CPU time per token (its processes', while the level ran): on a
        # CPU shared with other work, what a token costs, whatever share the server got.
        "cpu_ms_per_token": round(1e3 * cpu_s / tokens, 3) if cpu_s and tokens else None,
    }


def warm_level(server: Server, clients: int, extra: dict[str, Any]) -> dict[str, int] | None:
    """An untimed run at this concurrency: kernels for its batch shapes (MLX CUDA
    compiles on first use) and the allocator's buffers exist before timing. The
    engine's memory after it (mlxserve only)."""
    try:
        return asyncio.run(run_level(server, clients, 1, 8, extra))["memory"]  # type: ignore[no-any-return]
    except httpx.HTTPError as exc:
        print(f"warm-up at {clients} clients failed: {exc!r}\n{server.tail()}", file=sys.stderr)
        server.wait_ready()
        return None


def timed_level(
    server: Server, clients: int, requests: int, max_tokens: int, extra: dict[str, Any]
) -> dict[str, Any]:
    """One timed run of the level; a failure is recorded and the server waited for."""
    try:
        return asyncio.run(run_level(server, clients, requests, max_tokens, extra))
    except httpx.HTTPError as exc:
        print(f"{clients} clients failed: {exc!r}\n{server.tail()}", file=sys.stderr)
        server.wait_ready()
        return {"clients": clients, "error": repr(exc), "memory": None, **NO_RESULT}


def median_round(rounds: list[dict[str, Any]], memory_before: Any) -> dict[str, Any]:
    """The level's row: its round of median throughput (a whole row, so its latencies
    belong to one run), with every round's tok/s and the memory the last round left
    (each round is a busy period of its own, so its peak is that round's)."""
    done = sorted((r for r in rounds if r.get("tokens_per_s")), key=lambda r: r["tokens_per_s"])
    row = dict(done[len(done) // 2] if done else rounds[-1])
    row["rounds_tokens_per_s"] = [r.get("tokens_per_s") for r in rounds]
    row["memory"] = rounds[-1].get("memory")
    row["memory_before"] = memory_before
    return row


def measure(
    servers: dict[str, tuple[Server, dict[str, Any]]],
    levels: list[int],
    requests: int,
    max_tokens: int,
    rounds: int,
) -> dict[str, list[dict[str, Any]]]:
    """Every level on every server, interleaved: per level, each server warms up, then
    `rounds` rounds run each server once, in turn (the first one alternating), so a
    machine whose speed drifts (a shared CPU, clocks) slows both alike. Each row also
    holds, against the first server, the per-round ratios of tok/s
    (``paired_over_first``)."""
    names = list(servers)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for clients in levels:
        before = {
            name: warm_level(server, clients, extra) for name, (server, extra) in servers.items()
        }
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for index in range(rounds):
            order = names if index % 2 == 0 else names[::-1]
            for name in order:
                server, extra = servers[name]
                runs[name].append(timed_level(server, clients, requests, max_tokens, extra))
        first = runs[names[0]]
        for name in names:
            row = median_round(runs[name], before[name])
            for rate, paired in (
                ("tokens_per_s", "paired_over_first"),
                ("decode_tokens_per_s", "decode_paired_over_first"),
            ):
                row[paired] = [
                    round(mine[rate] / base[rate], 3) if mine.get(rate) and base.get(rate) else None
                    for mine, base in zip(runs[name], first, strict=True)
                ]
            results[name].append(row)
    return results


NO_RESULT = dict.fromkeys(
    (
        "tokens_per_s",
        "decode_tokens_per_s",
        "ttft_p50_s",
        "ttft_p95_s",
        "itl_p50_s",
        "itl_p95_s",
        "itl_mean_s",
        "cpu_ms_per_token",
    )
)


def ratios(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per level, ours over theirs: tok/s as the median of the rounds' paired ratios
    (each round ran both servers back to back), the latencies from the median rows."""
    keys = tuple(NO_RESULT)
    out = []
    for a, b in zip(ours, theirs, strict=True):
        row: dict[str, Any] = {"clients": a["clients"]}
        for key in keys:
            row[key] = round(a[key] / b[key], 3) if a[key] and b[key] else None
        for rate, paired_key in (
            ("tokens_per_s", "paired_over_first"),
            ("decode_tokens_per_s", "decode_paired_over_first"),
        ):
            paired = [1 / r for r in b.get(paired_key) or [] if r]
            if paired:
                row[rate] = round(statistics.median(paired), 3)
                row[f"{rate}_rounds"] = [round(r, 3) for r in paired]
        out.append(row)
    return out


def level(results: list[dict[str, Any]], clients: int) -> dict[str, Any] | None:
    return next((r for r in results if r["clients"] == clients), None)


def targets(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's ratios, each measured within this run."""
    out: dict[str, Any] = {}
    comparison = report.get("comparison")
    if comparison:
        rows = comparison["ratio_mlxserve_over_mlx_lm"]
        out["generic_tokens_per_s_ratio"] = {r["clients"]: r["tokens_per_s"] for r in rows}
        out["generic_decode_tokens_per_s_ratio"] = {
            r["clients"]: r["decode_tokens_per_s"] for r in rows
        }
        eight = next((r for r in rows if r["clients"] == 8), None)
        out["generic_itl_p50_ratio_at_8"] = eight["itl_p50_s"] if eight else None
        out["generic_itl_mean_ratio_at_8"] = eight["itl_mean_s"] if eight else None
        out["generic_memory_at_8"] = memory_ratio(comparison["mlxserve"], 8)
    demo = report.get("demo")
    if demo:
        one = level(demo["mlxserve"], 1)
        for n in (4, 8):
            many = level(demo["mlxserve"], n)
            if one and many and one["tokens_per_s"] and many["tokens_per_s"]:
                out[f"demo_{n}_over_1"] = round(many["tokens_per_s"] / one["tokens_per_s"], 3)
        out["demo_memory_at_8"] = memory_ratio(demo["mlxserve"], 8)
    return out


def memory_ratio(results: list[dict[str, Any]], clients: int) -> dict[str, Any] | None:
    """The level's peak over the weights plus ``clients`` one-request caches.

    The peak is the engine's ``busy_peak_bytes``: MLX's peak since the engine was
    last idle, which it is after the untimed warm-up, so it is the timed level's
    own peak (not one from loading, calibration or another level). One request's
    caches are what the engine reported at one client (its decode caches at its
    end: the longest they get here). The prefix cache is memory of its own,
    bounded by ``[engine] prefix_cache_mb``: ``ratio`` leaves out what it held when
    the level began (``prefix_cache_bytes``; entries it adds during the level stay
    in the peak), ``ratio_with_prefix_cache`` counts all of it in the peak.

    With real-sized weights the ratio is mostly the weights over themselves (on
    the 35.8M Qwen3-MoE eight short requests' caches are 2% of the budget, so a
    transient copy of the whole batch moves it by 2%). ``caches_ratio`` is the part
    the caches decide: the peak above the weights (and the prefix cache at the
    level's start) over the ``clients`` caches: about 1 when the batch is held
    once, about 2 or more when it is briefly held twice.
    """
    one, many = level(results, 1), level(results, clients)
    if not one or not many or not one["memory"] or not many["memory"]:
        return None
    weights = one["memory"].get("weights_bytes", 0)
    cache = one["memory"].get("cache_bytes", 0)
    memory = many["memory"]
    peak = memory.get("busy_peak_bytes", memory.get("peak_bytes", 0))
    before = many.get("memory_before") or memory
    prefix = min(before.get("prefix_cache_bytes", 0), memory.get("prefix_cache_bytes", 0))
    budget = weights + clients * cache
    return {
        "peak_bytes": peak,
        "weights_bytes": weights,
        "one_request_cache_bytes": cache,
        "weights_plus_caches_bytes": budget,
        "prefix_cache_bytes": prefix,
        "ratio": round((peak - prefix) / budget, 3) if budget else None,
        "ratio_with_prefix_cache": round(peak / budget, 3) if budget else None,
        "caches_ratio": round((peak - prefix - weights) / (clients * cache), 3) if cache else None,
    }


#: The tiny llama: 2 layers of width 64 (0.8 MB of float32 weights). Fast, but at
#: this size fixed activation buffers dominate the memory ratio.
TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 1024,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
}

#: The issue's generic model: a float32 Qwen3-MoE of 35.8M parameters (143 MB), every
#: layer sparse (16 experts, top 4), grouped-query attention with 2 KV heads. The
#: vocabulary is the demo tokenizer's (1024 ids, its special tokens among them).
QWEN3_MOE: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "hidden_size": 512,
    "num_hidden_layers": 5,
    "intermediate_size": 1024,  # dense MLP width: unused, every layer is an MoE
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 256,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "vocab_size": 1024,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
}

DEMO_WEIGHTS = REPO / "mlxserve" / "models" / "demo" / "weights"


def parameter_count(model: Any) -> int:
    """Elements in the model's parameters (counted from shapes: nothing is evaluated)."""
    from mlx.utils import tree_flatten

    arrays = tree_flatten(model.parameters())
    assert isinstance(arrays, list)
    return sum(int(array.size) for _, array in arrays)


def random_model(config: dict[str, Any], seed: int = 0) -> Any:
    """An mlx-lm model of ``config`` with random float32 weights (lazy until evaluated)."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    return model_class(args_class.from_dict(config))


def build_generic(out_dir: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """Save a random model of ``config`` as an mlx-lm directory, with the demo tokenizer.

    Built offline: mlx-lm's ``save_model`` writes the weights, ``config.json`` is
    ``config`` itself, and the tokenizer files are the demo's (its 1024 ids fit
    ``vocab_size``), so both servers load the directory as an mlx-lm model.
    """
    import shutil

    import mlx.core as mx
    from mlx_lm.utils import save_model

    if int(config["vocab_size"]) < 1024:
        raise ValueError("vocab_size must hold the demo tokenizer's 1024 ids")
    model = random_model(config, seed)
    mx.eval(model.parameters())
    out_dir.mkdir(parents=True, exist_ok=True)
    save_model(out_dir, model)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (DEMO_WEIGHTS / name).exists():
            shutil.copyfile(DEMO_WEIGHTS / name, out_dir / name)
    return out_dir


def describe(config: dict[str, Any], parameters: int) -> str:
    """One line for the report: what the generic model is."""
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    shape = f"{layers} layers, hidden {hidden}"
    if config["model_type"] == "qwen3_moe":
        name = "Qwen3-MoE"
        shape += (
            f", {config['num_experts']} experts top-{config['num_experts_per_tok']}"
            f" of width {config['moe_intermediate_size']}"
        )
    else:
        name = str(config["model_type"])
    shape += f", {config['num_key_value_heads']} KV heads, vocab {config['vocab_size']}"
    return f"random float32 {name}, {parameters / 1e6:.1f}M parameters ({shape}, demo tokenizer)"


#: ``--generic`` choices: name -> config.
GENERIC = {"qwen3-moe": QWEN3_MOE, "tiny-llama": TINY_LLAMA}


def compare_generic(args: argparse.Namespace, levels: list[int]) -> dict[str, Any]:
    """mlxserve against mlx_lm.server on the same generic model, each level's rounds
    alternating between them, and a greedy check that both give the same texts."""
    config = GENERIC[args.generic]
    parameters = parameter_count(random_model(config))
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_generic(Path(tmp) / args.generic, config))
        servers: dict[str, tuple[Server, dict[str, Any]]] = {}
        try:
            for name, factory, extra in (
                ("mlxserve", mlxserve, {"ignore_eos": True}),
                ("mlx_lm", mlx_lm_server, {}),
            ):
                servers[name] = (factory(model, free_port()), extra)
                servers[name][0].wait_ready()
            greedy = {name: greedy_texts(server) for name, (server, _) in servers.items()}
            backend = servers["mlxserve"][0].backend_line()
            results = measure(servers, levels, args.requests, args.max_tokens, args.rounds)
        finally:
            for server, _ in servers.values():
                server.stop()
        print("comparison: done", file=sys.stderr)
    return {
        "model": describe(config, parameters),
        "generic": args.generic,
        "parameters": parameters,
        "config": config,
        "mlxserve_backend": backend,
        "greedy": {
            "max_tokens": GREEDY_TOKENS,
            "agree": greedy["mlxserve"] == greedy["mlx_lm"],
            "mlxserve": greedy["mlxserve"],
            "mlx_lm_server": greedy["mlx_lm"],
        },
        "mlxserve": results["mlxserve"],
        "mlx_lm_server": results["mlx_lm"],
        "ratio_mlxserve_over_mlx_lm": ratios(results["mlxserve"], results["mlx_lm"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,2,4,8,16")
    parser.add_argument("--requests", type=int, default=3, help="per client, one after another")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="timed runs per level and server, the servers in turn (median reported)",
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument(
        "--skip-generic", action="store_true", help="the demo alone (no mlx_lm.server beside it)"
    )
    parser.add_argument(
        "--generic",
        choices=sorted(GENERIC),
        default="qwen3-moe",
        help="the model both servers serve (default: the issue's 35.8M Qwen3-MoE)",
    )
    args = parser.parse_args()
    levels = [int(n) for n in args.clients.split(",")]
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.skip_demo and args.skip_generic:
        parser.error("--skip-demo and --skip-generic leave nothing to measure")
    report: dict[str, Any] = {
        "machine": benchmark_device_apart(),
        "settings": {
            "levels": levels,
            "requests_per_client": args.requests,
            "max_tokens": args.max_tokens,
            "prompt": PROMPT,
            "greedy": True,
            "rounds": args.rounds,
        },
    }
    if not args.skip_generic:
        report["comparison"] = compare_generic(args, levels)
    if not args.skip_demo:
        server = mlxserve("demo", free_port())
        try:
            server.wait_ready()
            report["demo"] = {
                "model": "demo (DeepSeek-V4 tiny, MTP speculative decoding)",
                "mlxserve": measure(
                    {"demo": (server, {"ignore_eos": True})},
                    levels,
                    args.requests,
                    args.max_tokens,
                    args.rounds,
                )["demo"],
            }
        finally:
            server.stop()
    report["targets"] = targets(report)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "benchmark"
    sys.exit(main())
