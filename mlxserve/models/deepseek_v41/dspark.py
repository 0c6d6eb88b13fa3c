"""DeepSeek-V4.1-Flash's DSpark draft head, in the form ``engine.spec.dspark`` drives.

V4.1 ships, under ``mtp.0`` .. ``mtp.N`` of its checkpoint, a DSpark head like
-0731's (``deepseek_v4/dspark.py``): a block drafter reading taps of the target
model, a low-rank Markov head and a confidence head. The same engine adapter
(``DSparkAdapter``) runs it; what differs is V4.1's, and lives here:

* **Stages are V4.1 decoder layers** (mlx-lm's ``deepseek_v41.DecoderLayer``):
  delayed hyper-connections (each block collapses its input with the *previous*
  block's ``pre`` mix, ``pre_mix`` threads through the stages), attention without
  the per-head query norm, FP8-rounded K=V rows, and a MoE with the draft's own
  expert bank (``dspark_n_routed_experts`` / ``dspark_num_experts_per_tok``; 128 /
  top-3 in the release against the backbone's 384 / top-6). Each stage is
  sliding-window only: its attention reads the context rows (its K=V rows of the
  projected taps, rotated at their positions) next to the block, which sees itself
  both ways. That is mlx-lm's V4.1 attention over a window holding the context
  rows, with every row visible, so ``DSparkStage.block`` runs mlx-lm's layer as it
  is.
* **No hyper-connection head.** The last stage's streams collapse with the last
  ``pre_mix`` (as the V4.1 trunk ends); ``hidden`` returns that collapse *before*
  the last stage's ``norm``, because the confidence head reads it there; the
  model's ``output_head`` applies the norm, then the shared ``lm_head``.
* **Taps** are the mean over the streams *entering* each of
  ``dspark_target_layer_ids`` (``Model.forward_hidden(taps=...)``), not leaving it.
* **Published names** (V4.1-Flash's index): ``mtp.0.main_proj`` /
  ``mtp.0.main_norm``; ``mtp.{last}.norm``, ``mtp.{last}.markov_head.embed`` and
  ``.head`` (here ``markov_w1`` / ``markov_w2``, -0731's names) and
  ``mtp.{last}.confidence_head.proj.weight`` (no bias); per stage the block in the
  backbone's names, plus ``ffn.gate.bias_vl`` (image routing, dropped: the draft
  runs on text). No ``hc_head`` anywhere.

Sources: the V4.1 tensor contract and stage roles as public ports read them
(vllm-ascend ``models/deepseek_v41/dspark.py`` and ``model.py``: stage layout, the
Markov / confidence renames, "consumes the residual stream entering its target
layers"; DeepSeek V4.1 RFCs for the block width 5 and three stages). mlx-vlm 0.7.10
has no V4.1 drafter (its ``deepseek_v41`` drops ``mtp.*``; its
``deepseek_v4_dspark`` is built on V4 blocks with an ``hc_head``), so no loader
outside mlxserve reads this head yet.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.normalization import RMSNorm
from mlx_lm.models import deepseek_v41 as text

from mlxserve.models.deepseek_v4.dspark import ConfidenceHead as V4ConfidenceHead
from mlxserve.models.deepseek_v4.dspark import DSparkHead, DSparkSpec, MarkovHead, head_of
from mlxserve.models.deepseek_v4.norm import InputDtypeRMSNorm

if TYPE_CHECKING:
    from .model import Model, ModelArgs

T = TypeVar("T")

_PUBLISHED = re.compile(r"^mtp\.(\d+)\.(.+)$")
_OURS = re.compile(r"^dspark\.stages\.(\d+)\.")
#: parts each held once by the head: published name (stage prefix removed) -> ours
_ONCE = {
    "main_proj.": "main_proj.",
    "main_norm.": "main_norm.",
    "norm.": "norm.",
    "markov_head.embed.": "markov_head.markov_w1.",
    "markov_head.head.": "markov_head.markov_w2.",
    "confidence_head.": "confidence_head.",
}


def configured(args: ModelArgs) -> bool:
    """Whether the config describes a DSpark head (its block and its taps)."""
    return bool(args.dspark_block_size) and bool(args.dspark_target_layer_ids)


def is_draft_tensor(name: str) -> bool:
    return name.removeprefix("model.").startswith(("mtp.", "dspark."))


def split_draft(weights: Mapping[str, T]) -> tuple[dict[str, T], dict[str, T]]:
    """(the main model's tensors, the draft head's: ``mtp.*`` published or ``dspark.*``)."""
    main: dict[str, T] = {}
    draft: dict[str, T] = {}
    for name, value in weights.items():
        if is_draft_tensor(name):
            draft[name.removeprefix("model.")] = value
        else:
            main[name] = value
    return main, draft


def draft_args(args: ModelArgs) -> ModelArgs:
    """The stages' arguments: the backbone's, with the draft's own expert bank."""
    return dataclasses.replace(
        args,
        n_routed_experts=args.dspark_n_routed_experts or args.n_routed_experts,
        num_experts_per_tok=args.dspark_num_experts_per_tok or args.num_experts_per_tok,
    )


