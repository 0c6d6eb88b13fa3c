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

Decode forwards (fewer than ``SORTED_FROM`` row-picks, quantised experts, no tensor
parallelism) run the whole fused block as one ``mx.compile`` function of the block's
arrays (`_decode_block`): the same ops, traced once per batch size and replayed by MLX
without Python. The host builds a decode step's graph op by op, and on a GPU that
building is about a third of a step's time (docs/engine.md, "On the GPU (H100, stop
32)"); the block's share dropped from 49 to 28 us on this CPU, with the same 16
kernels and the same output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from typing import Any

import mlx.core as mx
from mlx.nn.layers.activations import silu, softplus
from mlx.nn.layers.base import Module
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.quantized import QuantizedLinear
from mlx_lm.models.deepseek_v41 import DeepseekV41SwiGLU, SharedMLP
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

from mlxserve.hardware.tuning import default_tuning

from .config import HASH_MOE, ModelArgs
from .fused_linears import FusedLinears, fused

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


#: (group_size, bits, mode) of a quantised projection.
QuantParams = tuple[int, int, str]


@dataclass(frozen=True)
class BlockSpec:
    """What `_decode_block`'s trace depends on besides its arrays' shapes: one
    compiled function per spec."""

    hashed: bool
    scoring_func: str
    top_k: int
    limit: float
    scale: float
    #: up, gate and down projections of the routed experts
    experts: tuple[QuantParams, QuantParams, QuantParams]
    #: the shared expert's fused up and gate (None: float) and its down projection
    shared_in: QuantParams | None
    shared_out: QuantParams | None
    #: rows of the shared ``up_proj`` in the fused up-and-gate output
    shared_up_rows: int


def _project(
    x: mx.array, arrays: dict[str, mx.array], name: str, q: QuantParams | None
) -> mx.array:
    """``x`` times projection ``name``'s weight (transposed), quantised or float."""
    if q is None:
        return x @ arrays[name + "_w"].T
    return mx.quantized_matmul(
        x,
        arrays[name + "_w"],
        scales=arrays[name + "_s"],
        biases=arrays.get(name + "_b"),
        transpose=True,
        group_size=q[0],
        bits=q[1],
        mode=q[2],
    )


@cache
def _decode_block(spec: BlockSpec) -> Any:
    """`MoE.fused`'s ops for a decode batch as one compiled function of
    (flat rows [N, D], the block's arrays)."""

    def block(flat: mx.array, arrays: dict[str, mx.array]) -> mx.array:
        logits = flat.astype(mx.float32) @ arrays["gate"].astype(mx.float32).T
        if spec.hashed:
            scores = _scores(logits, spec.scoring_func)
            chosen = arrays["tid2eid"][arrays["token_ids"].reshape(-1)].astype(mx.uint32)
        else:
            scores, ranked = _scored(logits, arrays["bias"].astype(mx.float32), spec.scoring_func)
            chosen = mx.argpartition(ranked, spec.top_k - 1, axis=-1)[..., : spec.top_k]
        chosen = mx.stop_gradient(chosen)  # as `Gate.fused`: the choice is discrete
        picked = mx.take_along_axis(scores, chosen, axis=-1)
        h = mx.expand_dims(flat, (-2, -3))
        # As `quantized_experts`: each row once for up and gate, each pick its own for down.
        each_row = mx.broadcast_to(arrays["rows"], chosen.shape)

        def experts(x: mx.array, name: str, q: QuantParams, rows: mx.array) -> mx.array:
            out: mx.array = mx.gather_qmm(
                x,
                arrays[name + "_w"],
                arrays[name + "_s"],
                arrays.get(name + "_b"),
                lhs_indices=rows,
                rhs_indices=chosen,
                transpose=True,
                group_size=q[0],
                bits=q[1],
                mode=q[2],
                sorted_indices=False,
            )
            return out

        up_q, gate_q, down_q = spec.experts
        up, gate = experts(h, "up", up_q, each_row), experts(h, "gate", gate_q, each_row)
        act = clamped_swiglu(up, gate, spec.limit)
        routed = experts(act, "down", down_q, arrays["pick_rows"]).squeeze(-2)
        both = _project(flat, arrays, "shared_in", spec.shared_in)
        n = spec.shared_up_rows
        hidden = clamped_swiglu(both[..., :n], both[..., n:], spec.limit).astype(flat.dtype)
        shared = _project(hidden, arrays, "shared_out", spec.shared_out)
        return _mixed(routed, picked, shared, spec.scale)

    return mx.compile(block)


@dataclass
class DecodePlan:
    """A block's compiled decode function and the arrays it takes, with what they
    were read from (`MoE._decode_sources`)."""

    sources: tuple[Any, ...]
    block: Any  # the compiled `_decode_block`, None where it does not apply
    arrays: dict[str, mx.array]

    def fresh(self, sources: tuple[Any, ...]) -> bool:
        """Whether ``sources`` are the very objects this plan was made from."""
        return len(sources) == len(self.sources) and all(
            a is b for a, b in zip(sources, self.sources, strict=True)
        )


