"""The hyper-connections' Sinkhorn on this device: the shipped path against the op loop.

The shipped path (``mlxserve.kernels.sinkhorn``) is one CUDA launch on CUDA, the
loop under ``mx.compile`` on a CPU, mlx-lm's Metal kernel on a Mac. Prints one JSON
document:
- per matrix count, the largest difference between the shipped path and mlx-lm's
  op loop, and each one's time per call;
- a decode step and whole speculative rounds of the demo and of a
  DeepSeek-V4-Flash-shaped model (`benchmarks/mtp_cost.py`'s), with the model's
  Sinkhorn as it ships (`shipped`) and as the op loop (`loop`), timed as the engine's
  calibration times them (`round_costs.measure_round_costs`), plus whether greedy
  decoding gives the same tokens both ways.

Run: python benchmarks/sinkhorn.py [--layers 12] [--steps 8] [--clock cpu]
(12 layers by default: on the H200 the 43-layer model with the op loop, whose
calibrations time every depth both ways, did not finish in 150 s)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.deepseek_v41 import _sinkhorn as loop_sinkhorn

import mlxserve.models.deepseek_v4.hyper_connections as hyper_connections
from mlxserve.engine.spec.costs import measure_round_costs
from mlxserve.engine.spec.mtp import MTPAdapter
from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.device import on_cpu, on_cuda
from mlxserve.hardware.probe import benchmark_device
from mlxserve.kernels.sinkhorn import fast_path_agrees, sinkhorn

sys.path.insert(0, str(Path(__file__).parent))
from mtp_cost import flash_shaped

EPS = mx.array([1e-6], dtype=mx.float32)


def per_call_s(function: Callable[[mx.array], mx.array], comb: mx.array, calls: int) -> float:
    mx.eval(function(comb))
    start = time.perf_counter()
    for _ in range(calls):
        mx.eval(function(comb))
    return (time.perf_counter() - start) / calls


def shipped_against_loop(counts: list[int]) -> list[dict[str, Any]]:
    rows = []
    for count in counts:
        comb = mx.softmax(mx.random.normal((count, 4, 4), key=mx.random.key(count)), -1) + 1e-6
        ours = sinkhorn(comb, iters=20, eps=EPS)
        loop = loop_sinkhorn(comb, iters=20, eps=EPS)
        rows.append(
            {
                "matrices": count,
                "max_abs_difference": mx.abs(ours - loop).max().item(),
                "shipped_call_us": 1e6
                * per_call_s(lambda c: sinkhorn(c, iters=20, eps=EPS), comb, 50),
                "loop_call_us": 1e6
                * per_call_s(lambda c: loop_sinkhorn(c, iters=20, eps=EPS), comb, 50),
            }
        )
    return rows


@contextmanager
def model_sinkhorn(function: Callable[..., mx.array]) -> Iterator[None]:
    """The model's hyper-connections use `function` for the duration."""
    shipped = getattr(hyper_connections, "sinkhorn")  # noqa: B009 (not re-exported)
    setattr(hyper_connections, "sinkhorn", function)  # noqa: B010
    try:
        yield
    finally:
        setattr(hyper_connections, "sinkhorn", shipped)  # noqa: B010


def greedy_tokens(model: Any, steps: int) -> list[int]:
    adapter = MTPAdapter(model)
    state = adapter.new_state(max_rollback=2)
    vocab = int(model.args.vocab_size)
    adapter.prefill(state, [(7 * i + 3) % vocab for i in range(24)])
    token, out = mx.array([1], mx.int32), []
    for _ in range(steps):
        token = mx.argmax(adapter.step(state, token)).reshape(1)
        out.append(cast(int, token.item()))
    return out


def model_figures(name: str, model: Any, steps: int, clock: Callable[[], float]) -> dict[str, Any]:
    figures: dict[str, Any] = {"model": name}
    tokens = {}
    for label, function in (("shipped", sinkhorn), ("loop", loop_sinkhorn)):
        with model_sinkhorn(function):
            adapter = MTPAdapter(model)
            costs = measure_round_costs(adapter, trials=7, context=48, parts=False, clock=clock)
            tokens[label] = greedy_tokens(model, steps)
        figures[label] = {
            "plain_step_ms": costs.plain * 1e3,
            "round_ms": {str(k): v * 1e3 for k, v in costs.rounds.items()},
        }
    figures["loop_over_shipped_step"] = (
        figures["loop"]["plain_step_ms"] / figures["shipped"]["plain_step_ms"]
    )
    figures["greedy_tokens_equal"] = tokens["shipped"] == tokens["loop"]
    return figures


def shipped_path() -> str:
    if on_cuda():
        return "cuda kernel" if fast_path_agrees("cuda", 4, 20) else "op loop (kernel refused)"
    if on_cpu():
        return "compiled loop" if fast_path_agrees("compiled", 4, 20) else "op loop"
    return "mlx-lm (Metal kernel on a Mac)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="the Flash-shaped model's layers")
    parser.add_argument("--steps", type=int, default=8, help="greedy steps compared")
    parser.add_argument("--skip-flash", action="store_true")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall clock, or this process's CPU time (a CPU shared with other work)",
    )
    args = parser.parse_args()
    configure_cuda_graphs()  # as the CLI does, before any device work
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    from mlxserve.models.demo import load_demo

    report: dict[str, Any] = {
        "benchmark": "sinkhorn",
        "device": benchmark_device(),
        "clock": args.clock,
        "layers": None if args.skip_flash else args.layers,
        "steps": args.steps,
        "shipped_path": shipped_path(),
        "shipped_against_loop": shipped_against_loop([1, 8, 64, 4096]),
    }
    demo, _ = load_demo()
    report["models"] = [model_figures("demo", demo, args.steps, clock)]
    if not args.skip_flash:
        flash = flash_shaped(args.layers, 512, 64, 8192)
        report["models"].append(
            model_figures(f"flash-shaped {args.layers} layers", flash, args.steps, clock)
        )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
