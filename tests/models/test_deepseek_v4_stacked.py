"""DeepSeek-V4 stacked decode rows (``stacked.py``) against the row-by-row path.

Rows of different lengths (below and past the sliding window, at every phase of the
compressors' windows, with and without the indexer picking a subset) take one-token
steps stacked and, on a second set of caches, row by row (``RowCaches``); the logits
agree to float32 rounding while a row leaves (with its own copy of its caches, which
decodes on alone) and one joins the stack, and the written-back caches equal the
row-by-row ones, rollback margin included (a trim afterwards still decodes exactly).
"""

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxserve.engine.core.build import materialize
from mlxserve.engine.runner.adapter import PlainState
from mlxserve.engine.runner.batch import RowBatch
from mlxserve.models.deepseek_v4 import Model
from mlxserve.models.deepseek_v4.cache import LayerCache, RowCaches
from tests.engine.v4_models import tiny_v4

ATOL = 1e-4


def prompt(row: int, length: int) -> list[int]:
    return [(7 * i + 5 * row + 1) % 61 for i in range(length)]


def prefilled(model: Model, lengths: list[int], margin: int) -> list[list[LayerCache]]:
    caches = []
    for row, length in enumerate(lengths):
        cache = model.make_cache(margin)
        model(mx.array([prompt(row, length)]), cache=cache)
        mx.eval([layer.state for layer in cache])
        caches.append(cache)
    return caches


def per_row_step(model: Model, caches: list[list[LayerCache]], tokens: mx.array) -> mx.array:
    layers = [RowCaches(list(layer)) for layer in zip(*caches, strict=True)]
    logits: mx.array = model(tokens[:, None], cache=layers)
    return logits[:, -1]


def assert_same_caches(ours: list[LayerCache], theirs: list[LayerCache]) -> None:
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.offset == reference.offset
        for name, state in mine.compressors.items():
            assert state.raw_start == reference.compressors[name].raw_start
        for a, b in zip(mine.state, reference.state, strict=True):
            assert a.shape == b.shape
            assert mx.allclose(a, b, atol=ATOL).item()


@pytest.fixture(scope="module")
def models() -> dict[str, Model]:
    built = {
        "tiny": tiny_v4(),
        # a short window, the indexer's subset of 2 and a compressed layer of ratio 8
        "narrow": tiny_v4(
            seed=1,
            sliding_window=5,
            index_topk=2,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        ),
    }
    for model in built.values():
        materialize(model)  # private arrays (RoPE, group ids) too: steady graphs to count
    return built


@pytest.mark.parametrize("name", ["tiny", "narrow"])
@pytest.mark.parametrize("margin", [0, 3])
def test_stacked_steps_match_rows(models: dict[str, Model], name: str, margin: int) -> None:
    model = models[name]
    lengths = [1, 6, 19, 33]
    stacked_caches = prefilled(model, lengths, margin)
    row_caches = prefilled(model, lengths, margin)
    if margin:  # rows that rolled back (a speculative round) hold fewer rows than usual
        for caches in (stacked_caches[2:], row_caches[2:]):
            for cache in caches:
                for layer in cache:
                    layer.trim(margin)
    batch = RowBatch(model, [PlainState(c) for c in stacked_caches])
    tokens = mx.array([3, 7, 11, 13], dtype=mx.int32)
    worst = 0.0
    left: Any = None
    for step in range(22):  # past the window, across both compressors' boundaries
        ours = batch.step(tokens)
        theirs = per_row_step(model, row_caches, tokens)
        assert batch.stacked
        worst = max(worst, mx.abs(ours - theirs).max().item())
        tokens = mx.argmax(theirs, axis=-1).astype(mx.int32)
        if step == 0:  # written back a step after stacking: the rows' own caches, exactly
            batch.settle()
            for mine, reference in zip(batch.states, row_caches, strict=True):
                assert_same_caches(mine.cache, reference)
        if step == 9:  # the first row leaves, a new one joins; the others stay stacked
            left = batch.row_state(0)
            batch.keep([1, 2, 3])
            assert_same_caches(left.cache, row_caches[0])
            alone = row_caches.pop(0)
            batch.join([PlainState(prefilled(model, [26], margin)[0])])
            row_caches.append(prefilled(model, [26], margin)[0])
            assert batch.stacked
            tokens = mx.concatenate([tokens[1:], mx.array([17], dtype=mx.int32)])
    assert worst < ATOL
    # The row that left decodes on its own, as its reference does.
    again = model(mx.array([[5]]), cache=left.cache)
    assert mx.allclose(again, model(mx.array([[5]]), cache=alone), atol=ATOL).item()
    state: Any = batch.row_state(0)  # written back
    batch.settle()
    for row, caches in enumerate(row_caches):
        assert_same_caches(batch.states[row].cache, caches)
    if margin:  # the written-back rows keep their rollback margin: trim, decode again
        for cache in (state.cache, row_caches[0]):
            for layer in cache:
                layer.trim(margin)
        again = model(mx.array([[5]]), cache=state.cache)
        reference = model(mx.array([[5]]), cache=row_caches[0])
        assert mx.allclose(again, reference, atol=ATOL).item()


