"""DeepSeek-V4 decoder stack and the ``Model`` that ``mlx_lm`` loads.

``Model.__call__(inputs, cache)`` returns logits like any ``mlx_lm`` model. The forward
is split so a multi-token-prediction (MTP) head can reuse the trunk:

* ``forward_hidden(inputs, cache)`` returns the residual streams [B, S, hc, D] after
  the last layer, *before* ``hc_head`` (what DeepSeek's MTP blocks consume);
* ``head_from_streams(streams)`` applies ``hc_head``, the final norm and ``lm_head``.

MTP weights (``mtp.I.*``) are kept: ``sanitize`` attaches ``MTPBlock`` modules holding
them (a decoder layer plus ``e_proj``, ``h_proj``, ``enorm``, ``hnorm``, ``norm`` and
``hc_head``). ``Model.mtp_forward`` / ``make_mtp_cache`` run them (see ``mtp.py``).
A DSpark draft head in ``mtp.*`` (DeepSeek-V4-Flash-0731) becomes ``model.dspark``
instead (no MTP blocks); ``forward_hidden(taps=...)`` gives it the layers it reads
(see ``dspark.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.normalization import RMSNorm
from mlx.utils import tree_flatten

from mlxserve.hardware.tuning import EngineTuning
from mlxserve.models.in_flight import InFlight

from .attention import Attention
from .cache import LayerCache, RowCaches
from .config import ModelArgs
from .dspark import attach_head, has_dspark_head, split_head
from .head import SLICE_BYTES, head_logits
from .hyper_connections import HyperConnection, HyperHead
from .moe import MoE
from .mtp import mtp_fill, mtp_forward
from .norm import InputDtypeRMSNorm
from .sanitize import check_weights, mtp_block_count, sanitize_weights
from .sharding import shard_model
from .stacked import StackedRows

#: what a layer's forward takes: one sequence's cache, or a batch's rows
AnyCache = LayerCache | RowCaches | StackedRows


class DecoderLayer(Module):
    """Attention and MoE blocks, each wrapped in its own hyper-connection."""

    def __init__(self, args: ModelArgs, layer_type: str, mlp_type: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.attn = Attention(args, layer_type)
        self.ffn = MoE(args, mlp_type)
        self.attn_norm = InputDtypeRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.ffn_norm = InputDtypeRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        # v41's HyperConnection only reads hc_mult, hc_sinkhorn_iters, hc_eps,
        # rms_norm_eps and hidden_size, which V4's args share.
        self.hc_attn = HyperConnection(args)  # type: ignore[arg-type]
        self.hc_ffn = HyperConnection(args)  # type: ignore[arg-type]

    def __call__(self, streams: mx.array, token_ids: mx.array, cache: AnyCache) -> mx.array:
        # V4 computes each block's collapse weights from the streams entering *that* block.
        # Each block's norm is applied by `enter`, and the attention's exit runs with
        # the FFN's entry: one CUDA kernel each for a decode step (hyper_connections.py).
        x, post, comb = self.hc_attn.enter(streams, self.attn_norm)
        h = self.attn(x, cache)
        streams, x, post, comb = self.hc_attn.leave_enter(
            h, streams, post, comb, self.hc_ffn, self.ffn_norm
        )
        h = self.ffn(x, token_ids)
        return self.hc_ffn.leave(h, streams, post, comb)


class MTPBlock(DecoderLayer):
    """One MTP block (DeepSeek names): a decoder layer plus the MTP input / output parts.

    The block does not own the embedding or the output head (shared with the main
    model), so its full forward lives in ``mtp.mtp_forward``; ``decode`` is the decoder
    layer part.
    """

    def __init__(self, args: ModelArgs, layer_type: str) -> None:
        super().__init__(args, layer_type, "moe")
        self.e_proj = Linear(args.hidden_size, args.hidden_size, bias=False)
        self.h_proj = Linear(args.hidden_size, args.hidden_size, bias=False)
        self.enorm = InputDtypeRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.hnorm = InputDtypeRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.hc_head = HyperHead(args)

    def decode(self, streams: mx.array, token_ids: mx.array, cache: AnyCache) -> mx.array:
        """The block's decoder layer on its input streams [B, S, hc, D]."""
        return DecoderLayer.__call__(self, streams, token_ids, cache)


