"""DeepSeek-V4.1's text model: mlx-lm's ``deepseek_v41``, with mlxserve's Engram and DSpark.

mlx-lm's ``deepseek_v41`` (shared-KV CSA2 attention, hyper-connections, MoE) is used
as it is for every layer; its ``ModelArgs`` refuses configs with Engram layers, because
it has no Engram. Here the arguments keep the Engram fields, the text model is built
without them, and each Engram layer gets an ``engram`` module (``engram.py``) that
adds its lookup to the residual streams just before the layer runs, as the reference
does. The forward is mlx-lm's ``TextModel.__call__`` with that one addition (no
pipeline parallelism), split as DeepSeek-V4's is so a draft head can use the trunk:

* ``forward_hidden(inputs, cache, taps=...)`` returns the hidden states [B, S, D]
  (the last streams collapsed with the last ``pre_mix``, before the final norm) and
  hands out the taps a DSpark head reads;
* ``head_from_streams(hidden)`` applies the final norm and ``lm_head``.

The hashes need the release's ``engram_token_map.json`` (`set_token_map`, called by
the loader); each sequence's cache keeps the last mapped ids, so decode steps hash
the n-grams that reach back into the prompt. ``make_cache(max_rollback=k)`` gives
caches that can drop their last ``k`` positions (``cache.py``), for speculation.

The DSpark draft head (``mtp.*``, with the config's ``dspark_*`` fields) becomes
``model.dspark`` (``dspark.py``): V4.1 speculates with the engine's DSpark adapter.
Not served, and so dropped by ``sanitize`` (the loader names them): the vision tower
(``vision.*``, ``aligner.*``, ``image_*``), and ``mtp.*`` tensors without the config
fields a DSpark head needs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import deepseek_v41 as text

from mlxserve.models.deepseek_v4.dspark import head_of
from mlxserve.models.deepseek_v4.head import SLICE_BYTES, head_logits
from mlxserve.models.in_flight import InFlight

from .cache import LayerCache
from .compressor import Compressor
from .dspark import attach_head, split_draft
from .engram import Engram, EngramHasher, EngramSpec
from .parts import NOT_SERVED, not_served

__all__ = ["NOT_SERVED", "LayerCache", "Model", "ModelArgs", "not_served"]

TOKEN_MAP_FILE = "engram_token_map.json"
_ENGRAM_KEY = re.compile(r"^(?:model\.)?layers\.(\d+)\.engram\.(.+)$")


@dataclass
class ModelArgs(text.ModelArgs):
    """mlx-lm's arguments plus the Engram fields (which mlx-lm refuses)."""

    model_type: str = "deepseek_v41"
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 0
    # The DSpark draft head (``dspark.py``): its stages, block, taps, noise token,
    # Markov rank and its own expert bank (0: the backbone's).
    num_nextn_predict_layers: int = 0
    dspark_block_size: int | None = None
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_noise_token_id: int | None = None
    dspark_markov_rank: int | None = None
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0

    def __post_init__(self) -> None:
        # mlx-lm's refusal of Engram layers does not apply: they are served here.
        self.engram_layer_ids = tuple(self.engram_layer_ids)
        self.engram_num_embeddings = tuple(self.engram_num_embeddings)
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ValueError(
                f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries for "
                f"{len(self.engram_layer_ids)} Engram layers"
            )
        bad = [i for i in self.engram_layer_ids if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"engram_layer_ids {bad} are not layers of this model")
        self.dspark_target_layer_ids = tuple(self.dspark_target_layer_ids or ())
        taps = [i for i in self.dspark_target_layer_ids if not 0 <= i < self.num_hidden_layers]
        if taps:
            raise ValueError(f"dspark_target_layer_ids {taps} are not layers of this model")

    def engram_spec(self) -> EngramSpec | None:
        if not self.engram_layer_ids:
            return None
        return EngramSpec(
            layer_ids=self.engram_layer_ids,
            table_rows=self.engram_num_embeddings,
            max_ngram=self.engram_max_ngram_size,
            n_heads=self.engram_n_heads,
            head_dim=self.engram_head_dim,
            vocab_size=self.engram_vocab_size,
            compressed_vocab_size=self.engram_compressed_vocab_size,
            pad_token_id=self.engram_pad_token_id,
        )


