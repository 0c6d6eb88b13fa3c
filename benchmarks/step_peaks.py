"""Which engine steps make the demo's memory peak; prints one JSON document.

The demo's memory target (peak at 8 clients <= 1.2 x weights + caches) is missed on
the H200 (1.35x; 1.15x on this CPU). This runs the engine as ``mlxserve serve`` runs
the demo (automatic depth, batched speculation for small batches, no prefix cache),
``--clients`` requests of different prompt lengths submitted at once, ``--repeats``
times, and for every step resets MLX's peak before it and reads it after it. Per kind
of step (a prefill chunk, a plain decode of n rows, a speculative round of n rows at
depth k) it reports how many ran, and the largest peak during one of them: absolute
and above the memory active just before it. Steps are not synchronized, as in the
engine: the peak during a step includes the previous step's buffers still in flight,
which is what the engine holds. Also: the weights' bytes and the largest peak overall.

``--prefill-queue-every N`` sets how often a prefill chunk is queued for the device
(the tuning's ``prefill_queue_every_layers``; 0: evaluated in one piece, as before stop
22), so both ways can be compared on one machine.

``--model flash`` runs a DeepSeek-V4-Flash-shaped model instead (`mtp_cost.flash_shaped`:
43 layers and an MTP block, hc_mult 4, 4-bit experts, FP8 projections as mxfp8, random
weights; ``--hidden``, ``--experts`` and ``--vocab`` size it). The demo's 2.9 MB of
weights are smaller than one step's activations on a GPU; this shows the ratio where
weights and caches have a real model's proportions. Either way ``ratio`` is the
largest peak over the weights plus ``--clients`` times the largest cache a request
reported at its end (the issue's memory target), and ``caches_ratio`` the part above
the weights over those caches.

Run: python benchmarks/step_peaks.py [--clients 8] [--tokens 64] [--repeats 2]
[--prefill-queue-every 1] [--model demo|flash] [--hidden 512] [--experts 64]
[--vocab 8192]
"""

import argparse
import json
from typing import Any

import mlx.core as mx
from batch_step import demo_engine, engine_rate
from mlx.utils import tree_flatten
from step_hook import Around, Run, around_steps

from mlxserve.engine.core.step import Step
from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device
from mlxserve.hardware.tuning import default_tuning


def kind_of(step: Step) -> str:
    rows = len(step.request_ids)
    if step.kind == "prefill":
        return f"prefill {step.num_tokens} tokens"
    if step.kind == "decode":
        return f"decode {rows} rows"
    return f"speculate {rows} rows depth {step.num_tokens}"


def peak_recorder(peaks: dict[str, dict[str, Any]]) -> Around:
    """What goes around every step (`step_hook.around_steps`) to fill `peaks`."""

    def measured(run: Run, step: Step, sequences: Any) -> Any:
        active = mx.get_active_memory()
        mx.reset_peak_memory()
        emitted = run(step, sequences)
        peak = mx.get_peak_memory()
        entry = peaks.setdefault(kind_of(step), {"count": 0, "peak": 0, "over_active": 0})
        entry["count"] += 1
        entry["peak"] = max(entry["peak"], peak)
        entry["over_active"] = max(entry["over_active"], peak - active)
        return emitted

    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--context", type=int, default=40, help="the shortest prompt")
    parser.add_argument(
        "--prefill-queue-every",
        type=int,
        default=default_tuning().prefill_queue_every_layers,
        help="queue a prefill chunk after every N layers (0: in one piece)",
    )
    parser.add_argument("--model", choices=["demo", "flash"], default="demo")
    parser.add_argument("--hidden", type=int, default=512, help="flash: width")
    parser.add_argument("--experts", type=int, default=64, help="flash: routed experts")
    parser.add_argument("--vocab", type=int, default=8192, help="flash: vocabulary (> 1006)")
    args = parser.parse_args()
    if min(args.clients, args.tokens, args.repeats, args.context) < 1:
        parser.error("--clients, --tokens, --repeats and --context must be >= 1")
    if args.hidden < 64 or args.hidden % 64 or args.experts < 6 or args.vocab <= 1006:
        parser.error(
            "--hidden must be a multiple of 64, --experts >= 6, --vocab > 1006 (the prompts' ids)"
        )
    if args.prefill_queue_every < 0:
        parser.error("--prefill-queue-every must be >= 0")
    configure_cuda_graphs()  # as the CLI does, before any device work

    from mlxserve.engine.core.build import materialize
    from mlxserve.models import load

    if args.model == "flash":
        from mtp_cost import flash_shaped  # beside this file

        model = flash_shaped(43, args.hidden, args.experts, args.vocab)
    else:
        model, _ = load("demo")
        materialize(model)
    parameters = tree_flatten(model.parameters())
    assert isinstance(parameters, list)
    weights = sum(int(a.nbytes) for _, a in parameters)
    tuning = default_tuning().replace(prefill_queue_every_layers=args.prefill_queue_every)
    engine = demo_engine(model, args.clients, tuning)
    engine_rate(engine, args.clients, 8, args.context)  # untimed: calibration, compiling
    peaks: dict[str, dict[str, Any]] = {}
    caches: list[int] = []
    with around_steps(engine, peak_recorder(peaks)):
        for _ in range(args.repeats):
            engine_rate(
                engine,
                args.clients,
                args.tokens,
                args.context,
                lambda finish: caches.append(int((finish.memory or {}).get("cache_bytes", 0))),
            )
    top = max(entry["peak"] for entry in peaks.values())
    budget = weights + args.clients * max(caches)
    result = {
        "device": benchmark_device(),
        "model": args.model,
        "clients": args.clients,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "prefill_queue_every": args.prefill_queue_every,
        "context": args.context,
        **(
            {"hidden": args.hidden, "experts": args.experts, "vocab": args.vocab}
            if args.model == "flash"
            else {}
        ),
        "weights_bytes": weights,
        "one_request_cache_bytes": max(caches),
        "largest_peak_bytes": top,
        "ratio": round(top / budget, 3),
        "caches_ratio": round((top - weights) / (args.clients * max(caches)), 3),
        "steps": dict(sorted(peaks.items(), key=lambda item: -item[1]["peak"])),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
