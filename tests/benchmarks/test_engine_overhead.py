"""`benchmarks/engine_overhead.py` at a tiny size, so the measurement cannot rot.

Asserted: what the benchmark claims beyond timings: the engine at depth 0 decodes the
same greedy tokens as the bare loops it is timed against, and every part reports
(timings are reported by the benchmark, never asserted here).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_vlm.models.cache", reason="vs_mlx_vlm's loops import it")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_engine_and_bare_loops_decode_the_same_tokens() -> None:
    overhead: Any = importlib.import_module("engine_overhead")
    args = argparse.Namespace(
        layers=3,
        hidden=128,
        experts=8,
        vocab=256,
        prompt=12,
        tokens=6,
        rounds=1,
        profile=1,
        null_tokens=20,
    )
    result = overhead.measure(args)
    assert result["greedy_tokens_agree"] == {"batch_of_one": True, "one_sequence": True}
    rates = result["decode_tok_s"]
    assert set(rates) == {"engine", "batch_of_one", "one_sequence", "engine_steady"}
    assert all(rate > 0 for rate in rates.values())
    assert result["null_model"]["engine_us_per_token"] > 0
    assert result["profile"]["tokens"] == args.tokens
    assert result["profile"]["own_ms_per_token_by_area"]["engine"] > 0
