"""Partial, interleaved rotary embeddings as DeepSeek-V4 uses them.

V4 rotates only the trailing ``qk_rope_head_dim`` channels of each head, pairs
consecutive channels (MLX's ``traditional`` layout) and has two frequency sets:
``main`` (sliding layers) and ``compress`` (CSA / HCA layers and their compressors,
YaRN-scaled). The frequencies are computed here, mirroring ``transformers``
(``_compute_yarn_parameters`` with its always-on ``truncate``), rather than with
``mlx_lm``'s ``YarnRoPE``, because V4 takes the attention factor straight from the
config instead of from ``mscale``.

A call rotates the whole head in one ``mx.fast.rope`` (one kernel), not a slice
rotated and concatenated back to the rest (two kernels and a copy): the channels
left alone get an infinite wavelength, so their angle is 0 and cos 1, sin 0 leave
them exactly as they were. It checks itself once per process and shape against the
slice-and-concatenate form and steps aside with a warning if the two differ.
"""

from __future__ import annotations

import logging
import math
from functools import cache
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module

log = logging.getLogger(__name__)


def _inverse_frequencies(params: dict[str, Any], dim: int, max_positions: int) -> mx.array:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (mx.arange(0, dim, 2, dtype=mx.float32) / dim))
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type != "yarn":
        raise NotImplementedError(f"RoPE type {rope_type!r} is not supported for DeepSeek-V4.")
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or max_positions / original
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = float(max(math.floor(correction_dim(beta_fast)), 0))
    high = float(min(math.ceil(correction_dim(beta_slow)), dim - 1))
    if low == high:
        high += 0.001
    ramp = mx.clip((mx.arange(dim // 2, dtype=mx.float32) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp
    return (inv_freq / factor) * (1.0 - extrapolation) + inv_freq * extrapolation


def _attention_factor(params: dict[str, Any], max_positions: int) -> float:
    if params.get("rope_type", "default") != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = params.get("factor") or max_positions / int(params["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, m) / mscale(factor, m_all)
    return mscale(factor)


def _padded(wavelengths: mx.array, width: int) -> mx.array:
    """``wavelengths`` of the trailing pairs of a ``width``-channel head, infinite (no
    rotation) for the leading ones."""
    still = (width - 2 * wavelengths.shape[0]) // 2
    sign = -1.0 if float(wavelengths[0]) < 0 else 1.0
    return mx.concatenate([mx.full((still,), sign * mx.inf, dtype=mx.float32), wavelengths])


def _sliced(
    x: mx.array, dims: int, offset: int | mx.array, scale: float, freqs: mx.array
) -> mx.array:
    """The trailing ``dims`` channels rotated, the rest concatenated back (float32)."""
    head, tail = x[..., :-dims], x[..., -dims:]
    tail = mx.fast.rope(
        tail.astype(mx.float32),
        dims,
        traditional=True,
        base=None,
        scale=scale,
        offset=offset,
        freqs=freqs,
    )
    return mx.concatenate([head.astype(mx.float32), tail], axis=-1)


@cache
def whole_head_agrees(width: int, dims: int) -> bool:
    """Whether one rotation of the whole head with infinite wavelengths for the
    leading channels equals the slice-and-concatenate form here (once per process and
    shape; positions in one and in several rows, both directions)."""
    wavelengths = 10000.0 ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    x = mx.random.normal((2, 3, 5, width), key=mx.random.key(7)) * 4
    try:
        for freqs in (wavelengths, -wavelengths):
            for offset in (11, mx.array([3, 1000003])):
                ours = mx.fast.rope(
                    x,
                    width,
                    traditional=True,
                    base=None,
                    scale=2.0,
                    offset=offset,
                    freqs=_padded(freqs, width),
                )
                theirs = _sliced(x, dims, offset, 2.0, freqs)
                if not bool(mx.array_equal(ours, theirs)):
                    worst = float(mx.abs(ours - theirs).max())
                    log.warning("one-kernel RoPE differs by %g: rotating a slice", worst)
                    return False
    except (RuntimeError, ValueError) as exc:
        log.warning("one-kernel RoPE failed (%s): rotating a slice", exc)
        return False
    return True


class PartialRoPE(Module):
    """Rotate the trailing ``dims`` channels of ``x`` (positions on axis -2)."""

    def __init__(self, params: dict[str, Any], dims: int, max_positions: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.dims = dims
        # Private attributes are not parameters, so nothing is loaded or quantised here.
        self._wavelengths = 1.0 / _inverse_frequencies(params, dims, max_positions)
        self._factor = _attention_factor(params, max_positions)
        # The whole-head frequencies of each direction, by head width (`_freqs`).
        self._whole: dict[tuple[int, bool], mx.array] = {}

    def _freqs(self, width: int, inverse: bool) -> mx.array | None:
        """Frequencies rotating a whole ``width``-channel head in one kernel, or None
        where that does not hold (an attention factor, a check that failed)."""
        if self._factor != 1.0 or not whole_head_agrees(width, self.dims):
            return None
        key = (width, inverse)
        if key not in self._whole:
            freqs = _padded(-self._wavelengths if inverse else self._wavelengths, width)
            mx.eval(freqs)
            self._whole[key] = freqs
        return self._whole[key]

    def __call__(
        self,
        x: mx.array,
        offset: int | mx.array = 0,
        scale: float = 1.0,
        inverse: bool = False,
    ) -> mx.array:
        """Positions are ``scale * (offset + t)``; ``inverse`` rotates by the negative angle.

        ``offset`` may be an array [B]: one offset per batch row.

        The reference scales cos and sin by the attention factor in both directions,
        so the inverse rotation is scaled by it too.
        """
        if self.dims == 0:
            return x
        whole = self._freqs(x.shape[-1], inverse)
        if whole is not None:
            out = mx.fast.rope(
                x.astype(mx.float32),
                x.shape[-1],
                traditional=True,
                base=None,
                scale=scale,
                offset=offset,
                freqs=whole,
            )
            return out.astype(x.dtype)
        head, tail = x[..., : -self.dims], x[..., -self.dims :]
        freqs = -self._wavelengths if inverse else self._wavelengths
        tail = mx.fast.rope(
            tail.astype(mx.float32),
            self.dims,
            traditional=True,
            base=None,
            scale=scale,
            offset=offset,
            freqs=freqs,
        )
        if self._factor != 1.0:
            tail = tail * self._factor
        return mx.concatenate([head, tail.astype(x.dtype)], axis=-1)
