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
that every element-wise string reads only views of the raw mix (the matmul's
output) and inputs, never a slice of another string's result, and so stays one
kernel: the comb's scale, base and softmax (written out over its ``hc`` columns)
are one kernel, the ``pre`` weights and the collapse another, and ``post`` is
computed where it is used, in the exit's kernel (``enter`` hands the raw mix over in
its place); sums over the ``hc`` streams are written out. Entering is then the
RMSNorm, the mix's matmul, two fused kernels and the Sinkhorn; leaving is one
kernel. Larger forwards (a prefill) keep the ops, so no compilation is made per
prompt length. Only the order of the few float32 terms of each sum differs from the
ops; the fused functions check themselves once per process against the ops
(``compiled_agrees``) and are not used if they differ by more than 1e-5.

On CUDA a block's entry and its norm are one kernel of our own, and so is the
attention's exit with the FFN's entry (``mlxserve.kernels.hyper_connection``;
``enter`` with a norm, ``leave_enter``): three kernels for the four hyper-connection
steps of a layer and its two block norms, against twelve and two. The kernel checks
itself once per process and shape against the ops (``cuda_agrees``) and steps aside
with a warning where it fails or differs.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any, NamedTuple

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.normalization import RMSNorm
from mlx_lm.models.deepseek_v41 import HyperConnection as V41HyperConnection
from mlx_lm.models.deepseek_v41 import ModelArgs as V41ModelArgs

from mlxserve.hardware.tuning import default_tuning
from mlxserve.kernels import hyper_connection as hc_kernel
from mlxserve.kernels.sinkhorn import sinkhorn

from .config import ModelArgs
from .norm import InputDtypeRMSNorm

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


def _fused_mix(streams: mx.array, fn: mx.array, norm_eps: float) -> mx.array:
    """The mix before its scale and base, [B, S, (2 + hc) * hc]: the RMSNorm and the
    matmul, the two kernels of `_mix` that are not element-wise."""
    flat = streams.reshape(*streams.shape[:2], -1).astype(mx.float32)
    return mx.fast.rms_norm(flat, None, norm_eps) @ fn.T


def _mix_rows(raw: mx.array, hc: int) -> mx.array:
    """The raw mix [B, S, M] as its rows [B, S, 2 + hc, hc] (pre, post, the comb's)."""
    return raw.reshape(*raw.shape[:2], 2 + hc, hc)


def _fused_comb(raw: mx.array, scale: mx.array, base: mx.array, hc: int, hc_eps: float) -> mx.array:
    """The comb before Sinkhorn, [B, S, hc, hc], as one element-wise string: its rows
    scaled and shifted from the raw mix, and the softmax over each row written out
    over its ``hc`` columns (the maximum, the exponentials and their sum), so no
    intermediate is sliced."""
    rows = _mix_rows(raw, hc)[:, :, 2:]  # [B, S, hc, hc]
    shift = base.reshape(2 + hc, hc)[2:]
    comb_scale = scale[2:3]

    def column(j: int) -> mx.array:
        return rows[..., j : j + 1] * comb_scale + shift[:, j : j + 1]  # [B, S, hc, 1]

    top = column(0)
    for j in range(1, hc):
        top = mx.maximum(top, column(j))
    total = mx.exp(column(0) - top)
    for j in range(1, hc):
        total = total + mx.exp(column(j) - top)
    return mx.exp(rows * comb_scale + shift - top) / total + hc_eps


def _fused_collapse(
    raw: mx.array, streams: mx.array, scale: mx.array, base: mx.array, hc_eps: float
) -> mx.array:
    """The block's input [B, S, D]: ``sum_i pre_i * stream_i``, each ``pre_i`` computed
    from its column of the raw mix in the same element-wise string."""
    hc = streams.shape[2]
    wide = streams.shape[:2] + streams.shape[3:]

    def pre(i: int) -> mx.array:
        logit = raw[:, :, i : i + 1] * scale[0:1] + base[i : i + 1]
        return mx.broadcast_to(mx.sigmoid(logit) + hc_eps, wide)

    x = pre(0) * streams[:, :, 0].astype(mx.float32)
    for i in range(1, hc):
        x = x + pre(i) * streams[:, :, i].astype(mx.float32)
    return x.astype(streams.dtype)


