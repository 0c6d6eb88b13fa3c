"""`benchmarks/vs_mlx_vlm.py` at a tiny size, so the head-to-head cannot rot.

It runs the script's core (`compare`) on a 3-layer Flash-shaped model: both loaders
read the one published directory, both sides decode, draft with MTP and count graph
nodes. Asserted: what the benchmark claims beyond timings (tokens agree across
loaders on the CSA-free variant, speculative output equals depth 0 on each side, the
node counts are real). Timings are reported by the benchmark, never asserted here.
"""

from __future__ import annotations

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
    result = vs.compare(
        layers=3,
        hidden=128,
        experts=8,
        vocab=256,
        prompt_tokens=12,
        tokens=tokens,
        repeats=1,
        depths=(1, "auto"),
        agreement_tokens=12,
    )
    ours, theirs = result["mlxserve"], result["mlx_vlm"]
    for side in (ours, theirs):
        assert side["depth0"]["decode_tok_s"] > 0 and side["depth0"]["ttft_s"] > 0
        assert len(side["depth0"]["tokens"]) == tokens
        assert side["graph_nodes_per_decode_step"]["non_view_nodes"] > 0
        assert "not_run" in side["dspark"]
        for run in side["mtp"].values():
            if isinstance(run, dict) and "tokens" in run:  # greedy speculation is lossless
                assert run["tokens"] == side["depth0"]["tokens"]
    assert set(ours["mtp"]) == {"1", "auto"}
    assert any(key.startswith("depth") for key in theirs["mtp"])
    assert result["greedy_depth0_agree"]["csa_free_variant"]["identical"]
    assert result["ratios"]["depth0_mlxserve_over_mlx_vlm"] > 0
