"""DeepSeek-V4-Flash-0731's DSpark draft head: a block drafter over the target's taps.

The -0731 release keeps V4-Flash's architecture but ships, under ``mtp.0`` .. ``mtp.N``,
a DSpark draft head instead of the single MTP block. It drafts a whole block at once,
where MTP drafts one token per forward:

* **Taps.** The verify forward of the main model keeps, for every position, the mean
  over the hyper-connection streams after each layer of ``dspark_target_layer_ids``
  (``Model.forward_hidden(taps=...)``). ``main_proj`` (over those taps side by side)
  and ``main_norm`` (published on stage 0) turn them into one context row per
  position.
* **Stages.** Each ``mtp.I`` stage is a V4 decoder block (sliding attention, routed
  MoE, hyper-connections) whose attention reads the context rows as keys (their own
  K=V rows, rotated at their positions, kept per stage like a cache) next to the block
  itself: the anchor (the last known token, at position ``n``) and
  ``dspark_block_size - 1`` copies of ``dspark_noise_token_id``. The block attends to
  itself both ways: it is denoised at once.
* **Output.** The last stage's ``hc_head`` and ``norm`` and the main model's output
  head give base logits for positions ``n + 1 .. n + block``; the low-rank Markov head
  adds ``markov_w2(markov_w1(previous token))``, so drafts are drawn one after the
  other from the base logits plus the bias of the draft before.
* **Confidence.** ``confidence_head.proj`` on the draft hidden state (and, when its
  width says so, the previous token's Markov embedding) gives the chance that each
  draft is kept: the engine verifies only the drafts worth their verify cost
  (``mlxserve.engine.spec.dspark``).

The published names sit on the stages (``mtp.0.main_proj``, ``mtp.2.markov_head``...);
here the parts used once live on the head (``dspark.main_proj``, ``dspark.markov_head``,
``dspark.hc_head``...) and the stages are plain decoder blocks. Facts from public
sources (mlx-vlm #2095 / PR #2097, DeepSpec); mlx-vlm's drafter is the numerical
reference of ``tests/models/test_dspark.py``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.normalization import RMSNorm

from .config import SLIDING, ModelArgs
from .hyper_connections import HyperConnection, HyperHead
from .moe import MoE
from .norm import InputDtypeRMSNorm
from .sanitize import sanitize_weights

if TYPE_CHECKING:
    from .attention import Attention
    from .model import Model

T = TypeVar("T")

#: config.json keys that only a checkpoint with a DSpark head carries.
CONFIG_KEYS = (
    "dspark_block_size",
    "dspark_target_layer_ids",
    "dspark_markov_rank",
    "dspark_noise_token_id",
)
#: Parts of a DSpark stage that a plain MTP block does not have.
_DSPARK_PARTS = (".main_proj.", ".main_norm.", ".markov_head.", ".confidence_head.")
#: Published per-stage names of the parts the head holds once (stage prefix removed).
_HEAD_PARTS = ("main_proj.", "main_norm.", "markov_head.", "confidence_head.", "norm.", "hc_head")
_STAGE = re.compile(r"^mtp\.(\d+)\.(.+)$")


def is_draft_tensor(name: str) -> bool:
    """A tensor of the draft head (``mtp.*``, with or without ``model.``)."""
    return name.removeprefix("model.").startswith("mtp.")


def has_dspark_head(config: Mapping[str, Any], names: Iterable[str] = ()) -> bool:
    """Whether ``config`` or the tensor ``names`` show a DSpark draft head."""
    sections = [config]
    if isinstance(config.get("text_config"), Mapping):
        sections.append(config["text_config"])
    if any(section.get(key) for section in sections for key in CONFIG_KEYS):
        return True
    return any(is_draft_tensor(n) and any(p in n for p in _DSPARK_PARTS) for n in names)


def drop_draft_head(weights: Mapping[str, T]) -> dict[str, T]:
    """``weights`` without the draft head's tensors."""
    return {name: value for name, value in weights.items() if not is_draft_tensor(name)}


