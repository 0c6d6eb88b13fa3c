"""How many graph nodes a decode step and a verify forward make, by primitive; one JSON.

A small-batch GPU step is bound by launches and by the host building and queuing
them, so the node count of one forward is the number to drive down. This builds a
DeepSeek-V4-Flash-shaped model (`mtp_cost.flash_shaped`), prefills it, then exports
the lazy graph of one forward of S tokens (and the head) with `mx.export_to_dot` and
counts its nodes by primitive, views (reshapes, slices, broadcasts: no kernel) apart.
The graph is the default device's: on a CPU, MLX's fast ops (RMSNorm, RoPE, SDPA)
decompose into many ops, so run it where the numbers matter (the GPU).

Run: python benchmarks/graph_nodes.py [--layers 43] [--tokens 1,2,6] [--hc-ops]
                                      [--masked-attention]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxserve.engine.spec.mtp import MTPAdapter, trim_exactly
from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device
from mlxserve.hardware.tuning import default_tuning

VIEWS = frozenset(
    [
        "Reshape",
        "ExpandDims",
        "Squeeze",
        "Broadcast",
        "Transpose",
        "Slice",
        "Unflatten",
        "Flatten",
        "StopGradient",
    ]
)


def count_nodes(outputs: list[Any]) -> collections.Counter[str]:
    """Nodes of the graph that computes `outputs`, by primitive name."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "graph.dot"
        mx.export_to_dot(str(path), *outputs)
        labels = re.findall(r'label\s*=\s*"([^"]+)"', path.read_text())
    return collections.Counter(label.split()[0] for label in labels)


def main() -> None:
    from mtp_cost import flash_shaped  # beside this file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--tokens", default="1,2,6", help="forward lengths S, comma-separated")
    parser.add_argument("--hc-ops", action="store_true", help="hyper-connections as ops")
    parser.add_argument(
        "--masked-attention", action="store_true", help="one masked attention call per forward"
    )
    args = parser.parse_args()
    tuning = default_tuning()
    if args.hc_ops:
        tuning = tuning.replace(compiled_hc_max_rows=0)
    if args.masked_attention:
        tuning = tuning.replace(split_attention_queries=False)
    configure_cuda_graphs()
    model = flash_shaped(args.layers, 512, 64, 8192)
    adapter = MTPAdapter(model)
    adapter.tune(tuning)
    state = adapter.new_state(max_rollback=8)
    adapter.prefill(state, list(range(1, 65)))
    forwards = {}
    for length in (int(t) for t in args.tokens.split(",")):
        streams = model.forward_hidden(mx.arange(3, 3 + length)[None], state.cache)
        logits = model.head_from_streams(streams)
        counts = count_nodes([logits, *[c.state for c in state.cache]])
        mx.eval(logits, [c.state for c in state.cache])
        for cache in state.cache:
            trim_exactly(cache, length)
        kernels = {k: v for k, v in counts.items() if k not in VIEWS}
        forwards[str(length)] = {
            "nodes": sum(counts.values()),
            "non_view_nodes": sum(kernels.values()),
            "non_view_per_layer": sum(kernels.values()) / args.layers,
            "by_primitive": dict(sorted(kernels.items(), key=lambda kv: -kv[1])),
        }
    print(
        json.dumps(
            {
                "benchmark": "graph_nodes",
                "layers": args.layers,
                "hyper_connections_compiled": not args.hc_ops,
                "attention_split_per_query": tuning.split_attention_queries,
                "device": benchmark_device(),
                "forwards": forwards,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