def _quant_params(layer: Module) -> QuantParams | None:
    """A projection `_decode_block` can take: its quantisation (None: float), or
    raises ValueError for one it cannot (a bias, a global scale, another kind)."""
    if "bias" in layer or getattr(layer, "global_scale", None) is not None:
        raise ValueError("a bias or a global scale")
    if type(layer) in (QuantizedLinear, QuantizedSwitchLinear):
        return (layer.group_size, layer.bits, layer.mode)
    if type(layer) is Linear:
        return None
    raise ValueError(f"a {type(layer).__name__}")


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
        # Decode forwards run the fused block as one compiled function (module
        # docstring); False: op by op, as before (the self-check compares both).
        self.compile_decode = True
        self._decode_plan: DecodePlan | None = None

    def __call__(self, x: mx.array, token_ids: mx.array | None = None) -> mx.array:
        rows = x.size // self.hidden_size
        if rows <= self.fused_max_rows and fused_agrees(self.limit):
            return self.fused(x, token_ids)
        return self.plain(x, token_ids)

    def fused(self, x: mx.array, token_ids: mx.array | None = None) -> mx.array:
        """The block with its small ops fused (module docstring)."""
        shape = x.shape
        flat = x.reshape(-1, self.hidden_size)
        compiled = self._decode_call(flat, token_ids)
        if compiled is not None:
            return compiled.reshape(shape).astype(x.dtype)
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

    def _decode_call(self, flat: mx.array, token_ids: mx.array | None) -> mx.array | None:
        """`_decode_block` on ``flat``, or None where it does not apply: a forward of
        many row-picks (the experts sort their rows), experts or shared projections it
        does not take, tensor parallelism (its sum), a hash layer without token ids."""
        count = flat.shape[0]
        gate = self.gate
        if count * gate.top_k >= SORTED_FROM or self.sharding_group is not None:
            return None
        if not self.compile_decode or (gate.hashed and token_ids is None):
            return None
        plan = self._decode_plan
        sources = self._decode_sources()
        if plan is None or not plan.fresh(sources):
            plan = self._plan_decode(sources)
            self._decode_plan = plan
        if plan.block is None:
            return None
        arrays = dict(plan.arrays)
        arrays["rows"] = _rows(count, 1)
        # A hash layer picks as many experts as its table has columns.
        picks = plan.arrays["tid2eid"].shape[-1] if gate.hashed else gate.top_k
        arrays["pick_rows"] = _rows(count, picks)
        if token_ids is not None and gate.hashed:
            arrays["token_ids"] = token_ids
        out: mx.array = plan.block(flat, arrays)
        return out

    def _decode_sources(self) -> tuple[Any, ...]:
        """The modules and arrays `_plan_decode` read: a plan made from others (a load,
        a shard, a quantisation since) is made again."""
        experts, shared = self.switch_mlp, self.shared_experts
        layers = (
            experts.up_proj,
            experts.gate_proj,
            experts.down_proj,
            shared.up_proj,
            shared.gate_proj,
            shared.down_proj,
        )
        gate = self.gate
        table = gate.get("tid2eid") if gate.hashed else gate.get("bias")
        arrays = [layer.get(key) for layer in layers for key in ("weight", "scales", "biases")]
        return (gate, gate.get("weight"), table, *layers, *arrays)

    def _plan_decode(self, sources: tuple[Any, ...]) -> DecodePlan:
        """The spec and arrays of `_decode_block` for this block, or a plan without a
        block where its layers are not ones it takes."""
        experts, shared = self.switch_mlp, self.shared_experts
        if not _plainly_quantized(experts):
            return DecodePlan(sources, None, {})
        both = fused(self, "_shared_in", (shared.up_proj, shared.gate_proj))
        # Fusing re-points the shared up and gate to their rows: what is read from now on.
        none = DecodePlan(self._decode_sources(), None, {})
        if len(both.groups) != 1 or len(both.groups[0][0]) != 2:
            return none  # the shared up and gate did not concatenate
        group: FusedLinears = both.groups[0][1]
        try:
            projections = (experts.up_proj, experts.gate_proj, experts.down_proj)
            experts_q = tuple(_quant_params(p) for p in projections)
            shared_in = _quant_params(group.layer)
            shared_out = _quant_params(shared.down_proj)
        except ValueError:
            return none
        if any(q is None for q in experts_q):
            return none
        spec = BlockSpec(
            hashed=self.gate.hashed,
            scoring_func=self.gate.scoring_func,
            top_k=self.gate.top_k,
            limit=self.limit,
            scale=self.gate.scale,
            experts=experts_q,  # type: ignore[arg-type]
            shared_in=shared_in,
            shared_out=shared_out,
            shared_up_rows=group.bounds[1],
        )
        arrays = {"gate": self.gate["weight"]}
        table = "tid2eid" if self.gate.hashed else "bias"
        arrays[table] = self.gate[table]
        for name, layer in (
            *zip(("up", "gate", "down"), projections, strict=True),
            ("shared_out", shared.down_proj),
        ):
            for key, suffix in (("weight", "_w"), ("scales", "_s"), ("biases", "_b")):
                if key in layer:
                    arrays[name + suffix] = layer[key]
        for key, suffix in (("weight", "_w"), ("scales", "_s"), ("biases", "_b")):
            if key in group.arrays:
                arrays["shared_in" + suffix] = group.arrays[key]
        return DecodePlan(none.sources, _decode_block(spec), arrays)

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
            theirs = block.plain(x, tokens)
            for compiled in (True, False):  # `_decode_block`, and the block op by op
                block.compile_decode = compiled
                ours = block.fused(x, tokens)
                worst = max(worst, float(mx.abs(ours - theirs).max()))
    except (RuntimeError, ValueError) as exc:
        log.warning("the fused MoE failed (%s): using the ops", exc)
        return False
    if not worst <= 1e-4:
        log.warning("the fused MoE differs by %g: using the ops", worst)
        return False
    return True


__all__ = ["Gate", "MoE", "clamped_swiglu", "fused_agrees", "quantized_experts"]