class TextModel(Module):
    """Embedding, decoder layers, ``hc_head`` and the final norm."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        assert args.layer_types is not None and args.mlp_layer_types is not None
        self.hc_mult = args.hc_mult
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = [
            DecoderLayer(args, attn, mlp)
            for attn, mlp in zip(args.layer_types, args.mlp_layer_types, strict=True)
        ]
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.hc_head = HyperHead(args)

    def streams(
        self,
        inputs: mx.array,
        cache: Sequence[AnyCache],
        queue_every: int = 0,
        taps: Sequence[int] = (),
        tapped: list[mx.array] | None = None,
    ) -> mx.array:
        h = self.embed_tokens(inputs)
        batch, length, dim = h.shape
        streams = mx.broadcast_to(h[:, :, None, :], (batch, length, self.hc_mult, dim))
        in_flight = InFlight()
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache, strict=True)):
            streams = layer(streams, inputs, layer_cache)
            if tapped is not None and i in taps:
                tapped.append(streams.mean(axis=2))  # a DSpark head's tap (``dspark.py``)
            if queue_every and (i + 1) % queue_every == 0 and i + 1 < len(self.layers):
                in_flight.queue(streams)  # the device runs this group as the host builds on
        return streams


class Model(Module):
    """DeepSeek-V4 causal LM with the ``mlx_lm`` model interface."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.args = args
        self.model_type = args.model_type
        self.model = TextModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.mtp: list[MTPBlock] = []
        # Bytes of float32 head rows one slice of the head's product may hold (``head.py``).
        self.head_slice_bytes = SLICE_BYTES

    def __call__(self, inputs: mx.array, cache: Sequence[AnyCache] | None = None) -> mx.array:
        return self.head_from_streams(self.forward_hidden(inputs, cache))

    def forward_hidden(
        self,
        inputs: mx.array,
        cache: Sequence[AnyCache] | None = None,
        queue_every: int = 0,
        taps: Sequence[int] = (),
        tapped: list[mx.array] | None = None,
    ) -> mx.array:
        """Residual streams [B, S, hc_mult, D] after the last layer, before ``hc_head``.

        Without ``cache`` a throw-away one is used, so the result is the same as a
        prefill from scratch. ``queue_every`` > 0 queues the streams for the device
        after every that many layers (``mx.async_eval``), so the device computes the
        first layers while the host still builds the graph of the later ones: for a
        forward whose result is waited for at once (a speculative verify), where
        nothing else overlaps its graph building, and for a prefill chunk, whose
        activations a GPU frees only once the device has run them. The host waits for
        a group before queuing the one after next, so at most two groups' activations
        are alive. The result is the same. ``tapped``, when given, receives the mean
        over the streams of each layer in ``taps`` (0-based), in order: what a DSpark
        draft head reads (``dspark.py``).
        """
        cache = cache if cache is not None else self.make_cache()
        return self.model.streams(inputs, cache, queue_every, taps, tapped)

    def head_from_streams(self, streams: mx.array) -> mx.array:
        """Logits from residual streams: ``hc_head``, final norm, ``lm_head``."""
        return self.output_head(self.model.norm(self.model.hc_head(streams)))

    def output_head(self, h: mx.array) -> mx.array:
        """The output projection alone (shared by the main model and the MTP blocks).
        The final norms' float32 weights make ``h`` float32: a bfloat16 head multiplies
        it a slice of the vocabulary at a time, never as a whole float32 copy
        (``head.py``)."""
        layer = self.model.embed_tokens if self.args.tie_word_embeddings else self.lm_head
        return head_logits(layer, h, self.head_slice_bytes)

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def make_cache(self, max_rollback: int = 0) -> list[LayerCache]:
        """One cache per layer; ``max_rollback`` > 0 makes the last positions trimmable."""
        return [layer.attn.make_cache(max_rollback) for layer in self.layers]

    @property
    def num_mtp_blocks(self) -> int:
        """How many MTP blocks the loaded checkpoint provided (0 if none)."""
        return len(self.mtp)

    def make_mtp_cache(self, max_rollback: int = 0) -> list[LayerCache]:
        """One cache per MTP block (empty without MTP); see ``make_cache``."""
        return [block.attn.make_cache(max_rollback) for block in self.mtp]

    def mtp_forward(
        self,
        streams: mx.array,
        next_tokens: mx.array,
        cache: AnyCache,
        block: int = 0,
    ) -> tuple[mx.array, mx.array]:
        """MTP block ``block``: ``(logits for t + 2, out_streams)``; see ``mtp.mtp_forward``."""
        return mtp_forward(self, streams, next_tokens, cache, block)

    def mtp_fill(
        self,
        streams: mx.array,
        next_tokens: mx.array,
        cache: LayerCache | RowCaches,
        block: int = 0,
    ) -> None:
        """Only the cache entries of ``mtp_forward``; see ``mtp.mtp_fill``."""
        mtp_fill(self, streams, next_tokens, cache, block)

    def tune(self, tuning: EngineTuning) -> None:
        """Run every layer, the MTP blocks' too, with the tuning's knobs: forwards of
        how many rows compile their hyper-connections and fuse their other small ops,
        and whether a few queries' attention is split per query."""
        for module in self.modules():  # type: ignore[no-untyped-call]
            if isinstance(module, HyperConnection):
                module.compiled_max_rows = tuning.compiled_hc_max_rows
            elif isinstance(module, Attention):
                module.split_attention_queries = tuning.split_attention_queries
                module.fused_max_rows = tuning.compiled_decode_max_rows
            elif isinstance(module, MoE):
                module.fused_max_rows = tuning.compiled_decode_max_rows

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Accept the ``transformers`` / DeepSeek layouts (see ``sanitize.py``).

        MTP tensors are kept; the ``MTPBlock`` modules that receive them are created
        here, because only the checkpoint tells whether it ships them.
        """
        head: dict[str, mx.array] = {}
        if has_dspark_head(vars(self.args), weights):
            # -0731's DSpark draft head, not MTP blocks: ``model.dspark`` (``dspark.py``).
            weights, draft = split_head(weights)
            head = attach_head(self, draft)
        clean = sanitize_weights(weights, self.args.o_groups)
        count = mtp_block_count(clean)
        if count and len(self.mtp) != count:
            types = self.args.mtp_layer_types or []
            types = (types + ["sliding_attention"] * count)[:count]
            self.mtp = [MTPBlock(self.args, t) for t in types]
        return {**clean, **head}

    def load_weights(
        self, file_or_weights: str | list[tuple[str, mx.array]], strict: bool = True
    ) -> Model:
        """``Module.load_weights``, with one short line for a checkpoint that does not fit.

        MLX's own strict check lists every missing name at once (thousands for a
        truncated download); this names the first one, and runs on shapes alone, so
        it fails before any weight is read.
        """
        if strict and not isinstance(file_or_weights, str):
            params = dict(tree_flatten(self.parameters()))  # type: ignore[no-untyped-call]
            check_weights(dict(file_or_weights), params)
        super().load_weights(file_or_weights, strict=strict)
        return self

    def shard(
        self, group: mx.distributed.Group | None = None, split: Sequence[int] | None = None
    ) -> None:
        """Tensor parallelism: split heads / output groups and experts' hidden dim, evenly
        or by ``split`` (each rank's share in parts; see ``sharding.py``)."""
        shard_model(self, group or mx.distributed.init(), split)

    @property
    def cast_predicate(self) -> Callable[[str], bool]:
        """Keep the parameters the reference keeps in float32 when casting to fp16/bf16."""
        keep = ("hc_attn.", "hc_ffn.", "hc_head.", "attn_sink", "gate.bias", "ape", "tid2eid")

        def predicate(key: str) -> bool:
            return not any(part in key for part in keep)

        return predicate
