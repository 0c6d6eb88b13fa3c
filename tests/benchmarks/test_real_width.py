"""`benchmarks/real_width.py`'s prefill on a tiny model, so its memory report cannot rot.

A seeded cache (`prefill_attention.seed_cache`) must be the cache a real prefill
leaves, in every array's shape and dtype (else a seeded chunk at 100K measures
another working set), and the prefill report must carry what the 100K target reads:
the peak against the weights and the cache, the prefill's working set and the first
decode step. Timings are reported by the benchmark, never asserted here.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from tests.engine.v4_models import tiny_v4

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def _layout(cache: Any) -> list[tuple[str, tuple[int, ...], str]]:
    arrays = [("window", cache.window)] if cache.window is not None else []
    for name, state in cache.compressors.items():
        arrays += [(f"{name}.kv", state.raw_kv), (f"{name}.gate", state.raw_gate)]
        arrays += [(f"{name}.entries", state.entries), (f"{name}.start", state.raw_start)]
    return [
        (name, tuple(a.shape), str(a.dtype)) if isinstance(a, mx.array) else (name, (), str(a))
        for name, a in arrays
    ]


@pytest.mark.parametrize("context", [3, 19, 75])
def test_a_seeded_cache_is_a_prefills_cache(context: int) -> None:
    attention: Any = importlib.import_module("prefill_attention")
    model = tiny_v4(seed=2)
    cache = model.make_cache()
    mx.eval(model(mx.array([[(5 * i) % 61 for i in range(context)]]), cache))
    for layer, real in zip(model.layers, cache, strict=True):
        seeded = attention.seed_cache(layer.attn, context, mx.random.key(0), mx.float32)
        assert seeded.offset == real.offset == context
        assert _layout(seeded) == _layout(real)
        assert seeded.nbytes == real.nbytes


def test_the_prefill_report_holds_the_memory_target_inputs() -> None:
    real_width: Any = importlib.import_module("real_width")
    model = tiny_v4(seed=2)
    for seeded in (False, True):
        run = real_width.prefill(model, 40, 16, seeded=seeded)
        assert run["first_position"] == (32 if seeded else 0)
        assert run["tokens"] == 40 - run["first_position"]
        assert run["working_set_gb"] > 0
        assert run["peak_memory_gb"] >= max(run["prefill_peak_gb"], run["first_step_peak_gb"])
        assert run["cache_gb"] > 0


def test_chunk_flops_add_up_over_chunks() -> None:
    real_width: Any = importlib.import_module("real_width")
    model = tiny_v4(seed=2)
    whole = real_width.chunk_flops(model, 0, 96)
    parts = sum(real_width.chunk_flops(model, lo, lo + 32) for lo in (0, 32, 64))
    assert whole == pytest.approx(parts)
    # A query past the window sees `sliding_window` rows, not its whole prefix.
    args = model.args
    late = real_width.attention_flops(args, "sliding_attention", 500, 501)
    assert late == 4 * args.num_attention_heads * args.head_dim * args.sliding_window


@pytest.mark.parametrize("rows", [1, 3])
def test_decode_is_timed_synced_and_pipelined(rows: int) -> None:
    real_width: Any = importlib.import_module("real_width")
    model = tiny_v4(seed=2)
    synced, pipelined = real_width.decode_steps(model, rows, 12, 3)
    assert synced > 0 and pipelined > 0
