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

A decode step or a verify forward is bound by launches and the host's graph
building, and the hyper-connections around each block are a string of tiny ops:
as ops, 13-14 kernels to enter a block and 2 to leave it. ``enter`` and ``leave``
therefore run fused for forwards of a few rows (the tuning's
``compiled_hc_max_rows``, set by ``Model.tune``), under ``mx.compile``, written so
that every element-wise string has one shape and becomes one kernel: the mix's
columns are scaled by masks instead of a gathered scale vector, split by views,
normalised by one softmax over all its rows, and the collapse and the new streams
are sums over the ``hc`` streams written out (no reduction, no matmul). Entering is
then the RMSNorm, the mix's matmul, five fused kernels and the Sinkhorn; leaving is
one kernel. Larger forwards (a prefill) keep the ops, so no compilation is made per
prompt length. Only the order of the few float32 terms of each sum differs from the
ops; each fused function checks itself once per process against the ops
(``compiled_agrees``) and is not used if it differs by more than 1e-5.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any, NamedTuple

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx_lm.models.deepseek_v41 import HyperConnection as V41HyperConnection
from mlx_lm.models.deepseek_v41 import ModelArgs as V41ModelArgs

from mlxserve.hardware.tuning import default_tuning
from mlxserve.kernels.sinkhorn import sinkhorn

from .config import ModelArgs

__all__ = ["HyperConnection", "HyperHead", "collapse", "expand"]

log = logging.getLogger(__name__)


def collapse(streams: mx.array, pre: mx.array) -> mx.array:
    """Weighted sum of the streams: [B, S, hc, D] x [B, S, hc] -> [B, S, D]."""
    out = mx.sum(pre[..., None] * streams.astype(mx.float32), axis=2)
    return out.astype(streams.dtype)


