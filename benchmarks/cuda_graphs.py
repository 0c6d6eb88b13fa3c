"""Step and round costs under MLX CUDA's graph settings; prints one JSON document.

MLX's CUDA backend records kernels into CUDA graphs: it commits a graph every
`MLX_MAX_OPS_PER_BUFFER` operations (20 by default), keys each by its topology, and
keeps `MLX_CUDA_GRAPH_CACHE_SIZE` instantiated graphs (100 by default), clearing the
whole cache when it overflows. A 43-layer DeepSeek-V4-shaped decode step is some
8,000 operations, so ~400 commits a step: if the step holds more distinct
topologies than the cache, every commit instantiates a graph anew on the host.
`MLX_USE_CUDA_GRAPHS=0` launches kernels directly instead.

Each setting runs in a process of its own (MLX reads them once per process): the
engine's own calibration (`round_costs.measure_round_costs`: a plain step pipelined,
verify(k), a draft, whole rounds at depth k) on the Flash-shaped model of
`mtp_cost.py` and on the demo model, plus the plain step's host share.

Run (on an NVIDIA GPU): python benchmarks/cuda_graphs.py [--layers 43] [--settings stock,...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mlxserve.hardware.cuda_graphs import CUDA_GRAPH_SETTINGS

#: the variables a setting may set: taken out of the inherited environment first
KNOBS = ("MLX_CUDA_GRAPH_CACHE_SIZE", "MLX_MAX_OPS_PER_BUFFER", "MLX_USE_CUDA_GRAPHS")
#: name -> environment (MLX's own defaults but for these; "mlxserve": what the CLI sets,
#: `mlxserve.hardware.cuda_graphs`)
SETTINGS: dict[str, dict[str, str]] = {
    "stock": {},
    "mlxserve": dict(CUDA_GRAPH_SETTINGS),
    "cache4096": {"MLX_CUDA_GRAPH_CACHE_SIZE": "4096"},
    "cache4096_ops64": {"MLX_CUDA_GRAPH_CACHE_SIZE": "4096", "MLX_MAX_OPS_PER_BUFFER": "64"},
    "cache4096_ops200": {"MLX_CUDA_GRAPH_CACHE_SIZE": "4096", "MLX_MAX_OPS_PER_BUFFER": "200"},
    "no_graphs": {"MLX_USE_CUDA_GRAPHS": "0"},
}


def child(layers: int, trials: int) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mtp_cost import flash_shaped, host_and_device

    from mlxserve.engine.core.build import materialize
    from mlxserve.engine.spec.costs import measure_round_costs
    from mlxserve.engine.spec.mtp import MTPAdapter
    from mlxserve.hardware.probe import benchmark_device
    from mlxserve.models import load

    out: dict[str, Any] = {"device": benchmark_device()}
    demo, _ = load("demo")
    materialize(demo)
    models = {"flash_shaped": flash_shaped(layers, 512, 64, 8192), "demo": demo}
    for name, model in models.items():
        adapter = MTPAdapter(model)
        began = time.perf_counter()
        costs = measure_round_costs(adapter, trials=trials)
        ms = 1e3
        out[name] = {
            "plain_ms": costs.plain * ms,
            "verify_ms": {k: v * ms for k, v in costs.verify.items()},
            "draft_ms": costs.draft * ms,
            "round_ms": {k: v * ms for k, v in costs.rounds.items()},
            "round_over_plain": {k: v / costs.plain for k, v in costs.rounds.items()},
            "calibration_s": time.perf_counter() - began,
            "host_and_device": host_and_device(adapter, 64),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--out", help="also write the JSON document here")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per setting")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.layers, args.trials)))
        return
    results: dict[str, Any] = {"layers": args.layers, "trials": args.trials, "settings": {}}
    for name in args.settings.split(","):
        env = {k: v for k, v in os.environ.items() if k not in KNOBS}
        env.update(SETTINGS[name])
        command = [sys.executable, __file__, "--child", "--layers", str(args.layers)]
        command += ["--trials", str(args.trials)]
        began = time.perf_counter()
        try:
            done = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=args.timeout, check=False
            )
            failed = {"error": done.stderr[-800:]}
            entry: dict[str, Any] = json.loads(done.stdout) if done.returncode == 0 else failed
        except subprocess.TimeoutExpired:
            entry = {"error": f"no answer in {args.timeout:.0f} s"}
        entry["env"] = SETTINGS[name]
        entry["wall_s"] = time.perf_counter() - began
        results["settings"][name] = entry
        print(json.dumps({name: entry}), file=sys.stderr, flush=True)
    document = json.dumps(results, indent=1)
    if args.out:
        Path(args.out).write_text(document + "\n")
    print(document)


if __name__ == "__main__":
    main()
