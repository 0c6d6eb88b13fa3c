"""One setting on against off, paired in one process; one JSON.

The GPU host drifts by more than the difference between settings run in separate
processes, so this alternates the two values of one setting in one process, pair
after pair, each time measuring the engine's own round costs
(`round_costs.measure_round_costs`: a plain step, verify(k), a draft, whole rounds) on
the DeepSeek-V4-Flash-shaped model of `mtp_cost.py`, and reports per pair the
on / off ratio of each cost, and their medians. Settings:

- `hc-compiled`: the hyper-connections' `enter` and `leave` under `mx.compile`
  (the tuning's `compiled_hc_max_rows`, against 0: the ops);
- `split-attention`: a verify forward's attention as one unmasked call per query
  (the tuning's `split_attention_queries`) against one masked call.

Run: python benchmarks/setting_ab.py [--setting hc-compiled] [--layers 43] [--pairs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

from mlxserve.engine.spec.costs import measure_round_costs
from mlxserve.engine.spec.mtp import MTPAdapter
from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device
from mlxserve.hardware.tuning import EngineTuning, default_tuning


def _hc_compiled(on: bool) -> EngineTuning:
    tuning = default_tuning()
    return tuning if on else tuning.replace(compiled_hc_max_rows=0)


def _split_attention(on: bool) -> EngineTuning:
    return default_tuning().replace(split_attention_queries=on)


SETTINGS: dict[str, Callable[[bool], EngineTuning]] = {
    "hc-compiled": _hc_compiled,
    "split-attention": _split_attention,
}


def costs_ms(
    adapter: MTPAdapter, apply: Callable[[bool], EngineTuning], on: bool
) -> dict[str, float]:
    """The round costs in ms with the setting on or off."""
    adapter.tune(apply(on))
    costs = measure_round_costs(adapter, context=80, trials=3)
    out = {"plain": costs.plain * 1e3, "draft": costs.draft * 1e3}
    out |= {f"verify{k}": v * 1e3 for k, v in costs.verify.items()}
    out |= {f"round{k}": v * 1e3 for k, v in costs.rounds.items()}
    return out


def main() -> None:
    from mtp_cost import flash_shaped  # beside this file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="hc-compiled")
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    configure_cuda_graphs()
    apply = SETTINGS[args.setting]
    adapter = MTPAdapter(flash_shaped(args.layers, 512, 64, 8192))
    costs_ms(adapter, apply, True)  # warm-up: every shape built once each way
    costs_ms(adapter, apply, False)
    pairs = []
    for n in range(args.pairs):
        order = (True, False) if n % 2 == 0 else (False, True)
        runs = {flag: costs_ms(adapter, apply, flag) for flag in order}
        pairs.append(
            {
                "on_ms": runs[True],
                "off_ms": runs[False],
                "ratio": {k: runs[True][k] / runs[False][k] for k in runs[True]},
            }
        )
    keys = pairs[0]["ratio"].keys()
    print(
        json.dumps(
            {
                "benchmark": "setting_ab",
                "setting": args.setting,
                "layers": args.layers,
                "device": benchmark_device(),
                "median_ratio_on_over_off": {
                    k: statistics.median(p["ratio"][k] for p in pairs) for k in keys
                },
                "pairs": pairs,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
