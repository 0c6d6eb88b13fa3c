"""On-policy data for the MTP block: the shipped main model's own greedy continuations.

Speculative decoding (and ``evaluate.heldout_acceptance``) accepts an MTP draft when it
equals the main model's greedy token *while the main model decodes greedily*, so the
MTP block is best trained on exactly that kind of text. ``greedy_sequences`` decodes
training-split prompts (``evaluate.prompt_text`` with several answer-prefix lengths)
greedily with the KV cache, in batches of prompts of equal token length (the cache
has no padding mask, and equal lengths keep every position exact), and keeps the
main model's residual streams for every position, which the MTP block reads and from
which the training targets (the main model's logits) follow.

The teacher is the main model as the build ships it (``deployed_main``: float16 round
trip, 4-bit experts), because that is the model whose greedy tokens are measured.
Only training-split samples are used: held-out topics are never decoded here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mlxserve.models.deepseek_v4 import Model
from mlxserve.models.demo.build import quantize_experts, shipped_weights

from .corpus import Sample
from .evaluate import encode, prompt_text


def deployed_main(model: Model) -> Model:
    """A frozen copy of ``model``'s main model as the build ships it (no MTP blocks).

    Same numbers as ``build``: the float16 weights ``train.save_weights`` writes, back
    in float32, then the routed experts quantised to 4 bits.
    """
    weights = [
        (key, value.astype(mx.float32) if value.dtype == mx.float16 else value)
        for key, value in sorted(shipped_weights(model).items())
        if not key.startswith("mtp.")
    ]
    teacher = Model(model.args)
    teacher.load_weights(weights, strict=True)
    quantize_experts(teacher)
    teacher.freeze()
    return teacher


def training_prompts(
    tokenizer: Any, samples: list[Sample], answer_chars: list[int], max_tokens: int
) -> list[list[int]]:
    """Distinct prompt token lists, one per sample and answer-prefix length, sorted."""
    unique: set[tuple[int, ...]] = set()
    for chars in answer_chars:
        for sample in samples:
            unique.add(tuple(encode(tokenizer, prompt_text(sample, chars))[:max_tokens]))
    return [list(ids) for ids in sorted(unique)]


@dataclass
class Sequences:
    """Prompts continued greedily: ``tokens`` [N, L] int32, the main model's ``streams``
    at every position [N, L, hc, D] float32, and each row's ``prompt_lengths`` [N]."""

    tokens: np.ndarray
    streams: np.ndarray
    prompt_lengths: np.ndarray

    def continuation_mask(self, offset: int) -> np.ndarray:
        """[N, L - offset] float32: 1 where position ``t`` drafts past the prompt
        (``t >= prompt_length - 1``), for losses over positions ``0 .. L - offset - 1``."""
        positions = np.arange(self.tokens.shape[1] - offset)[None, :]
        return (positions >= self.prompt_lengths[:, None] - 1).astype(np.float32)


def greedy_sequences(
    teacher: Model, prompts: list[list[int]], length: int, batch: int = 256
) -> Sequences:
    """Greedy-continue every prompt to ``length`` tokens, keeping the streams.

    The cached decode equals a prefill (the parity tests), so the streams are those a
    prefill of the whole row would give. Continuations go on past the EOS: the main
    model's greedy text either way.
    """
    by_length: dict[int, list[list[int]]] = {}
    for ids in prompts:
        if not 0 < len(ids) < length:
            raise ValueError(f"Prompt of {len(ids)} tokens for sequences of {length}.")
        by_length.setdefault(len(ids), []).append(ids)
    tokens_out: list[np.ndarray] = []
    streams_out: list[np.ndarray] = []
    lengths_out: list[np.ndarray] = []
    for size, group in sorted(by_length.items()):
        for start in range(0, len(group), batch):
            tokens = mx.array(group[start : start + batch])
            cache = teacher.make_cache()
            hidden = teacher.forward_hidden(tokens, cache)
            token_parts, hidden_parts = [tokens], [hidden]
            for _ in range(length - size):
                tokens = mx.argmax(teacher.head_from_streams(hidden[:, -1:]), axis=-1)
                hidden = teacher.forward_hidden(tokens, cache)
                token_parts.append(tokens)
                hidden_parts.append(hidden)
            all_tokens = mx.concatenate(token_parts, axis=1)
            all_hidden = mx.concatenate(hidden_parts, axis=1)
            mx.eval(all_tokens, all_hidden)
            tokens_out.append(np.asarray(all_tokens, dtype=np.int32))
            streams_out.append(np.asarray(all_hidden, dtype=np.float32))
            lengths_out.append(np.full(all_tokens.shape[0], size, dtype=np.int32))
    return Sequences(
        np.concatenate(tokens_out), np.concatenate(streams_out), np.concatenate(lengths_out)
    )
