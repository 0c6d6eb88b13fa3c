"""`benchmarks/decode_parts.py` on a tiny model, so its decode breakdown cannot rot.

The breakdown times a decode layer as a chain of steps that call the model's own
modules; that chain must compute what the layer does (else the parts time other
work), and every step the lead reads must be there with a positive time, byte count
and node count. Timings are reported by the benchmark, never asserted here.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.engine.v4_models import tiny_v4

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

ATTENTION = ["q_path", "kv_path", "keys", "core", "out_rope", "wo_a", "wo_b"]
COMPRESSED = ["projections", "compressor"]
INDEXED = ["indexer_compressor", "indexer_scores", "indexer"]
LAYER = ["hc_enter", "hc_leave_enter", "gate", "routed_experts", "shared_expert", "mix", "hc_leave"]


@pytest.mark.parametrize("rows", [1, 4])
def test_the_chain_is_the_layer_and_every_part_is_timed(rows: int) -> None:
    decode_parts: Any = importlib.import_module("decode_parts")
    model = tiny_v4(seed=2)
    dtype = model.model.embed_tokens.weight.dtype
    for layer in model.layers:
        # 75 tokens: past the window, 18 CSA entries (more than the 4 picked).
        run = decode_parts.breakdown(layer, model.args, rows, 75, 1, dtype)
        assert run["chain_max_abs_diff"] == 0.0
        kind = layer.attn.layer_type
        expected = ATTENTION + LAYER
        if kind != "sliding_attention":
            expected += COMPRESSED
        if kind == "compressed_sparse_attention":
            expected += INDEXED
        assert set(expected) <= set(run["parts"])
        for name in expected:
            part = run["parts"][name]
            assert part["ms"] > 0
            assert part["nodes"] >= (0 if name == "keys" else 1), name
        for name in ("q_path", "kv_path", "wo_a", "wo_b", "gate", "shared_expert"):
            assert run["parts"][name]["weight_bytes"] > 0
        for whole in ("layer", "attention", "moe"):
            assert run[whole]["ms"] > 0 and run[whole]["sum_of_parts_ms"] > 0
