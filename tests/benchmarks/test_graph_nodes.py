"""`benchmarks/graph_nodes.py`'s count of a GPU's graph on a CPU: each fast op, each
Sinkhorn and each call of the CUDA hyper-connection kernel one node, and the kernel
left out on request (what Metal runs)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx

from tests.engine.v4_models import tiny_v4

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def _decode_counts(hc_kernel: bool) -> list[Any]:
    graph_nodes: Any = importlib.import_module("graph_nodes")
    model = tiny_v4(seed=1, hc_mult=4)
    with graph_nodes.fast_ops_as_one_node(model.args, hc_kernel=hc_kernel):
        caches = graph_nodes.prefilled_rows(model, 1, 20, margin=0)
        return list(graph_nodes.decode_layer_counts(model, caches, mx.array([[5]])))


def test_the_kernel_is_one_node_per_entry_and_takes_the_norms_in() -> None:
    with_kernel, without = _decode_counts(hc_kernel=True), _decode_counts(hc_kernel=False)
    for ours, theirs in zip(with_kernel, without, strict=True):
        # The attention's entry, and its exit joined to the FFN's entry.
        assert ours["CustomKernel(HyperConnection)"] == 2
        assert ours["CustomKernel(Sinkhorn)"] == 0
        # Each entry's RMSNorm of the streams and each block's norm are in the kernel.
        assert ours["RMSNorm"] == theirs["RMSNorm"] - 4
        assert theirs["CustomKernel(HyperConnection)"] == 0
        assert theirs["CustomKernel(Sinkhorn)"] == 2
