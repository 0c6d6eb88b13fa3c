"""Where a verify forward's time goes: each part of a layer at S = 1 .. 6 tokens; one JSON.

On an NVIDIA H200 a verify forward of 2 tokens cost 1.3-1.5 plain steps of 1
(`cuda_graphs.py`) although its graph has only ~6% more nodes, so the extra time is
device work of some part whose kernels change with the query length. This times
every part over all the layers of the DeepSeek-V4-Flash-shaped model of
`mtp_cost.py`, on a cache of `--context` tokens, synced (built, run, waited for):
the attention block by layer kind (sliding, CSA, HCA), the MoE (routed and hash),
the hyper-connections, and the head; plus the host time of building the whole
forward's graph.

Run: python benchmarks/layer_parts.py [--layers 43] [--context 64] [--trials 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx


def timed(run: Callable[[], list[mx.array]], undo: Callable[[], None], trials: int) -> float:
    """Median milliseconds of `run` built and evaluated, after one untimed pass."""
    times = []
    for trial in range(trials + 1):
        start = time.perf_counter()
        mx.eval(run())
        elapsed = time.perf_counter() - start
        undo()
        if trial:
            times.append(elapsed * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--lengths", default="1,2,3,4,5,6")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mtp_cost import flash_shaped

    from mlxserve.engine.spec.costs import throwaway_state
    from mlxserve.engine.spec.mtp import MTPAdapter, trim_exactly
    from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
    from mlxserve.hardware.probe import benchmark_device
    from mlxserve.models.deepseek_v4.hyper_connections import collapse, expand

    configure_cuda_graphs()
    model = flash_shaped(args.layers, 512, 64, 8192)
    adapter = MTPAdapter(model)
    state, _ = throwaway_state(adapter, args.context, max_rollback=8)
    layers = model.layers
    dim = model.args.hidden_size
    hc = model.args.hc_mult
    kinds: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        kinds.setdefault(f"attn_{layer.attn.layer_type}", []).append(i)
        kinds.setdefault("moe_hash" if layer.ffn.gate.hashed else "moe_routed", []).append(i)

    result: dict[str, Any] = {
        "layers": args.layers,
        "context": args.context,
        "device": benchmark_device(),
        "layer_counts": {k: len(v) for k, v in kinds.items()},
        "ms": {},
    }
    for length in (int(s) for s in args.lengths.split(",")):
        x = (mx.random.normal((1, length, dim)) * 0.5).astype(mx.float32)
        streams = mx.broadcast_to(x[:, :, None], (1, length, hc, dim))
        tokens = mx.array([[(31 * i + 11) % 8192 for i in range(length)]], mx.int32)
        mx.eval(x, streams, tokens)

        def untrim(length: int = length) -> None:
            for cache in state.cache:
                trim_exactly(cache, length)

        row: dict[str, float] = {}
        for kind, ids in kinds.items():
            if kind.startswith("attn_"):

                def attend(ids: list[int] = ids, x: mx.array = x) -> list[mx.array]:
                    out = [layers[i].attn(x, state.cache[i]) for i in ids]
                    return out + [a for i in ids for a in state.cache[i].state]

                def undo(ids: list[int] = ids, length: int = length) -> None:
                    for i in ids:
                        trim_exactly(state.cache[i], length)

                row[kind] = timed(attend, undo, args.trials)
            else:

                def ffn(
                    ids: list[int] = ids, x: mx.array = x, tokens: mx.array = tokens
                ) -> list[mx.array]:
                    return [layers[i].ffn(x, tokens) for i in ids]

                row[kind] = timed(ffn, lambda: None, args.trials)

        def connections(x: mx.array = x, streams: mx.array = streams) -> list[mx.array]:
            out = []
            for layer in layers:
                for block in (layer.hc_attn, layer.hc_ffn):
                    pre, post, comb = block(streams)
                    out.append(expand(collapse(streams, pre), streams, post, comb))
            return out

        row["hyper_connections"] = timed(connections, lambda: None, args.trials)
        row["head"] = timed(lambda s=streams: [model.head_from_streams(s)], lambda: None, 5)

        def forward(tokens: mx.array = tokens) -> list[mx.array]:
            hidden = model.forward_hidden(tokens, state.cache)
            return [mx.argmax(model.head_from_streams(hidden), axis=-1), hidden]

        row["whole_forward"] = timed(forward, untrim, args.trials)
        builds = []
        for _ in range(args.trials):
            start = time.perf_counter()
            outputs = forward()
            builds.append((time.perf_counter() - start) * 1e3)
            mx.eval(outputs)
            untrim()
        row["whole_forward_graph_build"] = statistics.median(builds)
        result["ms"][str(length)] = row
        print(json.dumps({length: row}), file=sys.stderr, flush=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
