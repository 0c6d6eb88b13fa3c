"""`benchmarks/vs_mlx_vlm.py` at a tiny size, so the head-to-head cannot rot.

It runs the script's core (`compare`) on a 3-layer Flash-shaped model: both loaders
read the one published directory (with its MTP block; with a DSpark head), both sides
decode, draft with MTP and DSpark, and count graph nodes. Asserted: what the benchmark
claims beyond timings (tokens agree across loaders on the CSA-free variant, speculative
output equals depth 0 on each side, the node counts are real). Timings are reported by
the benchmark, never asserted here.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_vlm.utils", reason="mlx-vlm is the benchmark's opponent")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_compare_runs_both_sides_on_one_checkpoint() -> None:
    vs: Any = importlib.import_module("vs_mlx_vlm")
    tokens = 6
    args = argparse.Namespace(
        layers=3,
        hidden=128,
        experts=8,
        vocab=256,
        prompt=12,
        tokens=tokens,
        demo_tokens=tokens,
        agreement_tokens=12,
        repeats=1,
        block=2,
        stages=1,
        groups="flash",
        budget_s=60.0,
    )
    flash = vs.compare(args)["groups"]["flash"]
    ours, theirs = flash["mlxserve"], flash["mlx_vlm"]
    for side in (ours, theirs):
        assert side["depth0"]["decode_tok_s"] > 0 and side["depth0"]["ttft_s"] > 0
        assert len(side["depth0"]["tokens"]) == tokens
        for name, run in side.items():  # greedy speculation is lossless on each side
            if name.startswith(("mtp_", "dspark_")) and "tokens" in run:
                assert run["tokens"] == side["depth0"]["tokens"], name
    assert {"mtp_1", "mtp_auto", "dspark_auto", "dspark_2"} <= set(ours)
    assert any(name.startswith("mtp_") for name in theirs)
    nodes = flash["graph_nodes_per_decode_step"]
    assert nodes["mlxserve"]["one_sequence"]["non_view_nodes"] > 0
    assert nodes["mlx_vlm"]["non_view_nodes"] > 0
    assert flash["greedy_depth0_agree_csa_free_variant"]["identical"]
    assert flash["ratios"]["depth0_mlxserve_over_mlx_vlm"] > 0
