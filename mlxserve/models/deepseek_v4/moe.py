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
"""

from __future__ import annotations

import mlx.core as mx
from mlx.nn.layers.activations import softplus
from mlx.nn.layers.base import Module
from mlx_lm.models.deepseek_v41 import DeepseekV41SwiGLU, SharedMLP
from mlx_lm.models.switch_layers import SwitchGLU

from .config import HASH_MOE, ModelArgs


def _scores(logits: mx.array, scoring_func: str) -> mx.array:
    if scoring_func == "sqrtsoftplus":
        return mx.sqrt(softplus(logits))
    if scoring_func == "sigmoid":
        return mx.sigmoid(logits)
    if scoring_func == "softmax":
        return mx.softmax(logits, axis=-1, precise=True)
    raise ValueError(f"Unknown scoring_func {scoring_func!r}.")


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

    def __call__(self, x: mx.array, token_ids: mx.array | None = None) -> mx.array:
        shape = x.shape
        flat = x.reshape(-1, self.hidden_size)
        chosen, weights = self.gate(flat, token_ids)
        routed = self.switch_mlp(flat, chosen)  # [N, k, D]
        out = mx.sum(routed.astype(mx.float32) * weights[..., None], axis=1)
        out = out + self.shared_experts(flat).astype(mx.float32)
        if self.sharding_group is not None:
            out = mx.distributed.all_sum(out, group=self.sharding_group)
        return out.reshape(shape).astype(x.dtype)
