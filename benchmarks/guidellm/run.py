"""GuideLLM against mlxserve and `mlx_lm.server` on the same model, as a user runs it.

    .venv/bin/python benchmarks/guidellm/run.py --guidellm /work/toolsvenv/bin/guidellm \
        [--generic qwen3-moe] [--requests 32] [--seconds 30] [--prompt-tokens 64] \
        [--output-tokens 32] [--sweep-size 4] [--out-dir DIR] [--skip-demo] \
        [--profiles concurrent,sweep] [--rounds 1] [--temperature T]

GuideLLM (PyPI ``guidellm``, in a virtual environment of its own: it pulls torch) is
the endpoint-agnostic benchmark peers cite. Both servers serve one random float32
mlx-lm model with the demo's tokenizer (`serve.py`'s ``--generic`` models:
mlx_lm.server cannot load the demo), both up at once on loopback
(`servers.py`). GuideLLM runs its ``concurrent`` profile at 1, 4 and 16 streams,
then its ``sweep`` profile (synchronous, throughput, and constant rates between),
against each server in turn, on synthetic prompts of ``--prompt-tokens`` with
``--output-tokens`` out (GuideLLM sends ``ignore_eos``: every answer has that many
tokens), each benchmark bounded by ``--requests`` and ``--seconds``. Then, unless
``--skip-demo``, mlxserve alone on the demo (MTP speculation on), the same two
profiles: the target there is 0 errors.

``--rounds`` repeats the concurrent profile, which server goes first alternating (a
shared machine's drift slows both alike), and the ratios are the medians of the
rounds' paired ratios. ``--temperature`` sends one in every request: GuideLLM sends
none, so mlxserve samples at OpenAI's default 1.0 and mlx_lm.server decodes
greedily at its own default 0.0, a different amount of work per token.

Writes GuideLLM's own console tables (``*.txt``) and its JSON reports into
``--out-dir``, and prints one JSON document: per server and profile, each
benchmark's requests (successful, errored, incomplete), output tokens/s, requests/s,
TTFT, ITL and TPOT (GuideLLM's medians and p95), the CPU each side spent per output
token (the server's, GuideLLM's own), and ``ratios``: mlxserve's output tokens/s over
mlx_lm.server's at each concurrency (the target: at least 1.0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from serve import GENERIC, build_generic, describe, parameter_count, random_model, tree_cpu_s
from servers import REPO, Server, free_port, mlx_lm_server, mlxserve

from mlxserve.hardware.probe import benchmark_device_apart

DEMO_TOKENIZER = REPO / "mlxserve" / "models" / "demo" / "weights"
CONCURRENCY = (1, 4, 16)


def guidellm_command(
    args: argparse.Namespace, server: Server, tokenizer: Path, profile: list[str], report: Path
) -> list[str]:
    """One ``guidellm run``: the server's chat endpoint, synthetic data, the bounds."""
    backend: dict[str, Any] = {"kind": "openai_http", "target": server.url, "model": server.model}
    if args.temperature is not None:
        # Added to every request's body (GuideLLM's `extras`); without it neither server
        # is told one, and each applies its own default.
        backend["extras"] = {"body": {"temperature": args.temperature}}
    return [
        args.guidellm,
        "run",
        "--backend",
        json.dumps(backend),
        "--tokenizer",
        f"kind=huggingface_auto,model={tokenizer}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
        f"output_tokens={args.output_tokens}",
        "--constraint",
        f"kind=max_requests,count={args.requests}",
        "--constraint",
        f"kind=max_duration,seconds={args.seconds}",
        *profile,
        "--output",
        f"kind=json,path={report}",
        "--disable-progress",
    ]


PROFILES: dict[str, list[str]] = {
    "concurrent": [
        "--profile",
        "kind=concurrent",
        "--override",
        "profile.streams",
        ",".join(map(str, CONCURRENCY)),
    ],
}


def sweep_profile(size: int) -> list[str]:
    return ["--profile", f"kind=sweep,sweep_size={size}"]


