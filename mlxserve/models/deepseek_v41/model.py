"""DeepSeek-V4.1's text model: mlx-lm's ``deepseek_v41``, with mlxserve's Engram added.

mlx-lm's ``deepseek_v41`` (shared-KV CSA2 attention, hyper-connections, MoE) is used
as it is for every layer; its ``ModelArgs`` refuses configs with Engram layers, because
it has no Engram. Here the arguments keep the Engram fields, the text model is built
without them, and each Engram layer gets an ``engram`` module (``engram.py``) that
adds its lookup to the residual streams just before the layer runs, as the reference
does. The forward is mlx-lm's ``TextModel.__call__`` with that one addition (no
pipeline parallelism).

The hashes need the release's ``engram_token_map.json`` (`set_token_map`, called by
the loader); each sequence's cache keeps the last mapped ids, so decode steps hash
the n-grams that reach back into the prompt.

Not served, and so dropped by ``sanitize`` (the loader names them): the vision tower
(``vision.*``, ``aligner.*``, ``image_*``) and the MTP / DSpark draft head
(``mtp.*``): V4.1 is served at speculative depth 0.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import deepseek_v41 as text

from .engram import Engram, EngramHasher, EngramSpec
from .parts import NOT_SERVED, not_served

__all__ = ["NOT_SERVED", "EngramCache", "Model", "ModelArgs", "not_served"]

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


class EngramCache(text.LayerCache):
    """The first layer's cache, which also keeps the sequence's last mapped token ids."""

    def __init__(self, window_size: int) -> None:
        super().__init__(window_size)
        self.engram_history: mx.array | None = None

    @property
    def state(self) -> tuple[mx.array | None, ...]:
        return (*super().state, self.engram_history)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.engram_history is None else self.engram_history.nbytes
        return int(super().nbytes) + extra


class Model(text.Model):
    """``mlx_lm.models.deepseek_v41.Model`` with Engram layers (see the module docstring)."""

    def __init__(self, config: ModelArgs) -> None:
        super().__init__(config)
        self.spec = config.engram_spec()
        self.hasher: EngramHasher | None = None
        if self.spec is not None:
            for layer_id in self.spec.layer_ids:
                self.model.layers[layer_id].engram = Engram(
                    self.spec, layer_id, config.hidden_size, config.hc_mult, config.rms_norm_eps
                )

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

    def make_cache(self) -> list[text.LayerCache]:
        window = self.args.sliding_window
        return [EngramCache(window)] + [text.LayerCache(window) for _ in self.layers[1:]]

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        if self.spec is None:
            logits: mx.array = super().__call__(inputs, cache)
            return logits
        logits = self.lm_head(self._text_forward(inputs, cache or self.make_cache()))
        return logits

    def _text_forward(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        """mlx-lm's ``TextModel.__call__`` (one rank), with each Engram layer's lookup
        added to the streams before the layer."""
        if self.hasher is None:
            raise ValueError("the Engram token map was not set (set_token_map)")
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
        hashes, cache[0].engram_history = self.hasher(inputs, cache[0].engram_history)
        shared: dict[str, mx.array | None] = {}
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            engram = getattr(layer, "engram", None)
            if engram is not None:
                streams = engram(streams, hashes[:, :, engram.slot])
            streams, pre_mix = layer(
                streams,
                pre_mix,
                start_pos=start_pos,
                window_idx=window_idx,
                cache=layer_cache,
                shared=shared,
            )
        out: mx.array = tm.norm(text._collapse(streams, pre_mix))
        return out

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """mlx-lm's renaming for the text model; Engram tensors to ``model.layers.N.engram``.

        The parts in ``NOT_SERVED`` are dropped (the loader has named them already).
        """
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
            return {**rest, **engram}
        return {**super().sanitize(rest), **engram}

    @property
    def cast_predicate(self) -> Any:
        inner = super().cast_predicate

        def predicate(key: str) -> bool:
            return inner(key) and not key.endswith(("q_weight", "k_weight"))

        return predicate
