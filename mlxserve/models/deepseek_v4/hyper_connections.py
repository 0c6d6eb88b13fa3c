"""Manifold-constrained hyper-connections (mHC) wiring for DeepSeek-V4.

The residual is ``hc_mult`` streams [B, S, hc, D]. Before each block (attention and
FFN separately) ``HyperConnection`` computes from the *current* streams the ``pre``
weights (collapse the streams into the block input), ``post`` (spread the block output
over the streams) and ``comb`` (a Sinkhorn-normalised stream mixing). The maths of that
module is identical to ``deepseek_v41``'s and is reused; V4 only differs in the wiring
(v41 collapses with the *previous* block's ``pre``), which lives in ``model.py``, and in
the final ``HyperHead``, which collapses the streams once more before the last norm.
Its Sinkhorn normalisation runs through ``mlxserve.kernels.sinkhorn``: one launch on
CUDA, where v41's op loop is ~80.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx_lm.models.deepseek_v41 import HyperConnection as V41HyperConnection

from mlxserve.kernels.sinkhorn import sinkhorn

from .config import ModelArgs

__all__ = ["HyperConnection", "HyperHead", "collapse", "expand"]


def collapse(streams: mx.array, pre: mx.array) -> mx.array:
    """Weighted sum of the streams: [B, S, hc, D] x [B, S, hc] -> [B, S, D]."""
    out = mx.sum(pre[..., None] * streams.astype(mx.float32), axis=2)
    return out.astype(streams.dtype)


def expand(block_out: mx.array, streams: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """New streams: ``post * block_out + comb^T @ streams`` (comb mixes over its first axis)."""
    mixed = mx.swapaxes(comb, -1, -2) @ streams.astype(mx.float32)
    out = post[..., None] * block_out[..., None, :].astype(mx.float32) + mixed
    return out.astype(streams.dtype)


class HyperConnection(V41HyperConnection):
    """v41's module (same parameters and maths) with the Sinkhorn loop of
    ``mlxserve.kernels.sinkhorn`` (one launch on CUDA)."""

    def __call__(self, streams: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        flat = streams.reshape(*streams.shape[:2], -1).astype(mx.float32)
        flat = mx.fast.rms_norm(flat, None, self.norm_eps)
        mix = (flat @ self.fn.T) * self.scale[self._scale_ids] + self.base
        pre, post, comb = mx.split(mix, [self.hc, 2 * self.hc], axis=-1)
        comb = comb.reshape(*comb.shape[:-1], self.hc, self.hc)
        comb = mx.softmax(comb, axis=-1) + self.hc_eps
        return (
            mx.sigmoid(pre) + self.hc_eps,
            2.0 * mx.sigmoid(post),
            sinkhorn(comb, iters=self.iters, eps=self._eps),
        )


class HyperHead(Module):
    """Final collapse of the streams (``hc_head``) before the model's last RMSNorm."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.eps = args.hc_eps
        self.norm_eps = args.rms_norm_eps
        self.hc_fn = mx.zeros((args.hc_mult, args.hc_mult * args.hidden_size), dtype=mx.float32)
        self.hc_base = mx.zeros((args.hc_mult,), dtype=mx.float32)
        self.hc_scale = mx.ones((1,), dtype=mx.float32)

    def __call__(self, streams: mx.array) -> mx.array:
        flat = streams.reshape(*streams.shape[:2], -1).astype(mx.float32)
        flat = mx.fast.rms_norm(flat, None, self.norm_eps)
        mix = (flat @ self.hc_fn.astype(mx.float32).T) * self.hc_scale + self.hc_base
        return collapse(streams, mx.sigmoid(mix) + self.eps)
