"""Compiled hyper-connections against the ops, paired in one process; one JSON.

The GPU host drifts by more than the difference between settings run in separate
processes, so this alternates the two settings (`hyper_connections.COMPILED`) in one
process, pair after pair, each time measuring the engine's own round costs
(`round_costs.measure_round_costs`: a plain step, verify(k), a draft, whole rounds) on
the DeepSeek-V4-Flash-shaped model of `mtp_cost.py`, and reports per pair the
compiled / ops ratio of each cost, and their medians.

Run: python benchmarks/hc_compile_ab.py [--layers 43] [--pairs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics

from mlxserve.engine.mtp_adapter import MTPAdapter
from mlxserve.engine.round_costs import measure_round_costs
from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device
from mlxserve.models.deepseek_v4 import hyper_connections


def costs_ms(adapter: MTPAdapter, compiled: bool) -> dict[str, float]:
    """The round costs in ms with the hyper-connections compiled or not."""
    hyper_connections.COMPILED = compiled
    costs = measure_round_costs(adapter, context=80, trials=3)
    out = {"plain": costs.plain * 1e3, "draft": costs.draft * 1e3}
    out |= {f"verify{k}": v * 1e3 for k, v in costs.verify.items()}
    out |= {f"round{k}": v * 1e3 for k, v in costs.rounds.items()}
    return out


def main() -> None:
    from mtp_cost import flash_shaped  # beside this file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    configure_cuda_graphs()
    adapter = MTPAdapter(flash_shaped(args.layers, 512, 64, 8192))
    costs_ms(adapter, True)  # warm-up: every shape built once each way
    costs_ms(adapter, False)
    pairs = []
    for n in range(args.pairs):
        order = (True, False) if n % 2 == 0 else (False, True)
        runs = {flag: costs_ms(adapter, flag) for flag in order}
        pairs.append(
            {
                "compiled_ms": runs[True],
                "ops_ms": runs[False],
                "ratio": {k: runs[True][k] / runs[False][k] for k in runs[True]},
            }
        )
    keys = pairs[0]["ratio"].keys()
    print(
        json.dumps(
            {
                "benchmark": "hc_compile_ab",
                "layers": args.layers,
                "device": benchmark_device(),
                "median_ratio_compiled_over_ops": {
                    k: statistics.median(p["ratio"][k] for p in pairs) for k in keys
                },
                "pairs": pairs,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
