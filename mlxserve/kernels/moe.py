"""Quantized MoE matmul variants for the ``nax_moe`` decision: ``skip``, ``full``, ``off``.

mlx-lm's ``SwitchGLU``/``SwitchMLP`` sort the token-expert rows of a batch with 64 or
more indices and call ``mx.gather_qmm(..., sorted_indices=True)`` on ``[rows, 1, K]``.
On Metal that takes ``gather_qmm_rhs`` when ``M == 1``, ``rows >= 16`` and
``rows // experts >= 4``, which on NAX GPUs (M5) is ``gather_qmm_rhs_nax``: since
mlx 0.32.2 (mlx#4352) it skips the MMA work of simdgroups whose rows fall past the
end of an expert's run. On a mixed M3 Ultra + M5 Max tensor-parallel pair that
kernel was reported to lose a JACCL completion, so the policy can ask a rank for:

* ``skip``: the stock call (with NAX and mlx >= 0.32.2, the #4352 kernel);
* ``full``: the same result without ever passing ``sorted_indices=True``;
* ``off``: no NAX path on the rank; the model stays as mlx-lm builds it (stock call).

How ``full`` keeps prefill fast (`full_matmul`)
-----------------------------------------------
It lays each expert's run of sorted rows out in 64-row tiles that never straddle
two experts (`mlxserve.kernels.tiles`) and runs *one* unsorted ``gather_qmm`` over
the ``[tiles, 64, K]`` batch with one expert index per tile. With ``M = 64`` Metal
picks the tiled matrix kernel (``gather_qmm_t_nax`` on NAX: BM = BN = BK = 64, 2 x 2
simdgroups, the tile shape of ``gather_qmm_rhs_nax``), which computes every
simdgroup. So ``full`` does the MMA work of the sorted kernel before #4352,
``ceil(rows_e / 64)`` tiles per expert, where #4352 pays per 32 rows; plus a gather
of ``x`` into the tiles and of the result back (K + N values copied per row against
2 K N flops), and one host sync per MoE layer for the number of tiles (the layout
is shared by the layer's projections, `tiles.tiles_for`).

Measured with ``benchmarks/moe_variants.py --quick`` (CPU, mlx 0.32.4): ``full``'s
time per row it computes is 0.98-1.05x ``skip``'s per row, so layout, sync and
gathers cost next to nothing; all of its extra time is the padding rows, which the
CPU pays and the stock GPU kernel pays too. Counted for the GPU (the benchmark's
``mma_rows``, uniform routing), ``full`` runs 1.06-1.07x the MMA rows of ``skip`` at
8192 tokens x top-6/8 over 256 experts (the "2-7%" of the policy rule), 1.01-1.20x
at 2048 tokens and 1.17-2.0x at 512.

Rejected designs (same benchmark, as candidates):

* ``sorted_indices=False`` on the ``[rows, 1, K]`` input: ``M == 1`` sends every row
  to ``gather_qmv``, the decode kernel, which re-reads its expert's weights per row:
  what mlx-lm sorts to avoid. On the CPU it times like ``skip`` (0.99-1.07x) because
  the CPU ignores the flag, which says nothing about Metal.
* One ``quantized_matmul`` per expert run: the same sync, but 3 x experts kernel
  launches, slices and a concatenate per layer (768 launches for 256 experts), each
  matmul too small to fill the GPU; and ``quantized_matmul`` takes no
  ``global_scale``, so nvfp4 experts with one could not use it.
* Tiles sized by the static bound ``ceil(rows / 64) + experts`` (no sync): computes
  that bound whatever the routing, +12-15% rows over ``full`` at 8192 tokens and
  256 experts, +34-73% at 2048; measured 1.2-1.4x ``full``'s CPU time.

Batches the stock kernel would not run sorted anyway (fewer than 16 rows, fewer
than 4 rows per expert, or ``M > 1``) take the unsorted ``gather_qmm`` unchanged:
Metal picks the same kernel for them either way, and 64-row tiles would waste most
of their work there. Between 4 and ~32 rows per expert ``full`` pays up to 2x the
MMA rows of ``skip`` (as mlx < 0.32.2 did); that threshold is the one to tune on an
M5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import mlx.core as mx
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from .tiles import tiles_for

MoeVariant = Literal["skip", "full", "off"]
MOE_VARIANTS: tuple[MoeVariant, ...] = get_args(MoeVariant)

ROW_TILE = 64
"""Rows per tile: BM of ``gather_qmm_t_nax`` and of ``gather_qmm_rhs_nax``."""

SORTED_MIN_ROWS = 16
SORTED_MIN_ROWS_PER_EXPERT = 4
"""Metal runs ``gather_qmm`` sorted only from these sizes on (``GatherQMM::eval_gpu``)."""


@dataclass(frozen=True)
class QuantizedExperts:
    """The stacked quantized expert weights of one switch layer and how they are packed."""

    weight: mx.array
    scales: mx.array
    biases: mx.array | None
    group_size: int
    bits: int
    mode: str
    global_scale: mx.array | None = None

    @classmethod
    def of(cls, layer: QuantizedSwitchLinear) -> QuantizedExperts:
        """The layer's own arrays (no copy), as mlx-lm's ``__call__`` reads them."""
        return cls(
            weight=layer["weight"],
            scales=layer["scales"],
            biases=layer.get("biases"),
            group_size=int(layer.group_size),
            bits=int(layer.bits),
            mode=str(layer.mode),
            global_scale=getattr(layer, "global_scale", None),
        )

    @property
    def num_experts(self) -> int:
        return int(self.weight.shape[0])

    def gather(self, x: mx.array, indices: mx.array, *, sorted_indices: bool) -> mx.array:
        """``x @ w[indices].T`` through ``mx.gather_qmm``, exactly as mlx-lm calls it."""
        # Looked up on the module at call time, so a test can wrap mx.gather_qmm.
        return mx.gather_qmm(
            x,
            self.weight,
            self.scales,
            self.biases,
            rhs_indices=indices,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            global_scale=self.global_scale,
            sorted_indices=sorted_indices,
        )


def skip_matmul(
    experts: QuantizedExperts, x: mx.array, indices: mx.array, *, sorted_indices: bool
) -> mx.array:
    """The stock call: sorted batches reach ``gather_qmm_rhs(_nax)`` as mlx-lm intends."""
    return experts.gather(x, indices, sorted_indices=sorted_indices)


def takes_row_tiles(x_shape: tuple[int, ...], indices_shape: tuple[int, ...], experts: int) -> bool:
    """Whether a sorted batch would hit the sorted kernel, and so goes through tiles.

    Mirrors Metal's choice (``M == 1``, ``rows >= 16``, ``rows // experts >= 4``) and
    needs ``x``'s batch shape to broadcast into ``indices``'s, as mlx-lm's is.
    """
    rows = 1
    for size in indices_shape:
        rows *= size
    if len(x_shape) < 2 or x_shape[-2] != 1 or rows < SORTED_MIN_ROWS:
        return False
    if rows // max(experts, 1) < SORTED_MIN_ROWS_PER_EXPERT:
        return False
    try:
        return tuple(mx.broadcast_shapes(x_shape[:-2], indices_shape)) == indices_shape
    except ValueError:
        return False


def full_matmul(
    experts: QuantizedExperts,
    x: mx.array,
    indices: mx.array,
    *,
    sorted_indices: bool,
    tile_rows: int = ROW_TILE,
) -> mx.array:
    """Same result as `skip_matmul`, never dispatching ``gather_qmm`` sorted.

    Sorted batches run as expert-aligned ``tile_rows``-row tiles through the
    unsorted, full-compute ``gather_qmm`` (see the module docstring); everything
    else is the unsorted stock call. ``indices`` must be sorted when
    ``sorted_indices`` is true, as for the stock kernel.
    """
    shape = tuple(indices.shape)
    if not sorted_indices or not takes_row_tiles(tuple(x.shape), shape, experts.num_experts):
        return experts.gather(x, indices, sorted_indices=False)
    in_dims = x.shape[-1]
    rows = indices.size
    flat_x = mx.broadcast_to(x, (*shape, 1, in_dims)).reshape(rows, in_dims)
    tiles = tiles_for(indices, experts.num_experts, tile_rows)
    tiled_x = flat_x[tiles.slot_row].reshape(tiles.num_tiles, tile_rows, in_dims)
    tiled_y = experts.gather(tiled_x, tiles.tile_expert, sorted_indices=False)
    out_dims = tiled_y.shape[-1]
    y = tiled_y.reshape(tiles.slots, out_dims)[tiles.row_slot]
    return y.reshape(*shape, 1, out_dims)
