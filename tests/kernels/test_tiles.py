"""The expert-aligned tile layout and its per-array cache."""

import math

import mlx.core as mx
import pytest

from mlxserve.kernels import tiles as tiles_module
from mlxserve.kernels.tiles import ExpertTiles, expert_tiles, forget_tiles, tiles_for
from tests.kernels.conftest import route


def check_layout(indices: mx.array, num_experts: int, tiles: ExpertTiles) -> None:
    flat = indices.reshape(-1).tolist()
    tile_rows = tiles.tile_rows
    counts = [flat.count(e) for e in range(num_experts)]
    assert tiles.num_tiles == sum(math.ceil(c / tile_rows) for c in counts)
    assert tiles.slot_row.shape == (tiles.slots,)
    row_slot = tiles.row_slot.tolist()
    slot_row = tiles.slot_row.tolist()
    tile_expert = tiles.tile_expert.tolist()
    assert len(set(row_slot)) == len(flat)
    for row, slot in enumerate(row_slot):
        assert slot_row[slot] == row
        assert tile_expert[slot // tile_rows] == flat[row]
    # Each expert's rows fill its tiles from the first slot on, in order.
    for tile, expert in enumerate(tile_expert):
        real = [slot_row[s] for s in range(tile * tile_rows, (tile + 1) * tile_rows)]
        assert flat[real[0]] == expert


@pytest.mark.parametrize("tile_rows", [1, 4, 64])
@pytest.mark.parametrize(("tokens", "num_experts", "top_k"), [(64, 4, 1), (40, 16, 6), (9, 64, 8)])
def test_layout_covers_every_row_once(
    tokens: int, num_experts: int, top_k: int, tile_rows: int
) -> None:
    indices = mx.sort(route(tokens, num_experts, top_k).flatten())
    check_layout(indices, num_experts, expert_tiles(indices, num_experts, tile_rows))


def test_skewed_and_empty_experts() -> None:
    indices = mx.array([0] * 130 + [5] * 3 + [7] * 64, dtype=mx.uint32)
    tiles = expert_tiles(indices, 8, 64)
    assert tiles.num_tiles == 3 + 1 + 1
    assert tiles.tile_expert.tolist() == [0, 0, 0, 5, 7]
    check_layout(indices, 8, tiles)


def test_any_index_shape_and_dtype() -> None:
    indices = mx.sort(route(16, 8, 4).flatten()).astype(mx.int32).reshape(4, 16)
    tiles = expert_tiles(indices, 8, 8)
    check_layout(indices, 8, tiles)
    assert tiles.tile_expert.dtype == mx.int32


def test_tile_rows_must_be_positive() -> None:
    with pytest.raises(ValueError, match="tile_rows"):
        expert_tiles(mx.zeros((4,), dtype=mx.uint32), 2, 0)


def test_cache_is_per_array_and_key(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[int] = []
    real = tiles_module.expert_tiles

    def counting(indices: mx.array, num_experts: int, tile_rows: int) -> ExpertTiles:
        built.append(tile_rows)
        return real(indices, num_experts, tile_rows)

    monkeypatch.setattr(tiles_module, "expert_tiles", counting)
    indices = mx.sort(route(32, 8, 2).flatten())
    first = tiles_for(indices, 8, 16)
    assert tiles_for(indices, 8, 16) is first
    assert len(built) == 1
    # An equal array is another object: a new layout (no content hashing).
    assert tiles_for(mx.array(indices), 8, 16) is not first
    assert tiles_for(indices, 8, 32).tile_rows == 32
    assert len(built) == 3
    forget_tiles()
    tiles_for(indices, 8, 32)
    assert len(built) == 4
