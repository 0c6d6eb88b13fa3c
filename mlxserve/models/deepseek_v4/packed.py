"""DeepSeek's FP8 / FP4 packed weights, put in MLX's ``mxfp8`` / ``mxfp4`` layouts.

DeepSeek's published checkpoints store most linear weights as raw 1-byte codes plus a
``.scale`` tensor of power-of-two factors (ue8m0: a uint8 exponent, or a float power of
two):

* FP8 (e4m3): one byte per element and one scale per block of rows x columns (128 x 128
  in DeepSeek-V3 / V4, 32 x 32 in V4.1). The scale grid is
  ``ceil(rows / block) x ceil(cols / block)``, so edge blocks may be partial.
* FP4 (e2m1, the routed experts of V4-Flash): two elements per byte (int8 or uint8),
  one scale per 32 input elements of each row.

MLX's ``mxfp8`` / ``mxfp4`` use the same element codes, bit for bit, with one e8m0
scale per 32 input elements of each row. So a weight is repacked by viewing its bytes
as uint32 and, for FP8, repeating each block scale over the rows and 32-element groups
it covers. Nothing is dequantised: the weights stay as small (and as lazy) as in the
checkpoint, and ``mlx_lm``'s loader turns every module with ``.scales`` into a
quantised one whose mode it infers from the packed shapes.
"""

from __future__ import annotations

import mlx.core as mx

#: Input elements per e8m0 scale in MLX's mx formats.
MX_GROUP = 32
#: Bytes per scale of an FP4 row: 32 two-per-byte elements.
_FP4_BYTES_PER_SCALE = MX_GROUP // 2


def is_fp4_grid(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> bool:
    """FP4's grid: one scale per row and per 16 bytes (an FP8 grid like that would need
    16-element blocks, which ``mxfp8`` cannot represent)."""
    return (
        len(weight_shape) >= 2
        and len(scale_shape) == len(weight_shape)
        and scale_shape[-2] == weight_shape[-2]
        and weight_shape[-1] == _FP4_BYTES_PER_SCALE * scale_shape[-1]
    )


def repacked_scale_bytes(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> int:
    """Bytes of the e8m0 scales ``repack`` makes for these shapes: one byte per 32
    elements of every row, so FP8's 128 x 128 block scales grow to ``rows * cols / 32``."""
    rows = 1
    for dim in weight_shape[:-1]:
        rows *= dim
    per_scale = _FP4_BYTES_PER_SCALE if is_fp4_grid(weight_shape, scale_shape) else MX_GROUP
    return rows * (weight_shape[-1] // per_scale)


def to_e8m0(scale: mx.array) -> mx.array:
    """Power-of-two scales as e8m0 exponents (uint8, ``2 ** (e - 127)``).

    uint8 scales already are (safetensors' ``F8_E8M0`` loads as uint8). Float scales
    give their float32 exponent bits, which is exact for powers of two; a mantissa
    would be dropped, which is why the loader insists on ``scale_fmt: ue8m0``.
    """
    if scale.dtype == mx.uint8:
        return scale
    if not mx.issubdtype(scale.dtype, mx.floating):
        raise ValueError(f"Scales must be uint8 (e8m0) or float powers of two; got {scale.dtype}.")
    bits = scale.astype(mx.float32).view(mx.uint32)
    return ((bits >> 23) & 0xFF).astype(mx.uint8)


def _block(length: int, count: int, name: str, axis: str) -> int:
    """The power-of-two block size that splits ``length`` elements into ``count`` scales.

    With a power-of-two block ``b`` and ``count = ceil(length / b) >= 2``,
    ``ceil(length / count)`` lies in ``(b / 2, b]``, so rounding it up to a power of two
    recovers ``b`` even when the last block is partial; with one block every size
    covering ``length`` is equivalent. Other grids cannot come from such blocks.
    """
    if not 1 <= count <= length:
        raise ValueError(f"{name}: {count} scales along {axis} of length {length}.")
    need = -(-length // count)
    block = 1 << (need - 1).bit_length()
    if -(-length // block) != count:
        raise ValueError(
            f"{name}: {count} scales along {axis} of length {length} match no "
            "power-of-two block size."
        )
    return block


def repack(weight: mx.array, scale: mx.array, name: str) -> tuple[mx.array, mx.array]:
    """``(weight viewed as uint32, uint8 scales [..., rows, in / 32])`` for MLX.

    ``weight`` is ``[..., rows, bytes]`` of FP8 or FP4 codes, ``scale`` its block
    (FP8) or per-32-element (FP4) scales with the same leading dims (stacked experts).
    FP4 is recognised by its grid (``is_fp4_grid``).
    """
    if weight.dtype not in (mx.uint8, mx.int8):
        raise ValueError(
            f"{name} has a scale but is {weight.dtype}; packed FP8 / FP4 weights are "
            "1-byte (uint8 / int8) codes."
        )
    if weight.ndim < 2 or scale.ndim != weight.ndim or weight.shape[:-2] != scale.shape[:-2]:
        raise ValueError(f"{name}: weight {weight.shape} and scale {scale.shape} do not pair.")
    rows, nbytes = weight.shape[-2:]
    scale_rows, scale_cols = scale.shape[-2:]
    scales = to_e8m0(scale)
    if is_fp4_grid(tuple(weight.shape), tuple(scale.shape)):
        return weight.view(mx.uint32), scales
    if nbytes % MX_GROUP:
        raise ValueError(f"{name}: {nbytes} input elements are not a multiple of {MX_GROUP}.")
    row_block = _block(rows, scale_rows, name, "rows")
    col_block = _block(nbytes, scale_cols, name, "columns")
    if col_block % MX_GROUP:
        raise ValueError(
            f"{name}: FP8 blocks of {col_block} columns; mxfp8 needs a multiple of {MX_GROUP}."
        )
    if row_block > 1:
        scales = mx.repeat(scales, row_block, axis=-2)[..., :rows, :]
    if col_block > MX_GROUP:
        scales = mx.repeat(scales, col_block // MX_GROUP, axis=-1)[..., : nbytes // MX_GROUP]
    return weight.view(mx.uint32), scales
