"""Partial, interleaved rotary embeddings as DeepSeek-V4 uses them.

V4 rotates only the trailing ``qk_rope_head_dim`` channels of each head, pairs
consecutive channels (MLX's ``traditional`` layout) and has two frequency sets:
``main`` (sliding layers) and ``compress`` (CSA / HCA layers and their compressors,
YaRN-scaled). The frequencies are computed here, mirroring ``transformers``
(``_compute_yarn_parameters`` with its always-on ``truncate``), rather than with
``mlx_lm``'s ``YarnRoPE``, because V4 takes the attention factor straight from the
config instead of from ``mscale``.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module


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


class PartialRoPE(Module):
    """Rotate the trailing ``dims`` channels of ``x`` (positions on axis -2)."""

    def __init__(self, params: dict[str, Any], dims: int, max_positions: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.dims = dims
        # Private attributes are not parameters, so nothing is loaded or quantised here.
        self._wavelengths = 1.0 / _inverse_frequencies(params, dims, max_positions)
        self._factor = _attention_factor(params, max_positions)

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
