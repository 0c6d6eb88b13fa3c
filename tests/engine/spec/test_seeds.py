"""A seed reproduces its answer: the token at each position is drawn with that
position's key, the same whichever step draws it, so the answer does not depend on
the speculative depth (coupled draws in the rounds), on the requests it shares
batches with, or on `max_tokens` (a shorter answer is a prefix of a longer one).

On the DeepSeek-V4 demo (MTP drafts), for a request that decodes pipelined
(temperature and top_p) and one chosen token by token (top_k and logprobs: a
`TokenChooser`), at depths 0, 1, 3 and automatic, alone and batched.
"""

from collections.abc import Iterator
from typing import Any

import pytest

from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.engine.core.build import materialize
from mlxserve.engine.core.request import FinishEvent, GenerationRequest
from mlxserve.engine.core.step import Step
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.sample.grammar import Grammars
from mlxserve.engine.spec.mtp import MTPAdapter
from tests.engine.drive import collect

pytestmark = pytest.mark.slow

DEPTHS: tuple[int | str, ...] = (0, 1, 3, "auto")
SEEDED = {
    "pipelined": SamplingParams(temperature=0.9, top_p=0.95, seed=42),
    "chosen": SamplingParams(temperature=0.9, top_k=40, seed=7, logprobs=1),
}
LONG, SHORT = 24, 8


@pytest.fixture(scope="module")
def demo() -> Iterator[tuple[Any, Any]]:
    from mlxserve.models import load

    model, tokenizer = load("demo")
    materialize(model)
    yield model, tokenizer


def depth_engines(
    model: Any, rows: int, batch_depth: int, grammars: Grammars | None = None
) -> dict[int | str, Engine]:
    """One engine per depth of `DEPTHS`, up to ``rows`` requests drafting together at
    ``batch_depth`` (an automatic depth calibrates once)."""
    return {
        depth: Engine(
            MTPAdapter(model),
            EngineConfig(
                prefill_step=64,
                prefix_cache_entries=0,
                speculative_depth=depth,  # type: ignore[arg-type]
                max_running=rows,
                max_speculative_batch=rows,
                batch_speculative_depth=batch_depth,
            ),
            grammars=grammars,
        )
        for depth in DEPTHS
    }


@pytest.fixture(scope="module")
def engines(demo: tuple[Any, Any]) -> dict[int | str, Engine]:
    return depth_engines(demo[0], rows=4, batch_depth=2)


def ask(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(f"<|user|>{text}<|end|><|assistant|>"))


Answers = dict[str, tuple[list[int], FinishEvent]]


def answers(
    engine: Engine, first: list[GenerationRequest], later: list[GenerationRequest]
) -> Answers:
    """Run ``first`` together, ``later`` joining after a few steps; each one's tokens
    and finish."""
    streams = [engine.submit(r) for r in first]
    for _ in range(6):
        engine.run_once()
    streams += [engine.submit(r) for r in later]
    while engine.run_once():
        pass
    out = {}
    for stream in streams:
        tokens, finish = collect(stream)
        assert finish.finish_reason == "length", finish.error
        out[stream.request_id] = (tokens, finish)
    return out


def kept(finish: FinishEvent) -> int:
    """Drafts kept over the request's rounds."""
    assert finish.speculative is not None
    accepted = finish.speculative["accepted"]
    assert isinstance(accepted, int)
    return accepted


def test_a_seed_gives_one_answer_at_every_depth_alone_batched_and_cut(
    demo: tuple[Any, Any], engines: dict[int | str, Engine]
) -> None:
    """Each seeded request alone at depth 0 is the reference. At every depth: each
    alone; both cut short together; both in a batch with a greedy request and another
    seeded one, the chosen one joining when the others decode."""
    _, tokenizer = demo
    prompts = {
        "pipelined": ask(tokenizer, "Python reference: the for statement"),
        "chosen": ask(tokenizer, "The assert statement"),
    }

    def seeded(kind: str, max_tokens: int = LONG) -> GenerationRequest:
        return GenerationRequest(kind, GenerationParams(prompts[kind], max_tokens, SEEDED[kind]))

    greedy = GenerationRequest("greedy", GenerationParams(ask(tokenizer, "with"), 20))
    other = GenerationRequest(
        "other", GenerationParams(ask(tokenizer, "yield"), 30, SamplingParams(1.0, seed=1))
    )
    base = {kind: answers(engines[0], [seeded(kind)], [])[kind][0] for kind in SEEDED}
    assert all(len(tokens) == LONG for tokens in base.values())
    shared: list[Step] = []
    for depth in DEPTHS:
        engine = engines[depth]
        engine.before_step = shared.append
        for kind in SEEDED:
            alone, finish = answers(engine, [seeded(kind)], [])[kind]
            assert alone == base[kind], (kind, depth)
            if depth in (1, 3):  # its rounds kept drafts
                assert kept(finish) > 0, (kind, depth)
        cut = answers(engine, [seeded(kind, SHORT) for kind in SEEDED], [])
        batched = answers(engine, [greedy, seeded("pipelined")], [other, seeded("chosen")])
        for kind in SEEDED:
            assert cut[kind][0] == base[kind][:SHORT], (kind, depth)
            assert batched[kind][0] == base[kind], (kind, depth)
            if depth in (1, 3):  # drafting with the others too
                assert kept(batched[kind][1]) > 0, (kind, depth)
    assert any(s.kind == "speculate" and len(s.request_ids) == 4 for s in shared)
    # The seed matters: another one gives another answer.
    reseeded = GenerationRequest(
        "pipelined",
        GenerationParams(prompts["pipelined"], LONG, SamplingParams(temperature=0.9, seed=43)),
    )
    assert answers(engines[3], [reseeded], [])["pipelined"][0] != base["pipelined"]