class ConfidenceHead(V4ConfidenceHead):
    """-0731's confidence head, whose projection has a bias only if the checkpoint
    has one (V4.1's has none)."""

    def __init__(self, width: int, bias: bool) -> None:
        Module.__init__(self)  # type: ignore[no-untyped-call]
        self.proj = Linear(width, 1, bias=bias)


class DSparkStage(text.DecoderLayer):
    """One draft stage: mlx-lm's V4.1 decoder layer (its parameter names), run over a
    drafted block with the context rows as its attention window."""

    def context_rows(self, context: mx.array, start: int | mx.array) -> mx.array:
        """This stage's K=V rows [B, S, head_dim] of the context [B, S, D] at positions
        ``start ..``: normalised, rotated and FP8-rounded as the layer's own rows are."""
        attn = self.self_attn
        rows = attn.kv_norm(attn.kv_proj(context))
        rows = text._apply_rope(rows, attn.rope, rope_dim=attn.rope_dim, offset=cast(int, start))
        return text._fake_quant_fp8(rows, 32)

    def block(
        self,
        streams: mx.array,
        pre_mix: mx.array,
        keys: mx.array,
        visible: mx.array | None,
        start: int | mx.array,
    ) -> tuple[mx.array, mx.array]:
        """The block [B, L, hc, D] at positions ``start ..`` through the layer: its
        attention sees ``keys`` [B, T, head_dim] (``visible`` [B, T]; None: all) and
        the whole block."""
        batch, length = streams.shape[:2]
        context = keys.shape[1]
        window: Any = text.LayerCache(context + length)
        window.window = keys
        rows = mx.broadcast_to(mx.arange(context + length), (batch, length, context + length))
        if visible is not None:
            own = mx.ones((batch, length), dtype=mx.bool_)
            seen = mx.concatenate([visible.astype(mx.bool_), own], axis=1)
            rows = mx.where(seen[:, None, :], rows, -1)
        out: tuple[mx.array, mx.array] = self(
            streams,
            pre_mix,
            start_pos=cast(int, start),
            window_idx=rows,
            cache=window,
            shared={},
        )
        return out


class V41DSparkHead(DSparkHead):
    """The stages and the parts used once (see the module docstring). A ``DSparkHead``
    for ``DSparkAdapter``: ``context``, ``block_inputs``, ``step_logits`` and
    ``confidence`` are -0731's; ``stage_keys`` and ``hidden`` are V4.1's."""

    def __init__(self, args: ModelArgs, spec: DSparkSpec, confidence_bias: bool = False) -> None:
        Module.__init__(self)  # type: ignore[no-untyped-call]
        hidden = args.hidden_size
        self.spec = spec
        self.hc_mult = args.hc_mult
        self.sliding_window = args.sliding_window
        self.main_proj = Linear(hidden * len(spec.target_layers), hidden, bias=False)
        self.main_norm = InputDtypeRMSNorm(hidden, eps=args.rms_norm_eps)
        stage_args = draft_args(args)
        first = args.num_hidden_layers
        self.stages = [DSparkStage(stage_args, first + i) for i in range(spec.stages)]
        self.norm = RMSNorm(hidden, eps=args.rms_norm_eps)
        self.markov_head = MarkovHead(args.vocab_size, spec.markov_rank)
        width = hidden + (spec.markov_rank if spec.confidence_with_markov else 0)
        self.confidence_head = ConfidenceHead(width, confidence_bias)

    @property
    def v41_stages(self) -> list[DSparkStage]:
        return cast(list[DSparkStage], self.stages)

    def stage_keys(self, context: mx.array, start: int | mx.array) -> list[mx.array]:
        return [stage.context_rows(context, start) for stage in self.v41_stages]

    def hidden(
        self,
        model: Any,
        anchor: mx.array,
        keys: Sequence[mx.array],
        start: int | mx.array,
        visible: mx.array | None = None,
    ) -> mx.array:
        """Draft hidden states [B, block, D], before the final norm (the confidence
        head reads them there; ``Model.output_head`` norms them for the logits)."""
        inputs = self.block_inputs(anchor)
        h = model.model.embed_tokens(inputs)
        batch, length, dim = h.shape
        streams = mx.broadcast_to(h[:, :, None, :], (batch, length, self.hc_mult, dim))
        pre_mix = mx.zeros((batch, length, self.hc_mult), dtype=mx.float32)
        pre_mix[..., 0] = 1.0
        for stage, rows in zip(self.v41_stages, keys, strict=True):
            streams, pre_mix = stage.block(streams, pre_mix, rows, visible, start)
        out: mx.array = text._collapse(streams, pre_mix)
        return out