class Model(text.Model):
    """``mlx_lm.models.deepseek_v41.Model`` with Engram layers (see the module docstring)."""

    args: ModelArgs

    def __init__(self, config: ModelArgs) -> None:
        super().__init__(config)
        self.spec = config.engram_spec()
        # Bytes of float32 head rows one slice of the head's product may hold (V4's ``head.py``).
        self.head_slice_bytes = SLICE_BYTES
        self.hasher: EngramHasher | None = None
        if self.spec is not None:
            for layer_id in self.spec.layer_ids:
                self.model.layers[layer_id].engram = Engram(
                    self.spec, layer_id, config.hidden_size, config.hc_mult, config.rms_norm_eps
                )
        for layer_id, layer in enumerate(self.model.layers):
            if getattr(layer.self_attn, "compressor", None) is not None:
                # Reports its raw rows, so a speculative cache can reopen a group.
                layer.self_attn.compressor = Compressor(config, layer_id)

    @property
    def engram_layer_ids(self) -> tuple[int, ...]:
        return () if self.spec is None else self.spec.layer_ids

    def set_token_map(self, directory: Path) -> None:
        """Read the release's ``engram_token_map.json`` (a list, or ``{"token_map": [...]}``)."""
        if self.spec is None:
            return
        path = Path(directory) / TOKEN_MAP_FILE
        if not path.is_file():
            raise ValueError(
                f"its Engram layers {list(self.spec.layer_ids)} need {TOKEN_MAP_FILE}, "
                "which the checkpoint lacks"
            )
        data = json.loads(path.read_text(encoding="utf-8"))
        token_map = data["token_map"] if isinstance(data, dict) else data
        self.hasher = EngramHasher(self.spec, [int(t) for t in token_map])

    def make_cache(self, max_rollback: int = 0) -> list[text.LayerCache]:
        """One cache per layer (``cache.LayerCache``); ``max_rollback`` > 0 lets them
        drop their last positions."""
        window = self.args.sliding_window
        return [
            LayerCache(window, max_rollback, _own_ratio(layer.self_attn)) for layer in self.layers
        ]

    def __call__(self, inputs: mx.array, cache: Sequence[Any] | None = None) -> mx.array:
        return self.head_from_streams(self.forward_hidden(inputs, cache))

    def forward_hidden(
        self,
        inputs: mx.array,
        cache: Sequence[Any] | None = None,
        queue_every: int = 0,
        taps: Sequence[int] = (),
        tapped: list[mx.array] | None = None,
    ) -> mx.array:
        """Hidden states [B, S, D] before the final norm: mlx-lm's ``TextModel.__call__``
        (one rank), with each Engram layer's lookup added to the streams before the
        layer. Without ``cache`` a throw-away one is used.

        ``tapped``, when given, receives for each layer in ``taps`` (0-based, in that
        order) the mean over the streams entering it, before its Engram lookup: what
        V4.1's DSpark head reads. ``queue_every`` > 0 queues the streams for the
        device after every that many layers (as DeepSeek-V4's ``forward_hidden``)."""
        cache = list(cache) if cache is not None else self.make_cache()
        tm, args = self.model, self.args
        h = tm.embed_tokens(inputs)
        batch, length, _ = h.shape
        start_pos = cache[0].offset
        previous = 0 if cache[0].window is None else cache[0].window.shape[1]
        window_idx = text._window_indices(
            previous=previous, length=length, window=args.sliding_window
        )
        window_idx = mx.broadcast_to(window_idx, (batch, *window_idx.shape))
        streams = mx.broadcast_to(h[:, :, None, :], (batch, length, args.hc_mult, args.hidden_size))
        pre_mix = mx.zeros((batch, length, args.hc_mult), dtype=mx.float32)
        pre_mix[..., 0] = 1.0
        hashes = self._hashes(inputs, cache[0])
        shared: dict[str, mx.array | None] = {}
        found: dict[int, mx.array] = {}
        in_flight = InFlight()
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache, strict=True)):
            if tapped is not None and i in taps:
                found[i] = streams.mean(axis=2)
            engram = getattr(layer, "engram", None)
            if engram is not None:
                assert hashes is not None
                streams = engram(streams, hashes[:, :, engram.slot])
            streams, pre_mix = layer(
                streams,
                pre_mix,
                start_pos=start_pos,
                window_idx=window_idx,
                cache=layer_cache,
                shared=shared,
            )
            if queue_every and (i + 1) % queue_every == 0 and i + 1 < len(self.layers):
                in_flight.queue(streams, pre_mix)  # at most two groups in flight
        if tapped is not None:
            tapped.extend(found[i] for i in taps)
        out: mx.array = text._collapse(streams, pre_mix)
        return out

    def _hashes(self, inputs: mx.array, first: Any) -> mx.array | None:
        """The Engram hash ids of ``inputs`` (None without Engram layers); the first
        layer's cache keeps the mapped ids the next step's n-grams reach back to."""
        if self.spec is None:
            return None
        if self.hasher is None:
            raise ValueError("the Engram token map was not set (set_token_map)")
        if not isinstance(first, LayerCache):
            raise TypeError("V4.1's Engram layers need the model's own caches (make_cache)")
        history = first.remember_ids(self.hasher.token_map[inputs], self.spec.max_ngram - 1)
        hashes, _ = self.hasher(inputs, history)
        return hashes

    def head_from_streams(self, hidden: mx.array) -> mx.array:
        """Logits from ``forward_hidden``'s hidden states: the final norm, ``lm_head``.
        The collapse makes them float32: a bfloat16 head multiplies them a slice of the
        vocabulary at a time, never as a whole float32 copy (V4's ``head.py``)."""
        return head_logits(self.lm_head, self.model.norm(hidden), self.head_slice_bytes)

    def output_head(self, hidden: mx.array) -> mx.array:
        """Logits of DSpark draft hidden states (``V41DSparkHead.hidden``: before the
        draft's final norm, where its confidence head reads them): that norm, then the
        shared ``lm_head``."""
        head = head_of(self)
        if head is None:
            raise ValueError("the model has no DSpark head")
        return head_logits(self.lm_head, head.norm(hidden), self.head_slice_bytes)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """mlx-lm's renaming for the text model; Engram tensors to ``model.layers.N.engram``;
        a DSpark head's to ``dspark.*`` (its module is created here, because only the
        checkpoint tells its stages and ranks).

        The parts in ``NOT_SERVED`` are dropped (the loader has named them already).
        """
        weights, draft = split_draft(weights)
        head = attach_head(self, draft)
        engram: dict[str, mx.array] = {}
        rest: dict[str, mx.array] = {}
        for key, value in weights.items():
            match = _ENGRAM_KEY.match(key)
            if match is None:
                rest[key] = value
                continue
            layer, leaf = match.groups()
            if leaf.endswith(".scale"):
                raise ValueError(
                    f"{key}: FP8-packed Engram tables are not read yet (float tables are)"
                )
            engram[f"model.layers.{layer}.engram.{leaf}"] = value
        if any(key.startswith("model.") for key in rest):  # already MLX names
            return {**rest, **engram, **head}
        return {**super().sanitize(rest), **engram, **head}

    @property
    def cast_predicate(self) -> Any:
        inner = super().cast_predicate

        def predicate(key: str) -> bool:
            return inner(key) and not key.endswith(("q_weight", "k_weight"))

        return predicate


def _own_ratio(attn: Any) -> int:
    """The ratio of the layer's own compressor (0: it has none; it may read another's)."""
    return int(attn.ratio) if getattr(attn, "compressor", None) is not None else 0