def _fused_enter(
    streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array, constants: MixConstants
) -> tuple[mx.array, mx.array, mx.array]:
    """`_enter` as four kernels (module docstring): (the block's input, the raw mix,
    which `_fused_leave` turns into ``post``, and the comb before Sinkhorn)."""
    raw = _fused_mix(streams, fn, constants.norm_eps)
    x = _compiled("collapse", constants)(raw, streams, scale, base)
    comb = _compiled("comb", constants)(raw, scale, base)
    return x, raw, comb


def _fused_leave(
    block_out: mx.array,
    streams: mx.array,
    raw: mx.array,
    scale: mx.array,
    base: mx.array,
    comb: mx.array,
) -> mx.array:
    """`expand` as one element-wise string: stream i gets post_i * out + sum_j comb_ji *
    stream_j, ``post_i`` computed from the raw mix in the string and the sum written
    out over the ``hc`` streams."""
    hc = streams.shape[2]
    logit = _mix_rows(raw, hc)[:, :, 1, :, None] * scale[1:2] + base[hc : 2 * hc, None]
    out = 2.0 * mx.sigmoid(logit) * block_out[:, :, None, :].astype(mx.float32)
    for j in range(hc):
        row = mx.swapaxes(comb[:, :, j : j + 1, :], -1, -2)  # comb_j. as a column [B, S, hc, 1]
        out = out + row * streams[:, :, j : j + 1, :].astype(mx.float32)
    return out.astype(streams.dtype)


def _fused_leave_post(
    block_out: mx.array, streams: mx.array, post: mx.array, comb: mx.array
) -> mx.array:
    """`_fused_leave` given ``post`` itself (the CUDA kernel's, or the ops')."""
    hc = streams.shape[2]
    out = post[..., None] * block_out[:, :, None, :].astype(mx.float32)
    for j in range(hc):
        row = mx.swapaxes(comb[:, :, j : j + 1, :], -1, -2)
        out = out + row * streams[:, :, j : j + 1, :].astype(mx.float32)
    return out.astype(streams.dtype)


@cache
def _compiled(name: str, constants: MixConstants) -> Any:
    """One element-wise string of the fused `enter` or `leave` under ``mx.compile``, for
    one set of constants (the compilation then retraces per input shape, of which a
    server sees a few)."""
    if name == "collapse":

        def collapse_(
            raw: mx.array, streams: mx.array, scale: mx.array, base: mx.array
        ) -> mx.array:
            return _fused_collapse(raw, streams, scale, base, constants.hc_eps)

        return mx.compile(collapse_)
    if name == "comb":

        def comb_(raw: mx.array, scale: mx.array, base: mx.array) -> mx.array:
            return _fused_comb(raw, scale, base, constants.hc, constants.hc_eps)

        return mx.compile(comb_)
    if name == "leave_post":
        return mx.compile(_fused_leave_post)
    return mx.compile(_fused_leave)


