"""Features that compose (#29), measured on a live server: the composition matrix at
fixed speculative depths, and what a grammar plus a thinking budget cost under
speculation. Prints one JSON document.

- ``matrix``: every cell of {thinking off, on with a budget} x {json_object,
  json_schema strict, forced tool, required, auto} x {chat, Responses, Messages},
  sent at once (a mixed batch) and then alone, at each depth, on the demo in
  DeepSeek-V4's published format: cells valid and 5xx answers (targets: all valid,
  no 5xx). The suite runs the same cells at the automatic depth
  (tests/server/test_composition_live.py imports them from here).
- ``cost``: one question streamed four ways at each depth, interleaved: thinking
  with a budget and a strict JSON schema (the composed request), the same thinking
  budget unconstrained, that one cut to the composed answer's length, and plain.
  Decode milliseconds per token after the first, medians over repeats; the composed
  request's ratio to the unconstrained one (target <= 1.05). The answers differ
  (JSON vs free text), so under speculation their drafts are not kept alike (the
  demo's free text soon repeats itself and nearly every draft is kept), and a short
  answer pays its round's fixed costs over fewer tokens: the cut request compares
  like lengths, and ``ms_per_step`` (per decode step, a plain step or a round, from
  the server's speculative counters) what the composition costs a step whatever its
  drafts' fate. ``spec`` has each request's drafted/accepted/steps. Where ``/proc``
  is (Linux), ``cpu_ms_per_token`` is the server's processes' CPU time per token
  (prompt included), steadier than the wall clock on a shared CPU.

Run: python benchmarks/composition.py [--depths 0,1,3,auto] [--repeats 5] [--only cost]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from servers import Server, free_port, mlxserve

from mlxserve.models.demo.deepseek_format import build_deepseek_format_demo

MAX_TOKENS = 160
BUDGET = 12
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
KINDS = ("json_object", "json_schema", "forced_tool", "required", "auto")
APIS = ("chat", "responses", "messages")
QUESTION = "Python reference: the weather of Paris"
CONFIG = """
[engine]
max_running = 8
[server]
max_queue = 64
"""


def body(api: str, kind: str, thinking: bool, model: str) -> tuple[str, dict[str, Any]]:
    """The route and body of one cell of the matrix."""
    if api == "chat":
        return "/v1/chat/completions", chat_body(kind, thinking, model)
    if api == "responses":
        return "/v1/responses", responses_body(kind, thinking, model)
    return "/v1/messages", messages_body(kind, thinking, model)


def chat_body(kind: str, thinking: bool, model: str) -> dict[str, Any]:
    weather = {"name": "get_weather", "parameters": SCHEMA}
    tools = [{"type": "function", "function": weather}]
    out: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    if thinking:
        out["thinking"] = {"type": "enabled", "budget_tokens": BUDGET}
    if kind == "json_object":
        out["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        schema = {"name": "city", "schema": SCHEMA, "strict": True}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    else:
        out["tools"] = tools
        out["tool_choice"] = {
            "forced_tool": {"type": "function", "function": {"name": "get_weather"}},
            "required": "required",
            "auto": "auto",
        }[kind]
    return out


def responses_body(kind: str, thinking: bool, model: str) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "input": QUESTION, "max_output_tokens": MAX_TOKENS}
    out["temperature"] = 0
    if thinking:
        out["reasoning"] = {"effort": "high", "budget_tokens": BUDGET}
    if kind == "json_object":
        out["text"] = {"format": {"type": "json_object"}}
    elif kind == "json_schema":
        fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
        out["text"] = {"format": fmt}
    else:
        out["tools"] = [
            {"type": "function", "name": "get_weather", "parameters": SCHEMA, "strict": True}
        ]
        out["tool_choice"] = {
            "forced_tool": {"type": "function", "name": "get_weather"},
            "required": "required",
            "auto": "auto",
        }[kind]
    return out


def messages_body(kind: str, thinking: bool, model: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    if thinking:
        out["thinking"] = {"type": "enabled", "budget_tokens": BUDGET}
    if kind in ("json_object", "json_schema"):  # Anthropic has JSON schemas only
        out["output_config"] = {"format": {"type": "json_schema", "schema": SCHEMA}}
    else:
        out["tools"] = [{"name": "get_weather", "input_schema": SCHEMA}]
        out["tool_choice"] = {
            "forced_tool": {"type": "tool", "name": "get_weather"},
            "required": {"type": "any"},
            "auto": {"type": "auto"},
        }[kind]
    return out


def follows_schema(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"city"} and isinstance(value["city"], str)


def answer_of(api: str, data: dict[str, Any]) -> tuple[str, list[tuple[str, Any]]]:
    """The answer's text and its calls (name, parsed arguments)."""
    if api == "chat":
        message = data["choices"][0]["message"]
        calls = [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls") or []
        ]
        return message.get("content") or "", calls
    if api == "responses":
        text, calls = "", []
        for item in data["output"]:
            if item["type"] == "message":
                text += "".join(p.get("text", "") for p in item["content"])
            elif item["type"] == "function_call":
                calls.append((item["name"], json.loads(item["arguments"])))
        return text, calls
    text = "".join(b.get("text", "") for b in data["content"] if b["type"] == "text")
    calls = [(b["name"], b["input"]) for b in data["content"] if b["type"] == "tool_use"]
    return text, calls