def run_guidellm(
    args: argparse.Namespace, server: Server, tokenizer: Path, name: str, profile: list[str]
) -> dict[str, Any]:
    """Run GuideLLM; keep its console tables and JSON report under ``name``."""
    report = args.out_dir / f"{name}.json"
    command = guidellm_command(args, server, tokenizer, profile, report)
    print(f"guidellm: {name}", file=sys.stderr)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    server_cpu, client_cpu, load = tree_cpu_s(server.proc.pid), children_cpu_s(), os.getloadavg()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    server_cpu_after, client_cpu_after = tree_cpu_s(server.proc.pid), children_cpu_s()
    (args.out_dir / f"{name}.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not report.exists():
        return {"error": f"guidellm exited {done.returncode}; see {name}.txt"}
    benchmarks = json.loads(report.read_text())["benchmarks"]
    tokens = sum(
        float(b["metrics"]["output_token_count"]["successful"]["total_sum"]) for b in benchmarks
    )
    # CPU seconds per output token, over the whole profile: the server's (for mlxserve
    # the front and its engine) and GuideLLM's own (it shares the machine's cores).
    cpu: dict[str, Any] = {"load_average_before": [round(x, 2) for x in load]}
    if server_cpu is not None and server_cpu_after is not None and tokens:
        cpu["server_ms_per_token"] = round((server_cpu_after - server_cpu) / tokens * 1e3, 4)
    if tokens:
        cpu["guidellm_ms_per_token"] = round((client_cpu_after - client_cpu) / tokens * 1e3, 4)
    return {"benchmarks": [summary(b) for b in benchmarks], "cpu": cpu}


def children_cpu_s() -> float:
    """CPU seconds of this process's finished children (the GuideLLM runs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _stat(metric: dict[str, Any], key: str) -> float | None:
    value = metric["successful"]
    if key == "mean":
        return round(float(value["mean"]), 3)
    if key == "median":
        return round(float(value["median"]), 3)
    return round(float(value["percentiles"][key]), 3)


def summary(benchmark: dict[str, Any]) -> dict[str, Any]:
    """The numbers of GuideLLM's tables, for one benchmark of a report."""
    strategy = benchmark["config"]["strategy"]
    metrics = benchmark["metrics"]
    out: dict[str, Any] = {
        "strategy": strategy["type_"],
        "streams": strategy.get("streams"),
        "rate": strategy.get("rate"),
        "requests": metrics["request_totals"],
        "output_tokens_per_s": _stat(metrics["output_tokens_per_second"], "mean"),
        "requests_per_s": _stat(metrics["requests_per_second"], "mean"),
    }
    for key, name in (
        ("time_to_first_token_ms", "ttft_ms"),
        ("inter_token_latency_ms", "itl_ms"),
        ("time_per_output_token_ms", "tpot_ms"),
    ):
        out[name] = {"median": _stat(metrics[key], "median"), "p95": _stat(metrics[key], "p95")}
    return out


def errors(result: dict[str, Any]) -> int | None:
    """Errored and incomplete requests over a result's benchmarks, every round (None: it
    did not run)."""
    runs = result.get("rounds", [result])
    if any("benchmarks" not in run for run in runs):
        return None
    return sum(
        int(b["requests"]["errored"]) + int(b["requests"]["incomplete"])
        for run in runs
        for b in run["benchmarks"]
    )


def by_streams(result: dict[str, Any]) -> dict[int, float]:
    """Output tokens/s per concurrency, of one round's benchmarks."""
    return {
        int(b["streams"]): float(b["output_tokens_per_s"])
        for b in result.get("benchmarks", [])
        if b["streams"] is not None and b["output_tokens_per_s"]
    }


def ratios(compared: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """mlxserve's output tokens/s over mlx_lm.server's, per concurrency: the median of
    the rounds' paired ratios (each round ran both servers back to back), and each
    round's ratio."""
    ours = compared["mlxserve"]["concurrent"].get("rounds", [compared["mlxserve"]["concurrent"]])
    theirs = compared["mlx_lm"]["concurrent"].get("rounds", [compared["mlx_lm"]["concurrent"]])
    out: dict[str, Any] = {}
    per_round: dict[str, list[float]] = {}
    for c in CONCURRENCY:
        paired = [
            round(a[c] / b[c], 3)
            for a, b in ((by_streams(x), by_streams(y)) for x, y in zip(ours, theirs, strict=True))
            if c in a and c in b
        ]
        out[str(c)] = round(statistics.median(paired), 3) if paired else None
        per_round[str(c)] = paired
    out["rounds"] = per_round
    return out


def with_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One profile's result over several rounds: the first round's benchmarks (GuideLLM's
    tables of that run), and every round under ``rounds``."""
    if len(runs) == 1:
        return runs[0]
    return {**runs[0], "rounds": runs}


def compare_generic(args: argparse.Namespace) -> dict[str, Any]:
    config = GENERIC[args.generic]
    parameters = parameter_count(random_model(config))
    results: dict[str, dict[str, Any]] = {"mlxserve": {}, "mlx_lm": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_generic(Path(tmp) / args.generic, config)
        servers: dict[str, Server] = {}
        try:
            for name, factory in (("mlxserve", mlxserve), ("mlx_lm", mlx_lm_server)):
                servers[name] = factory(str(model_dir), free_port())
                servers[name].wait_ready()
            engine_line = servers["mlxserve"].backend_line()
            flags = {"concurrent": PROFILES["concurrent"], "sweep": sweep_profile(args.sweep_size)}
            for profile in args.profiles:
                runs: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
                for number in range(args.rounds if profile == "concurrent" else 1):
                    # Which server goes first alternates: a drifting machine slows both.
                    order = list(servers.items())[:: -1 if number % 2 else 1]
                    for name, server in order:
                        label = f"{args.generic}_{name}_{profile}"
                        label += f"_r{number}" if number else ""
                        runs[name].append(
                            run_guidellm(args, server, model_dir, label, flags[profile])
                        )
                for name in servers:
                    results[name][profile] = with_rounds(runs[name])
        finally:
            for server in servers.values():
                server.stop()
    return {
        "model": describe(config, parameters),
        "generic": args.generic,
        "mlxserve_engine": engine_line,
        "servers": results,
        "errors": {
            name: {profile: errors(result) for profile, result in by_profile.items()}
            for name, by_profile in results.items()
        },
        "ratios": ratios(results) if "concurrent" in args.profiles else None,
    }


def demo_alone(args: argparse.Namespace) -> dict[str, Any]:
    server = mlxserve("demo", free_port())
    results: dict[str, Any] = {}
    try:
        server.wait_ready()
        engine_line = server.backend_line()
        flags = {"concurrent": PROFILES["concurrent"], "sweep": sweep_profile(args.sweep_size)}
        for profile in args.profiles:
            label = f"demo_mlxserve_{profile}"
            results[profile] = run_guidellm(args, server, DEMO_TOKENIZER, label, flags[profile])
    finally:
        server.stop()
    return {
        "model": "demo (mlxserve's built-in DeepSeek-V4-shaped demo, MTP on)",
        "mlxserve_engine": engine_line,
        "servers": {"mlxserve": results},
        "errors": {profile: errors(result) for profile, result in results.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--guidellm", required=True, help="the guidellm executable")
    parser.add_argument("--generic", choices=sorted(GENERIC), default="qwen3-moe")
    parser.add_argument("--requests", type=int, default=32, help="most requests a benchmark")
    parser.add_argument("--seconds", type=float, default=30.0, help="most seconds a benchmark")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--sweep-size", type=int, default=4, help="benchmarks in the sweep")
    parser.add_argument("--out-dir", type=Path, default=None, help="GuideLLM's tables and JSON")
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument(
        "--profiles",
        default="concurrent,sweep",
        help="comma-separated: concurrent, sweep (default both)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="a temperature in every request (default: none sent, as GuideLLM does: "
        "mlxserve then samples at OpenAI's 1.0, mlx_lm.server decodes greedily)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="concurrent profile runs per server, alternating which server goes first",
    )
    args = parser.parse_args()
    if args.sweep_size < 3:
        parser.error("--sweep-size is at least 3 (synchronous, throughput, one rate)")
    args.profiles = [p for p in args.profiles.split(",") if p]
    if not args.profiles or set(args.profiles) - {"concurrent", "sweep"}:
        parser.error("--profiles takes concurrent and/or sweep")
    if args.rounds < 1:
        parser.error("--rounds is at least 1")
    if args.out_dir is None:
        args.out_dir = Path(tempfile.mkdtemp(prefix="guidellm-"))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "machine": {"device": benchmark_device_apart(), "platform": platform.platform()},
        "settings": {
            key: getattr(args, key)
            for key in (
                "requests",
                "seconds",
                "prompt_tokens",
                "output_tokens",
                "sweep_size",
                "profiles",
                "rounds",
                "temperature",
            )
        },
        "out_dir": str(args.out_dir),
        "comparison": compare_generic(args),
    }
    if not args.skip_demo:
        report["demo"] = demo_alone(args)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