def test_stacked_rows_take_one_token_each(models: dict[str, Model]) -> None:
    model = models["tiny"]
    caches = prefilled(model, [4, 9], 0)
    layers = [LayerCache.stack(list(layer)) for layer in zip(*caches, strict=True)]
    with pytest.raises(ValueError, match="one token for each of their 2 rows"):
        model(mx.array([[1, 2], [3, 4]]), cache=layers)


def test_rows_without_a_window_are_not_stacked(models: dict[str, Model]) -> None:
    """A row that has seen nothing does not stack: the batch steps row by row."""
    model = models["tiny"]
    fresh = model.make_cache()
    assert not LayerCache.can_stack([prefilled(model, [4], 0)[0][0], fresh[0]])
    with pytest.raises(ValueError, match="do not stack"):
        LayerCache.stack([fresh[0]])
    batch = RowBatch(model, [PlainState(prefilled(model, [4], 0)[0]), PlainState(fresh)])
    logits = batch.step(mx.array([1, 2], dtype=mx.int32))
    assert logits.shape == (2, 61) and not batch.stacked
    assert [c.offset for c in batch.states[1].cache] == [1, 1, 1]


#: primitives that make views rather than launch kernels
VIEWS = {"Broadcast", "Reshape", "Slice", "Transpose", "ExpandDims", "Squeeze", "StopGradient"}


def step_kernels(model: Model, caches: list[Any], rows: int, path: Path) -> int:
    """The kernel-launching primitives in one (unevaluated) decode step's graph."""
    logits = model(mx.ones((rows, 1), dtype=mx.int32), cache=caches)
    mx.export_to_dot(str(path), logits)  # type: ignore[attr-defined]
    labels = [
        line.split('label ="', 1)[1].split('"', 1)[0]
        for line in path.read_text().splitlines()
        if "shape=rectangle" in line
    ]
    mx.eval(logits)
    return sum(label not in VIEWS for label in labels)


def test_a_stacked_step_launches_no_kernel_per_row(
    models: dict[str, Model], tmp_path: Path
) -> None:
    """Rows at the same compressor phases: 1 or 5 rows, the stacked step's graph has the
    same kernels (the GPU is bound by launches); row by row it grows with the rows."""
    model = models["tiny"]
    counts = {}
    for rows in (1, 5):
        lengths = [21 + 16 * i for i in range(rows)]  # past the window, one phase
        stacked = [
            LayerCache.stack(list(layer))
            for layer in zip(*prefilled(model, lengths, 0), strict=True)
        ]
        mx.eval([layer.state for layer in stacked])
        per_row = [
            RowCaches(list(layer)) for layer in zip(*prefilled(model, lengths, 0), strict=True)
        ]
        counts[rows] = (
            step_kernels(model, stacked, rows, tmp_path / "stacked.dot"),
            step_kernels(model, per_row, rows, tmp_path / "rows.dot"),
        )
    assert counts[5][0] == counts[1][0]
    assert counts[5][1] > counts[1][1] + 4 * 10
