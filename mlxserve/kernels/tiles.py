"""Expert-aligned row tiles: the layout the full-compute MoE variant runs in.

Sorted MoE rows come in one run per expert (``indices`` ascending). The stock
sorted kernel (``gather_qmm_rhs_nax``) walks those runs in tiles of 64 rows that
never straddle two experts: an expert with ``c`` rows costs ``ceil(c / 64)`` tiles.
This module builds the same tiling as plain arrays, so the runs can be fed to the
*unsorted* ``gather_qmm`` as a batch of ``[tile_rows, K]`` matrices, one expert each:

* ``slot_row[s]``: the sorted row that padded slot ``s`` reads (pads read row 0,
  a real row, so the padding computes finite values that are then dropped);
* ``row_slot[r]``: the padded slot holding sorted row ``r`` (to gather the result back);
* ``tile_expert[t]``: the expert of tile ``t``.

The number of tiles decides the shapes, so it is read back to the host: one
``item()`` per layout. The three projections of a ``SwitchGLU`` share one
``indices`` array, so the layout is cached on the identity of that array
(`tiles_for`) and a MoE layer syncs once, not three times.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import cast

import mlx.core as mx


@dataclass(frozen=True)
class ExpertTiles:
    """Padded, expert-aligned layout of ``rows`` sorted rows (see the module docstring)."""

    tile_rows: int
    num_tiles: int
    row_slot: mx.array
    slot_row: mx.array
    tile_expert: mx.array

    @property
    def slots(self) -> int:
        """Rows the tiled matmul computes, padding included."""
        return self.num_tiles * self.tile_rows


def expert_tiles(indices: mx.array, num_experts: int, tile_rows: int) -> ExpertTiles:
    """Lay out sorted rows (``indices`` ascending, any shape) in expert-aligned tiles.

    ``indices`` must be sorted, which is what ``sorted_indices=True`` promises the
    stock kernel too. Syncs with the device once, to learn the number of tiles.
    """
    if tile_rows < 1:
        raise ValueError(f"tile_rows must be >= 1, not {tile_rows}")
    flat = indices.reshape(-1)
    experts = flat.astype(mx.int32)
    rows = mx.arange(flat.size, dtype=mx.int32)
    counts = mx.zeros((num_experts,), dtype=mx.int32).at[experts].add(1)
    tiles = (counts + (tile_rows - 1)) // tile_rows
    first_tile = mx.cumsum(tiles) - tiles
    first_row = mx.cumsum(counts) - counts
    row_slot = first_tile[experts] * tile_rows + (rows - first_row[experts])
    num_tiles = cast(int, mx.sum(tiles).item())
    # Slots are unique, so scatter-add writes each real row once; pads stay 0.
    slot_row = mx.zeros((num_tiles * tile_rows,), dtype=mx.int32).at[row_slot].add(rows)
    # The first slot of every tile holds a real row of the tile's expert.
    tile_expert = flat[slot_row[::tile_rows]]
    return ExpertTiles(tile_rows, num_tiles, row_slot, slot_row, tile_expert)


class _LastLayout(threading.local):
    """The last layout built on this thread, with the ``indices`` object it is for."""

    indices: mx.array | None = None
    key: tuple[int, int] = (0, 0)
    tiles: ExpertTiles | None = None


_last = _LastLayout()


def tiles_for(indices: mx.array, num_experts: int, tile_rows: int) -> ExpertTiles:
    """`expert_tiles`, reusing the previous layout when called again with the same array.

    Arrays are immutable, so the same object means the same layout. Holding a
    reference to the last ``indices`` keeps its ``id`` from being reused, so the
    ``is`` test cannot match a different array. Per thread, one entry: a MoE
    layer's projections run back to back.
    """
    key = (num_experts, tile_rows)
    if _last.indices is indices and _last.key == key and _last.tiles is not None:
        return _last.tiles
    tiles = expert_tiles(indices, num_experts, tile_rows)
    _last.indices, _last.key, _last.tiles = indices, key, tiles
    return tiles


def forget_tiles() -> None:
    """Drop this thread's cached layout (and its reference to the ``indices`` array)."""
    _last.indices, _last.key, _last.tiles = None, (0, 0), None
