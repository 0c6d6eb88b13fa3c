"""DeepSeek-V4 mixture of experts: routed (top-k) or hash-routed, plus a shared expert.

* Routed layers pick the top-k experts of ``score + bias`` and weight them by the
  unbiased scores (``sqrt(softplus(logits))`` by default), normalised, times
  ``routed_scaling_factor``.
* Hash layers (the first ``num_hash_layers``) take the experts from a frozen
  ``tid2eid[token_id]`` table and weight them the same way, with no bias; so the MoE
  needs the token ids.

The reference always normalises the picked weights (it ignores ``norm_topk_prob``),
and so does this module. Experts run through ``mlx_lm``'s ``SwitchGLU`` (stacked,
quantisable, shardable) with the clamped SwiGLU of ``deepseek_v41``; the shared
expert is ``deepseek_v41``'s ``SharedMLP``, which is the same.

Fused (forwards of at most the tuning's ``compiled_decode_max_rows`` rows, set by
``Model.tune``): as ops the block is about 30 kernels, most of them tiny. The router's
scoring and bias are one compiled element-wise string; the normalisation of the picked
weights and the mixing of the experts' outputs with the shared expert's are another
(the sums over the ``top_k`` picks written out pairwise, the normalisation applied
once to the weighted sum); each clamped SwiGLU is one; the shared expert's
``up_proj`` and ``gate_proj`` are one matmul (``fused_linears.py``); and quantised
experts are called with their row ids as a constant of the batch size, where
``gather_qmm`` would otherwise build and cast an ``arange`` per call. Only the order
and rounding of a few float32 terms of each sum differ from the ops; the fused block
checks itself once per process against the ops (``fused_agrees``) and is not used if
it differs.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import mlx.core as mx
from mlx.nn.layers.activations import silu, softplus
from mlx.nn.layers.base import Module
from mlx_lm.models.deepseek_v41 import DeepseekV41SwiGLU, SharedMLP
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

from mlxserve.hardware.tuning import default_tuning

from .config import HASH_MOE, ModelArgs
from .fused_linears import fused

log = logging.getLogger(__name__)
#: ``SwitchGLU`` sorts the rows by expert from this many (row, pick) pairs on.
SORTED_FROM = 64


def _scores(logits: mx.array, scoring_func: str) -> mx.array:
    if scoring_func == "sqrtsoftplus":
        return mx.sqrt(softplus(logits))
    if scoring_func == "sigmoid":
        return mx.sigmoid(logits)
    if scoring_func == "softmax":
        return mx.softmax(logits, axis=-1, precise=True)
    raise ValueError(f"Unknown scoring_func {scoring_func!r}.")


def clamped_swiglu(up: mx.array, gate: mx.array, limit: float) -> mx.array:
    """``DeepseekV41SwiGLU`` as one element-wise string (the same ops)."""
    dtype = up.dtype
    gate = gate.astype(mx.float32)
    up = up.astype(mx.float32)
    if limit > 0:
        gate = mx.minimum(gate, limit)
        up = mx.clip(up, -limit, limit)
    out: mx.array = (silu(gate) * up).astype(dtype)
    return out


@cache
def _compiled_swiglu(limit: float) -> Any:
    def act(up: mx.array, gate: mx.array) -> mx.array:
        return clamped_swiglu(up, gate, limit)

    return mx.compile(act, shapeless=True)


def _scored(logits: mx.array, bias: mx.array, scoring_func: str) -> tuple[mx.array, mx.array]:
    """(scores, minus the biased scores: what argpartition ranks)."""
    scores = _scores(logits, scoring_func)
    return scores, -(scores + bias)


def _tree_sum(terms: list[mx.array]) -> mx.array:
    """The terms added pairwise: a string of depth log2(n), not n, so that MLX's
    compiler (which ends a kernel at a depth of 11) keeps it in one kernel."""
    while len(terms) > 1:
        pairs = [a + b for a, b in zip(terms[::2], terms[1::2], strict=False)]
        terms = pairs + ([terms[-1]] if len(terms) % 2 else [])
    return terms[0]


def _mixed(routed: mx.array, picked: mx.array, shared: mx.array, scale: float) -> mx.array:
    """sum_k weights_k * routed_k + shared, in float32, the weights the picked scores
    over their sum times ``scale``, as one element-wise string: the sums written out
    over the picks' own columns (no intermediate is sliced), and the normalisation
    applied once to the weighted sum, ``sum_k p_k r_k * (scale / sum_k p_k)`` (the
    same value up to the rounding of a few float32 terms)."""
    picks = range(picked.shape[-1])
    total = _tree_sum([picked[..., i : i + 1] for i in picks])
    weighted = _tree_sum([routed[:, i].astype(mx.float32) * picked[:, i : i + 1] for i in picks])
    return weighted * (scale / (total + 1e-20)) + shared.astype(mx.float32)


@cache
def _compiled(name: str, scoring_func: str = "", scale: float = 1.0) -> Any:
    """One fused piece of the block under ``mx.compile`` (shapes vary: shapeless where
    no shape enters the trace)."""
    if name == "scored":

        def scored(logits: mx.array, bias: mx.array) -> tuple[mx.array, mx.array]:
            return _scored(logits, bias, scoring_func)

        return mx.compile(scored, shapeless=True)
    if name == "scores":

        def scores(logits: mx.array) -> mx.array:
            return _scores(logits, scoring_func)

        return mx.compile(scores, shapeless=True)

    def mixed(routed: mx.array, picked: mx.array, shared: mx.array) -> mx.array:
        return _mixed(routed, picked, shared, scale)

    return mx.compile(mixed)


@cache
def _rows(count: int, picks: int) -> mx.array:
    """[count, picks] row ids (uint32) of a ``gather_qmm`` over ``count`` x ``picks``,
    made once per shape (a constant, not a node of every step)."""
    rows = mx.arange(count * picks, dtype=mx.uint32).reshape(count, picks)
    mx.eval(rows)
    return rows


def quantized_experts(layer: QuantizedSwitchLinear, x: mx.array, chosen: mx.array) -> mx.array:
    """``layer(x, chosen)`` unsorted, with the rows' ids given (``_rows``): x is
    [N, 1, 1, D] (each row once) or [N, k, 1, D] (each pick its own)."""
    lhs = _rows(x.shape[0], x.shape[1])
    if x.shape[1] == 1:
        lhs = mx.broadcast_to(lhs, chosen.shape)
    out: mx.array = mx.gather_qmm(
        x,
        layer["weight"],
        layer["scales"],
        layer.get("biases"),
        lhs_indices=lhs,
        rhs_indices=chosen,
        transpose=True,
        group_size=layer.group_size,
        bits=layer.bits,
        mode=layer.mode,
        global_scale=layer.global_scale,
        sorted_indices=False,
    )
    return out


class Gate(Module):
    """Router: ``weight`` plus ``bias`` (routed) or ``tid2eid`` (hash)."""

    def __init__(self, args: ModelArgs, hashed: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.hashed = hashed
        self.top_k = args.num_experts_per_tok
        self.scoring_func = args.scoring_func
        self.scale = args.routed_scaling_factor
        self.weight = mx.zeros((args.n_routed_experts, args.hidden_size), dtype=mx.float32)
        if hashed:
            self.tid2eid = mx.zeros((args.vocab_size, self.top_k), dtype=mx.int32)
        else:
            self.bias = mx.zeros((args.n_routed_experts,), dtype=mx.float32)

    def __call__(self, x: mx.array, token_ids: mx.array | None) -> tuple[mx.array, mx.array]:
        """Return the experts [N, k] and their weights [N, k] for flat ``x`` [N, D]."""
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T
        scores = _scores(logits, self.scoring_func)
        if self.hashed:
            if token_ids is None:
                raise ValueError("Hash-routed MoE layers need the token ids.")
            chosen = self.tid2eid[token_ids.reshape(-1)].astype(mx.int32)
        else:
            biased = scores + self.bias.astype(mx.float32)
            chosen = mx.argpartition(-biased, self.top_k - 1, axis=-1)[..., : self.top_k]
        # The choice is discrete: no gradient flows through it (needed for training).
        chosen = mx.stop_gradient(chosen)
        weights = mx.take_along_axis(scores, chosen, axis=-1)
        weights = weights / (mx.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return chosen, weights * self.scale

    def fused(self, x: mx.array, token_ids: mx.array | None) -> tuple[mx.array, mx.array]:
        """The experts (uint32: what ``gather_qmm`` takes) and their scores, not yet
        normalised (the fused mixing does it: ``_mixed``)."""
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T
        if self.hashed:
            if token_ids is None:
                raise ValueError("Hash-routed MoE layers need the token ids.")
            scores = _compiled("scores", self.scoring_func)(logits)
            chosen = self.tid2eid[token_ids.reshape(-1)].astype(mx.uint32)
        else:
            scored = _compiled("scored", self.scoring_func)
            scores, ranked = scored(logits, self.bias.astype(mx.float32))
            chosen = mx.argpartition(ranked, self.top_k - 1, axis=-1)[..., : self.top_k]
        chosen = mx.stop_gradient(chosen)
        return chosen, mx.take_along_axis(scores, chosen, axis=-1)


class MoE(Module):
    """Routed experts (``switch_mlp``) plus the shared expert."""

    def __init__(self, args: ModelArgs, mlp_type: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.hidden_size = args.hidden_size
        self.gate = Gate(args, hashed=mlp_type == HASH_MOE)
        self.switch_mlp = SwitchGLU(
            args.hidden_size,
            args.moe_intermediate_size,
            args.n_routed_experts,
            activation=DeepseekV41SwiGLU(args.swiglu_limit),
        )
        # SharedMLP reads hidden_size, moe_intermediate_size and swiglu_limit, which
        # V4's args have under the same names.
        self.shared_experts = SharedMLP(args)  # type: ignore[arg-type]
        # Set by ``shard``: the experts' intermediate dim is split, so sum the partials.
        self.sharding_group: mx.distributed.Group | None = None
        self.limit = args.swiglu_limit
        # The tuning's knob (``Model.tune``): forwards of at most this many rows fuse.
        self.fused_max_rows = default_tuning().compiled_decode_max_rows

    def __call__(self, x: mx.array, token_ids: mx.array | None = None) -> mx.array:
        rows = x.size // self.hidden_size
        if rows <= self.fused_max_rows and fused_agrees(self.limit):
            return self.fused(x, token_ids)
        return self.plain(x, token_ids)

    def fused(self, x: mx.array, token_ids: mx.array | None = None) -> mx.array:
        """The block with its small ops fused (module docstring)."""
        shape = x.shape
        flat = x.reshape(-1, self.hidden_size)
        chosen, picked = self.gate.fused(flat, token_ids)
        act = _compiled_swiglu(self.limit)
        experts = self.switch_mlp
        if chosen.size < SORTED_FROM and _plainly_quantized(experts):
            h = mx.expand_dims(flat, (-2, -3))
            up = quantized_experts(experts.up_proj, h, chosen)
            gate = quantized_experts(experts.gate_proj, h, chosen)
            routed = quantized_experts(experts.down_proj, act(up, gate), chosen).squeeze(-2)
        else:
            routed = experts(flat, chosen)
        shared_mlp = self.shared_experts
        # One matmul for the two where they concatenate (``fused_linears.py``).
        both = fused(self, "_shared_in", (shared_mlp.up_proj, shared_mlp.gate_proj))
        up, gate = both(flat)
        hidden = act(up, gate).astype(flat.dtype)
        mixing = _compiled("mixed", scale=self.gate.scale)
        out = mixing(routed, picked, shared_mlp.down_proj(hidden))
        if self.sharding_group is not None:
            out = mx.distributed.all_sum(out, group=self.sharding_group)
        mixed: mx.array = out.reshape(shape).astype(x.dtype)
        return mixed

    def plain(self, x: mx.array, token_ids: mx.array | None = None) -> mx.array:
        """The block as ops."""
        shape = x.shape
        flat = x.reshape(-1, self.hidden_size)
        chosen, weights = self.gate(flat, token_ids)
        routed = self.switch_mlp(flat, chosen)  # [N, k, D]
        out = mx.sum(routed.astype(mx.float32) * weights[..., None], axis=1)
        out = out + self.shared_experts(flat).astype(mx.float32)
        if self.sharding_group is not None:
            out = mx.distributed.all_sum(out, group=self.sharding_group)
        return out.reshape(shape).astype(x.dtype)


def _plainly_quantized(experts: SwitchGLU) -> bool:
    """Experts that are mlx-lm's own quantised switch layers (not a kernel variant's
    subclass, which keeps its own call), without biases."""
    layers = (experts.up_proj, experts.gate_proj, experts.down_proj)
    return all(type(p) is QuantizedSwitchLinear and "bias" not in p for p in layers)


@cache
def fused_agrees(limit: float) -> bool:
    """Whether the fused block builds and matches the ops here, on a small random
    block with quantised experts, routed and hashed (once per process and limit)."""
    args = ModelArgs(
        vocab_size=16,
        hidden_size=64,
        moe_intermediate_size=64,
        n_routed_experts=8,
        num_experts_per_tok=3,
        num_hidden_layers=1,
        swiglu_limit=limit,
    )
    worst = 0.0
    try:
        for kind in (HASH_MOE, "moe"):
            block = MoE(args, kind)
            keys = iter(mx.random.split(mx.random.key(11), 12))
            block.gate.weight = mx.random.normal(block.gate.weight.shape, key=next(keys))
            if kind == HASH_MOE:
                table = mx.random.randint(0, 8, block.gate.tid2eid.shape, key=next(keys))
                block.gate.tid2eid = table.astype(mx.int32)
            else:
                block.gate.bias = mx.random.normal((8,), key=next(keys)) * 0.1
            for proj in ("up_proj", "gate_proj", "down_proj"):
                layer = getattr(block.switch_mlp, proj)
                layer.weight = mx.random.normal(layer.weight.shape, key=next(keys)) * 0.2
                shared = getattr(block.shared_experts, proj)
                shared.weight = mx.random.normal(shared.weight.shape, key=next(keys)) * 0.2
            block.switch_mlp.update_modules(
                {
                    proj: getattr(block.switch_mlp, proj).to_quantized(32, 4)
                    for proj in ("up_proj", "gate_proj", "down_proj")
                }
            )
            x = mx.random.normal((3, 1, 64), key=next(keys))
            tokens = mx.array([[1], [5], [9]])
            ours, theirs = block.fused(x, tokens), block.plain(x, tokens)
            worst = max(worst, float(mx.abs(ours - theirs).max()))
    except (RuntimeError, ValueError) as exc:
        log.warning("the fused MoE failed (%s): using the ops", exc)
        return False
    if not worst <= 1e-4:
        log.warning("the fused MoE differs by %g: using the ops", worst)
        return False
    return True


__all__ = ["Gate", "MoE", "clamped_swiglu", "fused_agrees", "quantized_experts"]