@cache
def compiled_agrees(constants: MixConstants) -> bool:
    """Whether the fused `enter` and `leave` (either form of ``post``) build and match
    the ops here (once per process and constants). A failure (no compiler for MLX's
    CPU JIT, say) or a difference leaves the ops in use, with a warning: slower, never
    wrong."""
    hc, dim, mix = constants.hc, 8, (2 + constants.hc) * constants.hc
    streams = mx.random.normal((2, 3, hc, dim), key=mx.random.key(1))
    fn = mx.random.normal((mix, hc * dim), key=mx.random.key(2))
    scale = mx.random.uniform(shape=(3,), key=mx.random.key(3))
    base = mx.random.normal((mix,), key=mx.random.key(4))
    block_out = mx.random.normal((2, 3, dim), key=mx.random.key(5))
    ids = mx.array([0] * hc + [1] * hc + [2] * hc * hc)
    try:
        x, raw, comb = _fused_enter(streams, fn, scale, base, constants)
        theirs = _enter(streams, fn, scale[ids], base, constants)
        mixing = mx.softmax(comb, axis=-1)
        ours_out = _compiled("leave", constants)(block_out, streams, raw, scale, base, mixing)
        with_post = _compiled("leave_post", constants)(block_out, streams, theirs[1], mixing)
        theirs_out = expand(block_out, streams, theirs[1], mixing)
        ours = (x, comb, ours_out, with_post)
        mx.eval(ours)
        worst = max(
            float(mx.abs(a - b).max())
            for a, b in zip(ours, (theirs[0], theirs[2], theirs_out, theirs_out), strict=True)
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

    def _kernel_fuses(self, streams: mx.array, norm: Module | None) -> bool:
        """Whether `enter` with ``norm`` runs as one CUDA kernel (``mlxserve.kernels.
        hyper_connection``): a forward of at most ``compiled_max_rows`` rows on CUDA, a
        plain weighted RMSNorm, and the kernel agreeing with the ops here."""
        rows = streams.shape[0] * streams.shape[1]
        return (
            rows <= self.compiled_max_rows
            and isinstance(norm, RMSNorm)
            and type(norm) in (RMSNorm, InputDtypeRMSNorm)
            and "weight" in norm
            and hc_kernel.available()
            and cuda_agrees(
                self.constants,
                self.iters,
                streams.shape[-1],
                streams.dtype,
                norm["weight"].dtype,
                type(norm),
            )
        )

    def _kernel_parts(
        self, norm: RMSNorm, streams: mx.array
    ) -> tuple[tuple[mx.array, mx.array, mx.array], mx.array, mx.array, mx.Dtype]:
        """The kernel's arguments from this module and ``norm``: (fn, scale, base), the
        norm's weight, the epsilons and the norm's output dtype."""
        weight = norm["weight"]
        consts = _epsilons(self.norm_eps, self.hc_eps, float(norm.eps))
        if isinstance(norm, InputDtypeRMSNorm):
            out_dtype = streams.dtype  # the collapse has the streams' dtype
        else:
            out_dtype = _result_dtype(streams.dtype, weight.dtype)
        return (self.fn, self.scale, self.base), weight, consts, out_dtype

    def enter(
        self, streams: mx.array, norm: Module | None = None
    ) -> tuple[mx.array, mx.array, mx.array]:
        """(the block's input: the streams collapsed [B, S, D], then ``norm`` of it
        when given; post; comb). ``post`` is for `leave` alone: the fused path hands
        the raw mix over in its place."""
        if norm is not None and self._kernel_fuses(streams, norm):
            assert isinstance(norm, RMSNorm)
            mix, weight, consts, dtype = self._kernel_parts(norm, streams)
            return hc_kernel.enter(streams, mix, weight, consts, dtype, self.iters)
        if self._compiles(streams):
            # ``post`` is then the raw mix, which the fused `leave` reads it from.
            x, post, comb = _fused_enter(streams, self.fn, self.scale, self.base, self.constants)
        else:
            scale = self.scale[self._scale_ids]
            x, post, comb = _enter(streams, self.fn, scale, self.base, self.constants)
        x = x if norm is None else norm(x)
        return x, post, sinkhorn(comb, iters=self.iters, eps=self._eps)

    def leave(
        self, block_out: mx.array, streams: mx.array, post: mx.array, comb: mx.array
    ) -> mx.array:
        """The new streams from the block's output (`expand`); ``post`` as `enter`
        returned it."""
        if post.shape[-1] != self.hc:  # the raw mix of the fused `enter`
            leave = _compiled("leave", self.constants)
            out: mx.array = leave(block_out, streams, post, self.scale, self.base, comb)
            return out
        if self._compiles(streams):
            with_post: mx.array = _compiled("leave_post", self.constants)(
                block_out, streams, post, comb
            )
            return with_post
        return expand(block_out, streams, post, comb)

    def leave_enter(
        self,
        block_out: mx.array,
        streams: mx.array,
        post: mx.array,
        comb: mx.array,
        after: HyperConnection,
        norm: Module,
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """`leave`, then ``after.enter`` of the new streams with ``norm``: (the new
        streams, the next block's input, its post, its comb). One CUDA kernel where
        ``after`` enters through the kernel and ``post`` is a real one."""
        if post.shape[-1] == self.hc and after._kernel_fuses(streams, norm):
            assert isinstance(norm, RMSNorm)
            mix, weight, consts, dtype = after._kernel_parts(norm, streams)
            return hc_kernel.leave_enter(
                block_out, streams, post, comb, mix, weight, consts, dtype, after.iters
            )
        new = self.leave(block_out, streams, post, comb)
        return (new, *after.enter(new, norm))


@cache
def _result_dtype(a: Any, b: Any) -> Any:
    """The dtype ``mx.fast.rms_norm`` gives an input of dtype ``a`` and a weight of ``b``."""
    return (mx.zeros((1,), dtype=a) * mx.zeros((1,), dtype=b)).dtype


@cache
def _epsilons(norm_eps: float, hc_eps: float, block_eps: float) -> mx.array:
    """float32 [the flat RMSNorm's eps, hc_eps, the block norm's eps]: the kernel's
    constants, made once."""
    out = mx.array([norm_eps, hc_eps, block_eps], dtype=mx.float32)
    mx.eval(out)
    return out


@cache
def cuda_agrees(
    constants: MixConstants,
    iters: int,
    dim: int,
    dtype: Any,
    weight_dtype: Any,
    norm_type: type[RMSNorm] = InputDtypeRMSNorm,
) -> bool:
    """Whether the CUDA kernels (``mlxserve.kernels.hyper_connection``) build and
    match the ops here, for streams of ``dim`` channels and these dtypes (once per
    process and shape): on random rows, entering (the collapse normalised by an
    RMSNorm, post and the Sinkhorn's comb) and leaving then entering. Float32
    outputs within 2e-3: the kernel sums in float32 in its own order, and the ops'
    matmuls on the GPU differ from such sums by up to 1.1e-3 (an H100, hidden 4096,
    values of about 1: docs/engine.md, "Ops per decode step"); a narrower dtype
    within 5e-2 (a value rounding the other way is one step of its last bit). The
    block norm is of ``norm_type``: the model's ``InputDtypeRMSNorm``, or MLX's. A
    failure or a difference leaves the ops in use, with a warning."""
    args = ModelArgs.from_dict(
        {
            "hidden_size": dim,
            "hc_mult": constants.hc,
            "hc_sinkhorn_iters": iters,
            "hc_eps": constants.hc_eps,
            "rms_norm_eps": constants.norm_eps,
            "vocab_size": 8,
            "num_hidden_layers": 1,
        }
    )
    block = HyperConnection(args)  # type: ignore[arg-type]
    keys = iter(mx.random.split(mx.random.key(21), 8))
    streams = mx.random.normal((1, 3, constants.hc, dim), key=next(keys)).astype(dtype)
    block.fn = mx.random.normal(block.fn.shape, key=next(keys)) * (constants.hc * dim) ** -0.5
    block.base = mx.random.normal(block.base.shape, key=next(keys)) * 0.1
    block.scale = mx.random.uniform(0.5, 1.5, (3,), key=next(keys))
    block.compiled_max_rows = 0  # the ops
    norm = norm_type(dim, eps=1e-6)
    norm.weight = (1 + 0.1 * mx.random.normal((dim,), key=next(keys))).astype(weight_dtype)
    out = mx.random.normal((1, 3, dim), key=next(keys)).astype(dtype)
    try:
        mixing, weight, consts, out_dtype = block._kernel_parts(norm, streams)
        ours = hc_kernel.enter(streams, mixing, weight, consts, out_dtype, iters)
        theirs = block.enter(streams, norm)
        ours_next = hc_kernel.leave_enter(
            out, streams, theirs[1], theirs[2], mixing, weight, consts, out_dtype, iters
        )
        theirs_next = block.leave_enter(out, streams, theirs[1], theirs[2], block, norm)
        pairs = list(zip((*ours, *ours_next), (*theirs, *theirs_next), strict=True))
        mx.eval(pairs)
        worst = max(
            float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max()) for a, b in pairs
        )
    except (RuntimeError, ValueError) as exc:
        log.warning("the hyper-connection kernel failed (%s): using the ops", exc)
        return False
    exact = dtype == mx.float32 and weight_dtype == mx.float32
    if not worst <= (2e-3 if exact else 5e-2):
        log.warning("the hyper-connection kernel differs by %g: using the ops", worst)
        return False
    return True


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
