"""Speculative rounds of requests with a `TokenChooser`: exact as depth 0.

Greedy: a JSON-schema request and a penalised one with logprobs emit at depth k
the tokens (and logprobs) they emit at depth 0, alone and drafting together with
others. Sampling: rejection sampling against the transformed target keeps that
distribution (chi-square), whatever the drafts were drawn from.
"""

import json
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from llguidance import LLMatcher
from scipy.stats import chisquare

from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.engine.core.build import materialize
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.sample.grammar import Grammars
from mlxserve.engine.sample.logits import TokenChooser
from mlxserve.engine.sample.sampling import KeyStream
from mlxserve.engine.spec.draft_choice import ChosenRound
from mlxserve.engine.spec.mtp import MTPAdapter
from tests.engine.spec.test_chooser_batching import SCHEMA, drive, recording, requests

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo() -> Iterator[tuple[Any, Any, Grammars]]:
    from mlxserve.models import load

    model, tokenizer = load("demo")
    materialize(model)
    yield model, tokenizer, Grammars(tokenizer, int(model.args.vocab_size))


def engine(demo: tuple[Any, Any, Grammars], depth: int, **config: Any) -> Engine:
    model, _, grammars = demo
    settings = EngineConfig(
        prefill_step=64, prefix_cache_entries=0, speculative_depth=depth, **config
    )
    return Engine(MTPAdapter(model), settings, grammars=grammars)


def ask(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(f"<|user|>{text}<|end|><|assistant|>"))


def test_greedy_json_at_depth_k_equals_depth_0(demo: tuple[Any, Any, Grammars]) -> None:
    _, tokenizer, _ = demo
    options: Any = {"whitespace_flexible": False}
    grammar = LLMatcher.grammar_from_json_schema(SCHEMA, defaults=options)
    stops = tuple(tokenizer.eos_token_ids)
    request = GenerationRequest(
        "j",
        GenerationParams(
            ask(tokenizer, "JSON please"), 48, SamplingParams(logprobs=2), stops, grammar=grammar
        ),
    )
    base, base_lp, _ = drive(engine(demo, 0), [request], [])["j"]
    for depth in (2, 4):
        tokens, records, finish = drive(engine(demo, depth), [request], [])["j"]
        assert tokens == base, depth
        assert [r.logprob for r in records] == pytest.approx([r.logprob for r in base_lp], abs=1e-3)
        assert finish.speculative is not None and finish.speculative["accepted"] > 0
    value = json.loads(tokenizer.decode(base))
    assert isinstance(value["ok"], bool) and value["pick"] in ("red", "green", "blue")


def test_penalised_greedy_at_depth_k_equals_depth_0(demo: tuple[Any, Any, Grammars]) -> None:
    _, tokenizer, _ = demo
    prompt = ask(tokenizer, "Python reference: the for statement")
    sampling = SamplingParams(
        presence_penalty=0.7,
        frequency_penalty=0.4,
        repetition_penalty=1.3,
        logit_bias=((tokenizer.encode(" the")[-1], -5.0),),
        logprobs=4,
    )
    request = GenerationRequest("p", GenerationParams(prompt, 40, sampling))
    base, base_lp, _ = drive(engine(demo, 0), [request], [])["p"]
    tokens, records, finish = drive(engine(demo, 3), [request], [])["p"]
    assert tokens == base
    assert finish.speculative is not None and finish.speculative["drafted"] > 0
    for mine, theirs in zip(records, base_lp, strict=True):
        assert mine.token == theirs.token
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-3)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
    # Without the penalties the answer differs: they are applied inside the rounds.
    plain, _, _ = drive(
        engine(demo, 3), [GenerationRequest("q", GenerationParams(prompt, 40))], []
    )["q"]
    assert plain != tokens


def test_chooser_rows_speculate_together_exactly(demo: tuple[Any, Any, Grammars]) -> None:
    """Batched rounds (`MTPRowBatch.speculate`) with a JSON row and a penalised row
    beside plain ones, joining and leaving: each row's tokens are its depth-0 ones."""
    _, tokenizer, _ = demo
    first, later = requests(tokenizer)
    seen: list[Any] = []
    plans: list[Any] = []
    batched = engine(demo, 3, max_running=4, max_speculative_batch=4, batch_speculative_depth=2)
    recording(batched, seen)
    record = batched.before_step
    assert record is not None

    def hook(plan: Any) -> None:
        plans.append(plan)
        record(plan)

    batched.before_step = hook
    together = drive(batched, first, later)
    assert any(p.kind == "speculate" and len(p.request_ids) >= 3 for p in plans)
    assert any(chosen and rows >= 3 for _, rows, chosen in seen)
    for request in (*first, *later):
        alone = drive(engine(demo, 0), [request], [])[request.request_id]
        assert together[request.request_id][0] == alone[0], request.request_id
        assert [r.logprob for r in together[request.request_id][1]] == pytest.approx(
            [r.logprob for r in alone[1]], abs=1e-3
        )
    assert json.loads(tokenizer.decode(together["json"][0]))["pick"] in ("red", "green", "blue")


