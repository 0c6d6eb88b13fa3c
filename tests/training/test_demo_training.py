"""The demo's on-policy training phases: losses, sequence data and what each phase trains."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxserve.models.demo.build import WEIGHTS_DIR, flat_parameters
from training.demo import corpus, finetune, onpolicy, train
from training.demo.evaluate import distinct_ngrams, encode, greedy_continue, prompt_text


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(WEIGHTS_DIR))


def test_distill_loss_hard_and_soft_parts() -> None:
    draft = mx.array([[[2.0, 0.5, -1.0]]])
    target = mx.array([[[0.1, 1.5, 0.3]]])
    logp = np.log(np.exp([2.0, 0.5, -1.0]) / np.exp([2.0, 0.5, -1.0]).sum())
    probs = np.exp([0.1, 1.5, 0.3]) / np.exp([0.1, 1.5, 0.3]).sum()
    hard = finetune.distill_loss(draft, target, soft=0.0).item()
    dense = finetune.distill_loss(draft, target, soft=1.0).item()
    assert hard == pytest.approx(-logp[1], rel=1e-5)
    assert dense == pytest.approx(-(probs * logp).sum(), rel=1e-5)
    # The target is a fixed teacher: no gradient reaches it.
    grad = mx.grad(lambda t: finetune.distill_loss(draft, t, 0.5).sum())(target)
    assert np.all(np.asarray(grad) == 0)


def test_continuation_mask_starts_at_the_last_prompt_token() -> None:
    data = onpolicy.Sequences(
        tokens=np.zeros((2, 6), np.int32),
        streams=np.zeros((2, 6, 1, 1), np.float32),
        prompt_lengths=np.array([2, 4]),
    )
    mask = data.continuation_mask(offset=2)
    assert mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]


def test_distinct_ngrams_sees_loops() -> None:
    assert distinct_ngrams(list(range(10))) == 1.0
    assert distinct_ngrams([1, 2] * 10) == pytest.approx(2 / 17)


def test_greedy_sequences_match_cached_greedy_decoding(tokenizer: Any) -> None:
    model = train.make_model(0)
    samples = corpus.split()[0][:3]
    prompts = onpolicy.training_prompts(tokenizer, samples, [20, 40], max_tokens=30)
    data = onpolicy.greedy_sequences(model, prompts, length=36, batch=2)
    assert data.tokens.shape == (len(prompts), 36)
    assert data.streams.shape[:2] == (len(prompts), 36)
    for row, size in zip(data.tokens, data.prompt_lengths, strict=True):
        prompt = row[:size].tolist()
        assert prompt in prompts
        assert row[size:].tolist() == greedy_continue(model, prompt, 36 - size, None)
    # The streams kept while decoding are those of one prefill over the row.
    full = model.forward_hidden(mx.array(data.tokens[:1]))
    np.testing.assert_allclose(data.streams[:1], np.asarray(full), atol=1e-4)


def _params(model: Any) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in flat_parameters(model)}


def _changed(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> set[str]:
    return {k for k in before if not np.array_equal(before[k], after[k])}


def test_phases_train_what_they_say(tokenizer: Any) -> None:
    opts = train.build_parser().parse_args(
        [
            "--out",
            "unused",
            "--length",
            "32",
            "--agree-steps",
            "2",
            "--onpolicy-steps",
            "2",
            "--onpolicy-length",
            "36",
            "--onpolicy-chars",
            "20",
            "--onpolicy-batch",
            "2",
            "--agree-corpus-batch",
            "1",
        ]
    )
    model = train.make_model(0)
    samples = corpus.split()[0][:4]
    train_ids = train.token_stream(tokenizer, samples)

    before = _params(model)
    report = finetune.agree(model, tokenizer, samples, train_ids, opts)
    assert report is not None and report["steps"] == 2 and report["sequences"] == 4
    changed = _changed(before, _params(model))
    assert any(k.startswith("mtp.") for k in changed)
    assert any(k.startswith("model.") for k in changed)
    assert not any(k.endswith("tid2eid") for k in changed)

    before = _params(model)
    report = finetune.distill_onpolicy(model, tokenizer, samples, opts)
    assert report is not None and report["steps"] == 2
    changed = _changed(before, _params(model))
    assert changed and all(k.startswith("mtp.") for k in changed)


def test_phases_are_skipped_at_zero_steps(tokenizer: Any) -> None:
    opts = train.build_parser().parse_args(["--out", "unused"])
    model = train.make_model(0)
    assert finetune.agree(model, tokenizer, [], np.zeros(1, np.int32), opts) is None
    assert finetune.distill_onpolicy(model, tokenizer, [], opts) is None


def test_training_prompts_are_distinct_and_truncated(tokenizer: Any) -> None:
    samples = corpus.split()[0][:5]
    prompts = onpolicy.training_prompts(tokenizer, samples, [20, 20, 40], max_tokens=12)
    assert len(prompts) == len({tuple(p) for p in prompts})
    assert all(len(p) <= 12 for p in prompts)
    first = encode(tokenizer, prompt_text(samples[0], 20))[:12]
    assert first in prompts
