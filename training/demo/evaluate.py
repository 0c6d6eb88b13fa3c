"""Greedy decoding and MTP acceptance measurements shared by training, tests and benchmarks.

Acceptance at depth ``k`` for position ``t`` compares the chained greedy MTP draft for
token ``t + 1 + k`` with the main model's own greedy token there. The main model's
continuation is decoded first; its streams are then recomputed in one prefill (which
the parity tests show equals the cached decode), so drafting does not disturb decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxserve.models.deepseek_v4.model import Model
from mlxserve.models.deepseek_v4.mtp import greedy_draft
from mlxserve.models.demo.spec import ASSISTANT, END, USER

from .corpus import Sample


@dataclass
class Acceptance:
    """Per-depth draft matches (unconditional) and accepted-prefix statistics."""

    matches: list[int]
    trials: list[int]
    accepted_tokens: int = 0
    steps: int = 0

    @property
    def rates(self) -> list[float]:
        return [m / t if t else 0.0 for m, t in zip(self.matches, self.trials, strict=True)]

    def merge(self, other: Acceptance) -> None:
        for k in range(len(self.matches)):
            self.matches[k] += other.matches[k]
            self.trials[k] += other.trials[k]
        self.accepted_tokens += other.accepted_tokens
        self.steps += other.steps


def prompt_text(sample: Sample, answer_chars: int = 60) -> str:
    """A held-out-style prompt: the exchange with the start of the assistant's answer."""
    return f"{USER}{sample.prompt}{END}{ASSISTANT}{sample.text[:answer_chars]}"


def as_int(value: mx.array) -> int:
    """A scalar array as a Python int."""
    item = value.item()
    assert isinstance(item, int)
    return item


def encode(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def greedy_continue(model: Model, prompt: list[int], max_new: int, eos: int | None) -> list[int]:
    """The main model's greedy continuation with the cache (stops after ``eos``)."""
    cache = model.make_cache()
    logits = model(mx.array([prompt]), cache)
    out: list[int] = []
    for _ in range(max_new):
        token = as_int(mx.argmax(logits[0, -1]))
        out.append(token)
        if token == eos:
            break
        logits = model(mx.array([[token]]), cache)
    return out


def depth1_acceptance(model: Model, ids: list[int], prompt_len: int) -> Acceptance:
    """Depth-1 acceptance in one teacher-forced pass (drafts from positions >= prompt_len-1)."""
    seq = mx.array([ids])
    streams = model.forward_hidden(seq)
    cache = model.make_mtp_cache()[0]
    logits, _ = model.mtp_forward(streams[:, :-1], seq[:, 1:], cache)
    drafts = mx.argmax(logits[0], axis=-1).tolist()
    assert isinstance(drafts, list)
    hits = [int(drafts[t] == ids[t + 2]) for t in range(prompt_len - 1, len(ids) - 2)]
    return Acceptance([sum(hits)], [len(hits)], sum(hits), len(hits))


def chained_acceptance(model: Model, ids: list[int], prompt_len: int, depth: int) -> Acceptance:
    """Acceptance per depth ``1..depth`` of chained greedy drafts from each position.

    The MTP cache holds teacher-forced rows for the positions before ``t``; the rows a
    chain adds are trimmed afterwards, as a speculative decoder would after verifying.
    Written for a single MTP block (the demo's).
    """
    if model.num_mtp_blocks != 1:
        raise ValueError("chained_acceptance expects exactly one MTP block.")
    seq = mx.array([ids])
    streams = model.forward_hidden(seq)
    caches = model.make_mtp_cache(max_rollback=depth)
    if prompt_len > 1:
        model.mtp_forward(streams[:, : prompt_len - 1], seq[:, 1:prompt_len], caches[0])
    result = Acceptance([0] * depth, [0] * depth)
    for t in range(prompt_len - 1, len(ids) - 2):
        drafts = greedy_draft(model, streams[:, t : t + 1], seq[:, t + 1 : t + 2], caches, depth)
        mx.eval(drafts)
        prefix_ok = True
        for k, draft in enumerate(drafts):
            target = t + 2 + k
            if target >= len(ids):
                break
            hit = as_int(draft) == ids[target]
            result.matches[k] += int(hit)
            result.trials[k] += 1
            prefix_ok = prefix_ok and hit
            result.accepted_tokens += int(prefix_ok)
        result.steps += 1
        if depth > 1:
            trimmed = caches[0].trim(depth - 1)
            assert trimmed == depth - 1
    return result


def heldout_acceptance(
    model: Model,
    tokenizer: Any,
    samples: list[Sample],
    max_new: int = 32,
    depth: int = 1,
) -> Acceptance:
    """Greedy-decode each held-out prompt, then measure MTP acceptance on the continuation."""
    total = Acceptance([0] * depth, [0] * depth)
    for sample in samples:
        prompt = encode(tokenizer, prompt_text(sample))
        new = greedy_continue(model, prompt, max_new, tokenizer.eos_token_id)
        ids = prompt + new
        if depth == 1:
            total.merge(depth1_acceptance(model, ids, len(prompt)))
        else:
            total.merge(chained_acceptance(model, ids, len(prompt), depth))
    return total


def distinct_ngrams(tokens: list[int], n: int = 4) -> float:
    """Fraction of distinct ``n``-grams in ``tokens``: 1.0 for no repeats, near 0 for a loop.

    Acceptance alone rewards a main model that has collapsed into a loop (trivially
    predictable), so training reports and tests check this next to it.
    """
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def heldout_distinct_ngrams(
    model: Model, tokenizer: Any, samples: list[Sample], max_new: int = 48, n: int = 4
) -> float:
    """Mean ``distinct_ngrams`` of greedy continuations of held-out prompts (EOS ignored)."""
    ratios = []
    for sample in samples:
        prompt = encode(tokenizer, prompt_text(sample))
        ratios.append(distinct_ngrams(greedy_continue(model, prompt, max_new, None), n))
    return sum(ratios) / len(ratios)


def eval_samples(heldout: list[Sample], count: int) -> list[Sample]:
    """A fixed spread of ``count`` held-out samples (evenly spaced, first one included)."""
    step = max(len(heldout) // count, 1)
    return heldout[::step][:count]