def check(api: str, kind: str, response: httpx.Response) -> str | None:
    """None when the answer is valid for its cell, else why not."""
    if response.status_code != 200:
        return f"{response.status_code} {response.text[:300]}"
    text, calls = answer_of(api, response.json())
    if kind in ("json_object", "json_schema"):
        try:
            value = json.loads(text)
        except ValueError:
            return f"not JSON: {text!r}"
        if kind == "json_object" and not isinstance(value, dict):
            return f"not an object: {text!r}"
        if kind == "json_schema" and not follows_schema(value):
            return f"does not follow the schema: {text!r}"
        return None
    if kind in ("forced_tool", "required"):
        if not calls:
            return f"no call: {text!r}"
        if any(name != "get_weather" or not follows_schema(args) for name, args in calls):
            return f"invalid call: {calls!r}"
        if "<tool_call>" in text or "DSML" in text:
            return f"call markup in the text: {text!r}"
        return None
    return None if not calls or all(follows_schema(args) for _, args in calls) else str(calls)


Cell = tuple[str, str, bool]


def all_cells() -> list[Cell]:
    return [(api, kind, thinking) for api in APIS for kind in KINDS for thinking in (False, True)]


def send(url: str, model: str, cell: Cell) -> httpx.Response:
    api, kind, thinking = cell
    path, payload = body(api, kind, thinking, model)
    return httpx.post(f"{url}{path}", json=payload, timeout=600)


def run_matrix(url: str, model: str) -> dict[str, Any]:
    """Every cell at once, then every cell alone: how many were valid, and the failures."""
    cells = all_cells()
    with ThreadPoolExecutor(len(cells)) as pool:
        batched = list(pool.map(lambda cell: send(url, model, cell), cells))
    alone = [send(url, model, cell) for cell in cells]
    problems, server_errors = [], 0
    for cell, response in [*zip(cells, batched, strict=True), *zip(cells, alone, strict=True)]:
        server_errors += response.status_code >= 500
        problem = check(cell[0], cell[1], response)
        if problem is not None:
            problems.append(f"{cell}: {problem}")
    answered = 2 * len(cells)
    return {
        "cells": answered,
        "valid": answered - len(problems),
        "server_errors": server_errors,
        "problems": problems[:10],
    }


def decode_ms_per_token(url: str, payload: dict[str, Any]) -> tuple[float, int]:
    """Stream one chat request: milliseconds per token after the first, and the tokens."""
    payload = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    first = last = 0.0
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=payload, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                delta = chunk["choices"][0].get("delta", {})
                if (
                    delta.get("content")
                    or delta.get("reasoning_content")
                    or delta.get("tool_calls")
                ):
                    last = time.perf_counter()
                    first = first or last
    return 1000 * (last - first) / max(1, tokens - 1), tokens