@dataclass(frozen=True)
class DSparkSpec:
    """The head's shape, from ``config.json`` and the tensors."""

    #: positions of a drafted block (drafts per forward)
    block_size: int
    #: main layers (0-based) whose streams' mean the head reads
    target_layers: tuple[int, ...]
    #: fills the block after its anchor
    noise_token: int
    stages: int
    markov_rank: int
    #: whether the confidence head also reads the previous token's Markov embedding
    confidence_with_markov: bool


class MarkovHead(Module):
    """Low-rank bias on a draft's logits from the token before it."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.markov_w1 = Embedding(vocab_size, rank)
        self.markov_w2 = Linear(rank, vocab_size, bias=False)

    def embed(self, previous: mx.array) -> mx.array:
        out: mx.array = self.markov_w1(previous)
        return out

    def bias(self, previous: mx.array) -> mx.array:
        """[..., vocab] added to the base logits of the draft after ``previous``."""
        out: mx.array = self.markov_w2(self.embed(previous))
        return out


class ConfidenceHead(Module):
    """The chance that a draft is kept, from its hidden state (and its Markov input)."""

    def __init__(self, width: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.proj = Linear(width, 1, bias=True)

    def __call__(self, features: mx.array) -> mx.array:
        return mx.sigmoid(self.proj(features)[..., 0].astype(mx.float32))


class DSparkStage(Module):
    """One draft stage: a V4 sliding-attention MoE block (DeepSeek's parameter names)
    whose attention sees the context rows next to the block."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        from .attention import Attention

        self.attn = Attention(args, SLIDING)
        self.ffn = MoE(args, "moe")
        self.attn_norm = InputDtypeRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.ffn_norm = InputDtypeRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.hc_attn = HyperConnection(args)  # type: ignore[arg-type]
        self.hc_ffn = HyperConnection(args)  # type: ignore[arg-type]

    def context_rows(self, context: mx.array, start: int | mx.array) -> mx.array:
        """This stage's rotated K=V rows [B, S, head_dim] of context [B, S, D] at ``start``."""
        attn = self.attn
        rows: mx.array = attn.rope(attn.norm(attn.wkv(context)), offset=start)
        return rows

    def __call__(
        self, streams: mx.array, keys: mx.array, visible: mx.array | None, start: int | mx.array
    ) -> mx.array:
        x, post, comb = self.hc_attn.enter(streams)
        h = block_attention(self.attn, self.attn_norm(x), keys, visible, start)
        streams = self.hc_attn.leave(h, streams, post, comb)
        x, post, comb = self.hc_ffn.enter(streams)
        h = self.ffn(self.ffn_norm(x), None)
        out: mx.array = self.hc_ffn.leave(h, streams, post, comb)
        return out


def block_attention(
    attn: Attention, x: mx.array, keys: mx.array, visible: mx.array | None, start: int | mx.array
) -> mx.array:
    """The block [B, L, D] (at positions ``start ..``) attending to the context rows
    ``keys`` [B, T, head_dim] (``visible`` [B, T], None: all) and to itself, both ways."""
    batch, length, _ = x.shape
    q = attn.wq_b(attn.q_norm(attn.wq_a(x))).reshape(batch, length, attn.num_heads, -1)
    q = attn.rope(mx.fast.rms_norm(q, None, attn.eps).swapaxes(1, 2), offset=start)
    own = attn.rope(attn.norm(attn.wkv(x)), offset=start)
    all_keys = mx.concatenate([keys.astype(own.dtype), own], axis=1)[:, None]
    mask = None
    if visible is not None:
        mask = mx.concatenate([visible, mx.ones((batch, length), dtype=mx.bool_)], axis=1)
        mask = mask[:, None, None, :]
    out = mx.fast.scaled_dot_product_attention(
        q,
        all_keys,
        all_keys,
        scale=attn.head_dim**-0.5,
        mask=mask,
        sinks=attn.attn_sink.astype(q.dtype),
    )
    out = attn.rope(out, offset=start, inverse=True).swapaxes(1, 2)
    out = attn.wo_a(out.reshape(batch * length, attn.o_groups, 1, -1), attn._group_ids)
    result: mx.array = attn.wo_b(out.reshape(batch, length, -1))
    return result


class DSparkHead(Module):
    """The stages and the parts used once (context projection, output, Markov and
    confidence heads). The embedding and the output head are the main model's."""

    def __init__(self, args: ModelArgs, spec: DSparkSpec) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        hidden = args.hidden_size
        self.spec = spec
        self.hc_mult = args.hc_mult
        self.sliding_window = args.sliding_window
        self.main_proj = Linear(hidden * len(spec.target_layers), hidden, bias=False)
        self.main_norm = InputDtypeRMSNorm(hidden, eps=args.rms_norm_eps)
        self.stages = [DSparkStage(args) for _ in range(spec.stages)]
        self.hc_head = HyperHead(args)
        self.norm = RMSNorm(hidden, eps=args.rms_norm_eps)
        self.markov_head = MarkovHead(args.vocab_size, spec.markov_rank)
        width = hidden + (spec.markov_rank if spec.confidence_with_markov else 0)
        self.confidence_head = ConfidenceHead(width)

    def context(self, taps: Sequence[mx.array] | mx.array) -> mx.array:
        """Context rows [B, S, D] from the taps (a list of [B, S, D], or them side by side)."""
        joined = taps if isinstance(taps, mx.array) else mx.concatenate(list(taps), axis=-1)
        out: mx.array = self.main_norm(self.main_proj(joined))
        return out

    def stage_keys(self, context: mx.array, start: int | mx.array) -> list[mx.array]:
        """Each stage's rotated K=V rows of ``context`` at positions ``start ..``."""
        return [stage.context_rows(context, start) for stage in self.stages]

    def block_inputs(self, anchor: mx.array) -> mx.array:
        """[B, block]: each row's anchor, then the noise token."""
        rows = anchor.shape[0]
        noise = mx.full((rows, self.spec.block_size - 1), self.spec.noise_token, mx.int32)
        return mx.concatenate([anchor.reshape(rows, 1).astype(mx.int32), noise], axis=1)

    def hidden(
        self,
        model: Model,
        anchor: mx.array,
        keys: Sequence[mx.array],
        start: int | mx.array,
        visible: mx.array | None = None,
    ) -> mx.array:
        """Draft hidden states [B, block, D] for the block anchored at ``start``.

        ``keys``: per stage, its context rows [B, T, head_dim] (``stage_keys``), for the
        positions before ``start``; ``visible`` [B, T] masks padded ones.
        """
        inputs = self.block_inputs(anchor)
        h = model.model.embed_tokens(inputs)
        batch, length, dim = h.shape
        streams = mx.broadcast_to(h[:, :, None, :], (batch, length, self.hc_mult, dim))
        for stage, stage_keys in zip(self.stages, keys, strict=True):
            streams = stage(streams, stage_keys, visible, start)
        out: mx.array = self.norm(self.hc_head(streams))
        return out

    def step_logits(self, base: mx.array, previous: mx.array) -> mx.array:
        """A draft's logits: its base logits plus the Markov bias of the token before it."""
        return base + self.markov_head.bias(previous).astype(base.dtype)

    def confidence(self, hidden: mx.array, previous: mx.array) -> mx.array:
        """The chance each draft is kept: ``hidden`` [..., D], ``previous`` [...] the
        token before each draft."""
        features = hidden
        if self.spec.confidence_with_markov:
            markov = self.markov_head.embed(previous).astype(hidden.dtype)
            features = mx.concatenate([hidden, markov], axis=-1)
        return self.confidence_head(features)


def head_of(model: Any) -> DSparkHead | None:
    """The model's DSpark head, if its checkpoint shipped one."""
    head = model.get("dspark") if isinstance(model, Module) else None
    return head if isinstance(head, DSparkHead) else None


def split_head(weights: Mapping[str, T]) -> tuple[dict[str, T], dict[str, T]]:
    """(main model's tensors, the draft head's: ``mtp.*`` published or ``dspark.*``)."""
    main: dict[str, T] = {}
    head: dict[str, T] = {}
    for name, value in weights.items():
        bare = name.removeprefix("model.")
        target = head if bare.startswith(("mtp.", "dspark.")) else main
        target[bare if target is head else name] = value
    return main, head


def spec_from(args: ModelArgs, head: Mapping[str, mx.array]) -> DSparkSpec:
    """The head's spec: config fields, with the stage count and ranks from the tensors."""
    stages = {int(m.group(1)) for name in head if (m := _STAGE.match(name))}
    stages |= {int(name.split(".")[2]) for name in head if name.startswith("dspark.stages.")}
    if not stages or sorted(stages) != list(range(max(stages) + 1)):
        raise ValueError(f"DSpark head stages must be 0..N; got {sorted(stages)}.")
    w1 = _find(head, "markov_head.markov_w1.weight")
    proj = _find(head, "confidence_head.proj.weight")
    rank = int(w1.shape[-1])
    if args.dspark_block_size is None or not args.dspark_target_layer_ids:
        raise ValueError("a DSpark head needs dspark_block_size and dspark_target_layer_ids.")
    return DSparkSpec(
        block_size=int(args.dspark_block_size),
        target_layers=tuple(int(i) for i in args.dspark_target_layer_ids),
        noise_token=int(args.dspark_noise_token_id or 0),
        stages=max(stages) + 1,
        markov_rank=rank,
        confidence_with_markov=int(proj.shape[-1]) == args.hidden_size + rank,
    )


def _find(head: Mapping[str, mx.array], suffix: str) -> mx.array:
    for name, value in head.items():
        if name.endswith(suffix):
            return value
    raise ValueError(f"the DSpark head lacks {suffix}.")


def sanitize_head(head: Mapping[str, mx.array], o_groups: int) -> dict[str, mx.array]:
    """The head's tensors under ``dspark.*`` (published ``mtp.I.*`` names or ours).

    Published tensors go through the main model's ``sanitize_weights`` (FP8 / FP4
    repacking, experts stacked, DeepSeek's names), then the parts used once move to
    the head and the rest to ``dspark.stages.I``."""
    out: dict[str, mx.array] = {}
    published: dict[str, mx.array] = {}
    for name, value in head.items():
        if name.startswith("dspark."):
            out[name] = value
        elif _STAGE.match(name) is None:
            raise ValueError(f"Unexpected DSpark tensor {name!r}.")
        else:
            published[name.replace(".kv_norm.", ".norm.")] = value  # mlx-vlm's K=V norm
    for name, value in sanitize_weights(published, o_groups).items():
        match = _STAGE.match(name)
        assert match is not None
        stage, part = match.groups()
        once = part.startswith(_HEAD_PARTS)
        out[f"dspark.{part}" if once else f"dspark.stages.{stage}.{part}"] = value
    return out


def attach_head(model: Model, head: Mapping[str, mx.array]) -> dict[str, mx.array]:
    """Give ``model`` its DSpark head (``model.dspark``), shaped by ``head``; return the
    head's tensors as ``load_weights`` takes them. Without the config's ``dspark_*``
    fields the head cannot run (its block and taps are unknown), and without tensors
    there is none: either way it is left out."""
    args = model.args
    if not head or args.dspark_block_size is None or not args.dspark_target_layer_ids:
        return {}
    spec = spec_from(model.args, head)
    clean = sanitize_head(head, model.args.o_groups)
    existing = head_of(model)
    if existing is None or existing.spec != spec:
        model["dspark"] = DSparkHead(model.args, spec)
    return clean