def test_a_draft_the_grammar_rejects_is_a_rejection(demo: tuple[Any, Any, Grammars]) -> None:
    """A draft the grammar cannot take ends the round there, even where the target's
    raw logits favour it: the replacement is the grammar's best token."""
    _, tokenizer, grammars = demo
    grammar = grammars.compile(LLMatcher.grammar_from_regex("[ab]+"))
    a, b, x = (tokenizer.encode(c)[-1] for c in "abx")
    chooser = TokenChooser(SamplingParams(), grammar)
    chosen = ChosenRound(chooser, remaining=10)
    # Drafts as a drafter without the mask could make them: x is not in the grammar.
    chosen.drafts = [mx.array(a, dtype=mx.int32), mx.array(x, dtype=mx.int32)]
    logits = mx.zeros((3, grammars.vocab_size))
    logits = logits.at[0, a].add(5.0).at[1, x].add(5.0).at[1, b].add(1.0)
    assert chosen.verify(logits, KeyStream(0).at(0)) == [a, b]
    # The grammar read the emitted tokens only; it goes on from "ab".
    assert chooser.history == [a, b] and grammar.allows([x]) == 0 and grammar.allows([a]) == 1


def _transformed(logits: np.ndarray, history: list[int], presence: float, top_k: int) -> np.ndarray:
    """The reference target: presence penalty, log-softmax, temperature 1, top-k."""
    scores = logits.astype(np.float64).copy()
    scores[sorted(set(history))] -= presence
    keep = np.argsort(-scores)[:top_k]
    out = np.zeros_like(scores)
    out[keep] = np.exp(scores[keep] - scores[keep].max())
    return out / out.sum()


@pytest.mark.parametrize("coupled", [False, True])
def test_speculative_draws_keep_the_transformed_target(coupled: bool) -> None:
    """top_k 3 and a presence penalty on a vocabulary of 8; the drafter is far from the
    target. The first emitted token follows the transformed target p_0, the second
    (after the most frequent first one) p_1 with that token counted by the penalty:
    under rejection sampling (no seed) and under coupled draws (a seed)."""
    vocab, presence, top_k, history = 8, 1.5, 3, [2]
    rng = np.random.default_rng(0)
    target = rng.normal(size=(3, vocab)) * 1.5
    target[:, 2] += 1.0  # the penalised token would be in the top 3 without the penalty
    draft = rng.normal(size=(2, vocab)) * 2.0
    params = SamplingParams(temperature=1.0, top_k=top_k, presence_penalty=presence)
    keys = KeyStream(7, coupled=coupled)
    target_mx, draft_mx = mx.array(target, dtype=mx.float32), mx.array(draft, dtype=mx.float32)
    runs = 2000 if coupled else 1000  # coupled draws keep fewer of these poor drafts
    emitted = []
    for run in range(runs):
        draws = keys.at(4 * run)  # each run at positions of its own
        chosen = ChosenRound(TokenChooser(params, None, tuple(history)), remaining=100)
        for level in range(2):
            chosen.propose(level, draft_mx[level], params, draws.key(level))
        emitted.append(chosen.verify(target_mx, draws))
    first = np.bincount([e[0] for e in emitted], minlength=vocab)
    expected = _transformed(target[0], history, presence, top_k)
    support = expected > 0
    assert first[~support].sum() == 0
    assert chisquare(first[support], expected[support] * runs).pvalue > 0.001
    # The test can fail: without the penalty the first token's distribution differs.
    untransformed = _transformed(target[0], history, 0.0, top_k)
    assert untransformed[2] > 0 and first[2] == 0
    # The drafts kept: the most frequent first token among rounds that emitted two.
    lead = int(np.argmax(np.bincount([e[0] for e in emitted if len(e) > 1], minlength=vocab)))
    second = np.bincount([e[1] for e in emitted if len(e) > 1 and e[0] == lead], minlength=vocab)
    expected = _transformed(target[1], [*history, lead], presence, top_k)
    support = expected > 0
    assert second.sum() > 100 and second[~support].sum() == 0
    assert chisquare(second[support], expected[support] * second.sum()).pvalue > 0.001