def spec_counters(url: str) -> dict[str, float]:
    """The server's speculative counters (drafted, accepted, decode steps) now."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    counts = {"drafted": 0.0, "accepted": 0.0, "steps": 0.0}
    names = {
        "mlxserve_speculative_drafted_tokens_total": "drafted",
        "mlxserve_speculative_accepted_tokens_total": "accepted",
        "mlxserve_speculative_depth_steps_total": "steps",
    }
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            counts[names[name]] += float(line.rsplit(" ", 1)[1])
    return counts


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and its descendants (0: no /proc)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return 0.0
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, seconds)
    tick = float(os.sysconf("SC_CLK_TCK"))
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    tree, total = {pid}, 0.0
    for _ in range(8):  # a few generations: front, engine, ranks
        tree |= {child for child, (parent, _) in stats.items() if parent in tree}
    for member in tree:
        total += stats.get(member, (0, 0.0))[1]
    return total


def cost_payloads(model: str) -> dict[str, dict[str, Any]]:
    thinking = {"type": "enabled", "budget_tokens": BUDGET}
    plain = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    schema = {"name": "city", "schema": SCHEMA, "strict": True}
    return {
        "composed": {
            **plain,
            "thinking": thinking,
            "response_format": {"type": "json_schema", "json_schema": schema},
        },
        "thinking_unconstrained": {**plain, "thinking": thinking},
        "plain": plain,
    }


def run_cost(url: str, model: str, repeats: int, pid: int) -> dict[str, Any]:
    """The requests interleaved, `repeats` times each; medians and the ratios."""
    payloads = cost_payloads(model)
    tokens: dict[str, int] = {}
    for name, payload in payloads.items():  # warm each path once
        tokens[name] = decode_ms_per_token(url, payload)[1]
    # The unconstrained request, cut to the composed answer's length.
    cut = {**payloads["thinking_unconstrained"], "max_tokens": max(2, tokens["composed"])}
    payloads = {**payloads, "unconstrained_same_length": cut}
    decode_ms_per_token(url, cut)
    samples: dict[str, list[float]] = {name: [] for name in payloads}
    per_step: dict[str, list[float]] = {name: [] for name in payloads}
    cpu: dict[str, list[float]] = {name: [] for name in payloads}
    spec: dict[str, dict[str, float]] = {}
    for _ in range(repeats):
        for name, payload in payloads.items():
            before = spec_counters(url)
            cpu_before = tree_cpu_seconds(pid)
            ms, tokens[name] = decode_ms_per_token(url, payload)
            cpu[name].append(1000 * (tree_cpu_seconds(pid) - cpu_before) / tokens[name])
            after = spec_counters(url)
            spec[name] = {k: after[k] - before[k] for k in after}
            samples[name].append(ms)
            if spec[name]["steps"]:
                per_step[name].append(ms * (tokens[name] - 1) / spec[name]["steps"])
    medians = {name: statistics.median(values) for name, values in samples.items()}
    report: dict[str, Any] = {
        "ms_per_token": {name: round(value, 3) for name, value in medians.items()},
        "tokens": tokens,
        "composed_over_unconstrained": round(
            medians["composed"] / medians["thinking_unconstrained"], 4
        ),
        "composed_over_unconstrained_same_length": round(
            medians["composed"] / medians["unconstrained_same_length"], 4
        ),
        "composed_over_plain": round(medians["composed"] / medians["plain"], 4),
    }
    if all(any(values) for values in cpu.values()):
        cpu_ms = {name: statistics.median(values) for name, values in cpu.items()}
        report["cpu_ms_per_token"] = {name: round(value, 3) for name, value in cpu_ms.items()}
        report["composed_over_unconstrained_same_length_cpu"] = round(
            cpu_ms["composed"] / cpu_ms["unconstrained_same_length"], 4
        )
    if all(per_step.values()):
        steps = {name: statistics.median(values) for name, values in per_step.items()}
        report["ms_per_step"] = {name: round(value, 3) for name, value in steps.items()}
        report["spec"] = spec
        report["composed_over_unconstrained_per_step"] = round(
            steps["composed"] / steps["thinking_unconstrained"], 4
        )
        report["composed_over_unconstrained_same_length_per_step"] = round(
            steps["composed"] / steps["unconstrained_same_length"], 4
        )
    return report


def serve(model: str, depth: str, workdir: Path) -> Server:
    config = workdir / f"config-{depth}.toml"
    config.write_text(CONFIG)
    extra = ("--config", str(config), "--speculative-depth", depth)
    server = mlxserve(model, free_port(), extra)
    server.wait_ready()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="0,1,3,auto")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=("matrix", "cost"))
    args = parser.parse_args()
    import mlx.core as mx

    model = str(build_deepseek_format_demo(progress=False))
    report: dict[str, Any] = {
        "device": str(mx.default_device()),
        "model": "demo (DeepSeek-V4 published format)",
        "depths": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for depth in args.depths.split(","):
            server = serve(model, depth, Path(tmp))
            try:
                entry: dict[str, Any] = {"startup": server.backend_line()}
                if args.only != "cost":
                    entry["matrix"] = run_matrix(server.url, model)
                if args.only != "matrix":
                    entry["cost"] = run_cost(server.url, model, args.repeats, server.proc.pid)
                report["depths"][depth] = entry
            finally:
                server.stop()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