def expand(block_out: mx.array, streams: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """New streams: ``post * block_out + comb^T @ streams`` (comb mixes over its first axis)."""
    mixed = mx.swapaxes(comb, -1, -2) @ streams.astype(mx.float32)
    out = post[..., None] * block_out[..., None, :].astype(mx.float32) + mixed
    return out.astype(streams.dtype)


class MixConstants(NamedTuple):
    """A hyper-connection's constants: its stream count and epsilons (hashable, so one
    compilation serves every layer that shares them)."""

    hc: int
    norm_eps: float
    hc_eps: float


def _mix(
    streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array, constants: MixConstants
) -> tuple[mx.array, mx.array, mx.array]:
    """(pre, post, comb before Sinkhorn) from the streams [B, S, hc, D]."""
    hc = constants.hc
    flat = streams.reshape(*streams.shape[:2], -1).astype(mx.float32)
    flat = mx.fast.rms_norm(flat, None, constants.norm_eps)
    mix = (flat @ fn.T) * scale + base
    pre, post, comb = mx.split(mix, [hc, 2 * hc], axis=-1)
    comb = comb.reshape(*comb.shape[:-1], hc, hc)
    comb = mx.softmax(comb, axis=-1) + constants.hc_eps
    return mx.sigmoid(pre) + constants.hc_eps, 2.0 * mx.sigmoid(post), comb


def _enter(
    streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array, constants: MixConstants
) -> tuple[mx.array, mx.array, mx.array]:
    """(the block's input [B, S, D], post, comb before Sinkhorn)."""
    pre, post, comb = _mix(streams, fn, scale, base, constants)
    return collapse(streams, pre), post, comb


@cache
def _mix_masks(hc: int) -> tuple[mx.array, mx.array, mx.array]:
    """[2 + hc, 1] float masks of the mix's rows: pre, post, the comb's rows."""
    rows = mx.arange(2 + hc)[:, None]
    masks = (rows == 0, rows == 1, rows >= 2)
    out = tuple(m.astype(mx.float32) for m in masks)
    mx.eval(out)
    return out[0], out[1], out[2]


def _fused_enter(
    streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array, constants: MixConstants
) -> tuple[mx.array, mx.array, mx.array]:
    """`_enter` with one shape per element-wise string (module docstring)."""
    hc = constants.hc
    is_pre, is_post, is_comb = _mix_masks(hc)
    batch, length = streams.shape[:2]
    flat = streams.reshape(batch, length, -1).astype(mx.float32)
    flat = mx.fast.rms_norm(flat, None, constants.norm_eps)
    mix = (flat @ fn.T).reshape(batch, length, 2 + hc, hc)
    # The same products as scaling by the gathered scale (x * 1 + 0 + 0 is x).
    mix = (
        mix * scale[0:1] * is_pre
        + mix * scale[1:2] * is_post
        + mix * scale[2:3] * is_comb
        + base.reshape(2 + hc, hc)
    )
    comb = mx.softmax(mix, axis=-1)[:, :, 2:] + constants.hc_eps
    post = 2.0 * mx.sigmoid(mix[:, :, 1])
    wide = streams.shape[:2] + streams.shape[3:]

    def pre(i: int) -> mx.array:
        return mx.broadcast_to(mx.sigmoid(mix[:, :, 0, i : i + 1]) + constants.hc_eps, wide)

    x = pre(0) * streams[:, :, 0].astype(mx.float32)
    for i in range(1, hc):
        x = x + pre(i) * streams[:, :, i].astype(mx.float32)
    return x.astype(streams.dtype), post, comb


def _fused_leave(
    block_out: mx.array, streams: mx.array, post: mx.array, comb: mx.array
) -> mx.array:
    """`expand` as one element-wise string: stream i gets post_i * out + sum_j comb_ji *
    stream_j, the sum written out over the ``hc`` streams."""
    hc = streams.shape[2]
    out = post[..., None] * block_out[:, :, None, :].astype(mx.float32)
    for j in range(hc):
        row = mx.swapaxes(comb[:, :, j : j + 1, :], -1, -2)  # comb_j. as a column [B, S, hc, 1]
        out = out + row * streams[:, :, j : j + 1, :].astype(mx.float32)
    return out.astype(streams.dtype)


@cache
def _compiled(name: str, constants: MixConstants) -> Any:
    """The fused `enter` or `leave` under ``mx.compile``, for one set of constants (the
    compilation then retraces per input shape, of which a server sees a few)."""
    if name == "enter":
        _mix_masks(constants.hc)  # built before tracing: constants of the trace

        def enter(
            streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array
        ) -> tuple[mx.array, mx.array, mx.array]:
            return _fused_enter(streams, fn, scale, base, constants)

        return mx.compile(enter)
    return mx.compile(_fused_leave)


@cache
def compiled_agrees(constants: MixConstants) -> bool:
    """Whether the compiled `enter` and `leave` build and match the ops here (once per
    process and constants). A failure (no compiler for MLX's CPU JIT, say) or a
    difference leaves the ops in use, with a warning: slower, never wrong."""
    hc, dim, mix = constants.hc, 8, (2 + constants.hc) * constants.hc
    streams = mx.random.normal((2, 3, hc, dim), key=mx.random.key(1))
    fn = mx.random.normal((mix, hc * dim), key=mx.random.key(2))
    scale = mx.random.uniform(shape=(3,), key=mx.random.key(3))
    base = mx.random.normal((mix,), key=mx.random.key(4))
    block_out = mx.random.normal((2, 3, dim), key=mx.random.key(5))
    ids = mx.array([0] * hc + [1] * hc + [2] * hc * hc)
    try:
        ours = _compiled("enter", constants)(streams, fn, scale, base)
        theirs = _enter(streams, fn, scale[ids], base, constants)
        comb = mx.softmax(ours[2], axis=-1)
        ours_out = _compiled("leave", constants)(block_out, streams, ours[1], comb)
        theirs_out = expand(block_out, streams, ours[1], comb)
        mx.eval(ours, ours_out)
        worst = max(
            float(mx.abs(a - b).max())
            for a, b in zip((*ours, ours_out), (*theirs, theirs_out), strict=True)
        )
    except (RuntimeError, ValueError) as exc:
        log.warning("compiled hyper-connections failed (%s): using the ops", exc)
        return False
    if not worst <= 1e-5:
        log.warning("compiled hyper-connections differ by %g: using the ops", worst)
        return False
    return True


class HyperConnection(V41HyperConnection):
    """v41's module (same parameters and maths) with the Sinkhorn loop of
    ``mlxserve.kernels.sinkhorn`` (one launch on CUDA), entered and left through
    `enter` and `leave`, compiled for forwards of at most ``compiled_max_rows`` rows
    (batch x tokens; 0: never)."""

    def __init__(self, args: V41ModelArgs) -> None:
        super().__init__(args)
        self.compiled_max_rows = default_tuning().compiled_hc_max_rows

    @property
    def constants(self) -> MixConstants:
        return MixConstants(self.hc, self.norm_eps, self.hc_eps)

    def _compiles(self, streams: mx.array) -> bool:
        rows = streams.shape[0] * streams.shape[1]
        return rows <= self.compiled_max_rows and compiled_agrees(self.constants)

    def __call__(self, streams: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(pre, post, comb) from the streams, as v41's module returns them."""
        scale = self.scale[self._scale_ids]
        pre, post, comb = _mix(streams, self.fn, scale, self.base, self.constants)
        return pre, post, sinkhorn(comb, iters=self.iters, eps=self._eps)

    def enter(self, streams: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(the block's input: the streams collapsed [B, S, D], post, comb)."""
        if self._compiles(streams):
            fused = _compiled("enter", self.constants)
            x, post, comb = fused(streams, self.fn, self.scale, self.base)
        else:
            scale = self.scale[self._scale_ids]
            x, post, comb = _enter(streams, self.fn, scale, self.base, self.constants)
        return x, post, sinkhorn(comb, iters=self.iters, eps=self._eps)

    def leave(
        self, block_out: mx.array, streams: mx.array, post: mx.array, comb: mx.array
    ) -> mx.array:
        """The new streams from the block's output (`expand`)."""
        if self._compiles(streams):
            out: mx.array = _compiled("leave", self.constants)(block_out, streams, post, comb)
            return out
        return expand(block_out, streams, post, comb)


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