class _DraftNames:
    """What mlx-lm's ``deepseek_v41.Model.sanitize`` reads of its model: the args."""

    def __init__(self, args: ModelArgs) -> None:
        self.args = args


def sanitize_draft(draft: Mapping[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
    """The head's tensors under ``dspark.*`` from the published ``mtp.I.*`` (or ours).

    The stages' tensors go through mlx-lm's V4.1 renaming (experts stacked, FP8 / FP4
    repacked, ``bias_vl`` dropped) with the draft's expert count; the parts held once
    move to the head."""
    out: dict[str, mx.array] = {}
    published: dict[str, mx.array] = {}
    for name, value in draft.items():
        if name.startswith("dspark."):
            out[name] = value
            continue
        match = _PUBLISHED.match(name)
        if match is None:
            raise ValueError(f"unexpected DSpark tensor {name!r}")
        published[f"layers.{match.group(1)}.{match.group(2)}"] = value
    sanitize = cast(Any, text.Model.sanitize)
    renamed: dict[str, mx.array] = sanitize(_DraftNames(draft_args(args)), published)
    placed: dict[str, str] = {}
    for name, value in renamed.items():
        stage, part = name.removeprefix("model.layers.").split(".", 1)
        once = next((key for key in _ONCE if part.startswith(key)), None)
        if once is None:
            out[f"dspark.stages.{stage}.{part}"] = value
            continue
        target = f"dspark.{_ONCE[once]}{part.removeprefix(once)}"
        if target in placed:
            raise ValueError(
                f"the DSpark head's {once[:-1]} is on stages {placed[target]} and {stage}"
            )
        placed[target] = stage
        out[target] = value
    return out


def spec_from(args: ModelArgs, head: Mapping[str, mx.array]) -> tuple[DSparkSpec, bool]:
    """The head's shape (and whether its confidence projection has a bias), from the
    config and its sanitized tensors."""
    stages = {int(m.group(1)) for name in head if (m := _OURS.match(name))}
    if not stages or sorted(stages) != list(range(max(stages) + 1)):
        raise ValueError(f"DSpark head stages must be 0..N; got {sorted(stages)}")
    declared = args.num_nextn_predict_layers
    if declared and declared != len(stages):
        raise ValueError(
            f"the DSpark head has {len(stages)} stages; num_nextn_predict_layers says {declared}"
        )
    for name in ("main_proj.weight", "markov_head.markov_w1.weight", "confidence_head.proj.weight"):
        if f"dspark.{name}" not in head:
            raise ValueError(f"the DSpark head lacks {name} (published: mtp.N.{name})")
    ratios = args.compress_ratios
    first = args.num_hidden_layers
    for stage in sorted(stages):
        ratio = ratios[first + stage] if first + stage < len(ratios) else 0
        if ratio:
            raise ValueError(
                f"DSpark stage {stage} has compress ratio {ratio}; the draft stages are "
                "sliding-window only"
            )
    rank = int(head["dspark.markov_head.markov_w1.weight"].shape[-1])
    width = int(head["dspark.confidence_head.proj.weight"].shape[-1])
    assert args.dspark_block_size is not None
    spec = DSparkSpec(
        block_size=int(args.dspark_block_size),
        target_layers=tuple(int(i) for i in args.dspark_target_layer_ids),
        noise_token=int(args.dspark_noise_token_id or 0),
        stages=len(stages),
        markov_rank=rank,
        confidence_with_markov=width == args.hidden_size + rank,
    )
    return spec, "dspark.confidence_head.proj.bias" in head


def attach_head(model: Model, draft: Mapping[str, mx.array]) -> dict[str, mx.array]:
    """Give ``model`` its DSpark head (``model.dspark``), shaped by ``draft``; return
    the head's tensors as ``load_weights`` takes them. Without the config's
    ``dspark_*`` fields or without tensors there is none (the loader has named the
    tensors it then leaves out)."""
    if not draft or not configured(model.args):
        return {}
    clean = sanitize_draft(draft, model.args)
    spec, bias = spec_from(model.args, clean)
    existing = head_of(model)
    if not isinstance(existing, V41DSparkHead) or existing.spec != spec:
        model["dspark"] = V41DSparkHead(model.args, spec, bias)
    return clean
