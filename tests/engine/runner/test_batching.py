"""Continuous batching of plain decoding: one forward for every decoding request.

Requests join the batch when their prompt is done and leave it when they finish or
are cancelled, between any two steps; the batch lives across steps (its caches are
extended and filtered, never rebuilt); every request gets exactly the tokens it
gets alone (greedy) or with the same seed (sampled).
"""

import itertools
from typing import Any

import mlx.core as mx
import pytest
from mlx.nn.layers.base import Module
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import QuantizedKVCache

from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.step import Step
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.runner.adapter import PlainAdapter, PlainState
from mlxserve.engine.runner.batch import CacheBatch, new_batch
from mlxserve.engine.runner.ring_cache import RingKVCache
from tests.engine.core.test_engine_plain import reference_greedy
from tests.engine.drive import collect, run

PROMPTS = {
    "a": tuple(range(3, 40)),
    "b": tuple(range(50, 60)),
    "c": (7, 8),
    "d": tuple(i % 90 + 1 for i in range(75)),
}


class BatchSizes:
    """A ``before_step`` hook recording each step and the batches' sizes before it."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.steps: list[tuple[Step, list[int]]] = []

    def __call__(self, step: Step) -> None:
        assert self.engine is not None
        self.steps.append((step, [len(b.rows) for b in self.engine.runner.batches]))

    @property
    def sizes(self) -> list[int]:
        return [n for _, sizes in self.steps for n in sizes]


def engine_with(model: Module, hook: BatchSizes, **config: Any) -> Engine:
    engine = Engine(PlainAdapter(model), EngineConfig(**config), before_step=hook)
    hook.engine = engine
    return engine


def test_concurrent_greedy_requests_share_decode_steps(llama_model: Module) -> None:
    hook = BatchSizes()
    engine = engine_with(llama_model, hook, prefill_step=16, max_running=4)
    prompts = {rid: PROMPTS[rid] for rid in ("a", "b", "d")} | {"e": tuple(range(20, 60))}
    requests = [
        GenerationRequest(rid, GenerationParams(prompt, 20)) for rid, prompt in prompts.items()
    ]
    results = run(engine, *requests)
    for rid, prompt in prompts.items():
        assert results[rid][0] == reference_greedy(llama_model, prompt, 20), rid
    assert max(len(step.request_ids) for step, _ in hook.steps if step.kind == "decode") == 4
    assert max(hook.sizes) == 4
    assert not engine.runner.batches  # everyone left


class Counted:
    """Counts calls of the batch cache methods that copy the batch: mlx-lm's (merge,
    extend, filter) and a ring's growth (``_resized``, per layer)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: dict[str, int] = {"merge": 0, "extend": 0, "filter": 0, "_resized": 0}
        for name in ("merge", "extend", "filter"):
            original = getattr(mlx_cache.BatchKVCache, name)
            monkeypatch.setattr(mlx_cache.BatchKVCache, name, self._wrap(name, original))
        resized = RingKVCache._resized
        monkeypatch.setattr(RingKVCache, "_resized", self._wrap("_resized", resized))

    def _wrap(self, name: str, original: Any) -> Any:
        counted = self

        if name == "merge":

            def merge(cls: Any, caches: Any) -> Any:
                counted.calls[name] += 1
                return original.__func__(cls, caches)

            return classmethod(merge)

        def method(self: Any, *args: Any) -> Any:
            counted.calls[name] += 1
            return original(self, *args)

        return method


def test_the_batch_lives_across_steps(llama_model: Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows join and leave a ring in place; only a ring outgrowing its rows is copied
    (once per layer), never a step."""
    counted = Counted(monkeypatch)
    hook = BatchSizes()
    engine = engine_with(llama_model, hook, prefill_step=16, max_running=4)
    short = engine.submit(GenerationRequest("short", GenerationParams(PROMPTS["c"], 12)))
    long = engine.submit(GenerationRequest("long", GenerationParams(PROMPTS["a"], 40)))
    for _ in range(8):
        engine.run_once()
    late = GenerationRequest("late", GenerationParams(tuple(range(30, 62)), 10))
    cancelled = GenerationRequest("gone", GenerationParams(tuple(range(40, 75)), 30))
    late_stream = engine.submit(late)
    gone_stream = engine.submit(cancelled)
    for _ in range(200):
        engine.run_once()
        gone = engine.scheduler.find("gone")
        if gone is not None and len(gone.generated) >= 4:
            break
    assert 3 in hook.sizes  # "gone" decoded inside the batch before leaving it
    engine.cancel("gone")
    for _ in range(500):
        if not engine.run_once():
            break
    collected = {s.request_id: collect(s) for s in (short, long, late_stream, gone_stream)}
    assert collected["short"][0] == reference_greedy(llama_model, PROMPTS["c"], 12)
    assert collected["long"][0] == reference_greedy(llama_model, PROMPTS["a"], 40)
    assert collected["late"][0] == reference_greedy(llama_model, late.params.prompt_ids, 10)
    gone_tokens, gone_finish = collected["gone"]
    assert gone_finish.finish_reason == "cancelled" and len(gone_tokens) >= 4
    assert gone_tokens == reference_greedy(
        llama_model, cancelled.params.prompt_ids, len(gone_tokens)
    )

    batched_steps = sum(1 for _, sizes in hook.steps if sizes)
    # The ring is made for "short"; it widens when "long" joins (more positions) and
    # grows taller when "late" joins (more rows): two copies of the ring, one layer
    # (of 2) at a time. mlx-lm's batch caches are not used.
    assert counted.calls["_resized"] <= 2 * 2
    assert counted.calls["merge"] == counted.calls["extend"] == counted.calls["filter"] == 0
    assert batched_steps >= 40


def test_newcomers_prefill_in_chunks_between_decode_steps(llama_model: Module) -> None:
    hook = BatchSizes()
    engine = engine_with(llama_model, hook, prefill_step=8, max_running=4)
    first = engine.submit(GenerationRequest("first", GenerationParams(PROMPTS["b"], 30)))
    for _ in range(6):
        engine.run_once()
    newcomer = GenerationRequest("new", GenerationParams(PROMPTS["d"], 4))
    second = engine.submit(newcomer)
    for _ in range(500):
        if not engine.run_once():
            break
    kinds = [(step.kind, step.request_ids) for step, _ in hook.steps]
    chunks = [i for i, (kind, ids) in enumerate(kinds) if kind == "prefill" and ids == ("new",)]
    assert len(chunks) == (len(PROMPTS["d"]) - 1 + 7) // 8  # 74 tokens, 8 per step
    for a, b in itertools.pairwise(chunks):
        assert any(kinds[i][0] == "decode" for i in range(a + 1, b)), kinds[a : b + 1]
    assert collect(first)[0] == reference_greedy(llama_model, PROMPTS["b"], 30)
    assert collect(second)[0] == reference_greedy(llama_model, PROMPTS["d"], 4)


def test_sampled_requests_are_reproducible_in_a_batch(llama_model: Module) -> None:
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    alone = run(
        Engine(PlainAdapter(llama_model), EngineConfig(max_running=1)),
        GenerationRequest("s", GenerationParams(PROMPTS["a"], 16, sampling)),
    )["s"][0]
    crowd = run(
        Engine(PlainAdapter(llama_model), EngineConfig(max_running=4)),
        GenerationRequest("s", GenerationParams(PROMPTS["a"], 16, sampling)),
        GenerationRequest("x", GenerationParams(PROMPTS["b"], 16, SamplingParams(1.0, 0.9, 3))),
        GenerationRequest("y", GenerationParams(PROMPTS["c"], 16)),
    )["s"][0]
    assert crowd == alone


def test_caches_without_batched_form_decode_one_by_one(llama_model: Module) -> None:
    adapter = PlainAdapter(llama_model)
    quantized = PlainState([QuantizedKVCache() for _ in range(2)])
    assert isinstance(new_batch(adapter, [adapter.new_state(0), adapter.new_state(0)]), CacheBatch)
    assert new_batch(adapter, [adapter.new_state(0), quantized]) is None


def _prefilled(adapter: PlainAdapter, length: int) -> PlainState:
    state = adapter.new_state(0)
    adapter.prefill(state, [i % 90 + 1 for i in range(length)])
    return state


def test_a_long_context_does_not_pad_a_batch_of_short_ones(llama_model: Module) -> None:
    adapter = PlainAdapter(llama_model)
    batch = new_batch(adapter, [_prefilled(adapter, 100), _prefilled(adapter, 90)])
    assert batch is not None
    assert batch.fits(_prefilled(adapter, 120))
    assert not batch.fits(_prefilled(adapter, 3000))
    logits = batch.step(mx.array([1, 2]))
    assert logits.shape == (2, 97)


def test_a_lone_request_decodes_on_its_own_caches_until_another_joins(
    llama_model: Module,
) -> None:
    """One plain request alone takes no batch (a batch of one costs a small model about
    a tenth more per step); with a second one decoding beside it both join a batch, and
    each still gets its own greedy tokens."""
    hook = BatchSizes()
    engine = engine_with(llama_model, hook, max_running=4)
    results = run(engine, GenerationRequest("a", GenerationParams(PROMPTS["a"], 12)))
    assert results["a"][0] == reference_greedy(llama_model, PROMPTS["a"], 12)
    assert hook.sizes == []  # no step ran with a batch
    hook.steps.clear()
    results = run(
        engine,
        GenerationRequest("a", GenerationParams(PROMPTS["a"], 12)),
        GenerationRequest("b", GenerationParams(PROMPTS["b"], 12)),
    )
    for rid in ("a", "b"):
        assert results[rid][0] == reference_greedy(llama_model, PROMPTS[rid], 12), rid
    assert max(hook.sizes) == 2


def test_sampled_rows_at_temperature_one_draw_as_alone(llama_model: Module) -> None:
    """Rows sampled together (`sample_rows`: one graph for the batch) draw the tokens
    each draws alone with its seed, beside greedy and top-p rows."""
    seeded = SamplingParams(temperature=1.0, seed=21)
    alone = run(
        Engine(PlainAdapter(llama_model), EngineConfig(max_running=1)),
        GenerationRequest("s", GenerationParams(PROMPTS["a"], 16, seeded)),
    )["s"][0]
    crowd = run(
        Engine(PlainAdapter(llama_model), EngineConfig(max_running=4)),
        GenerationRequest("s", GenerationParams(PROMPTS["a"], 16, seeded)),
        GenerationRequest("x", GenerationParams(PROMPTS["b"], 16, SamplingParams(0.7, 1.0, 4))),
        GenerationRequest("y", GenerationParams(PROMPTS["c"], 16)),
        GenerationRequest("z", GenerationParams(PROMPTS["d"], 16, SamplingParams(1.0, 0.9, 5))),
    )["s"][0]
    assert crowd == alone


def test_a_request_starting_beside_others_takes_its_first_token_from_their_step(
    llama_model: Module,
) -> None:
    """No forward of its own for a newcomer's first token while others decode: it joins
    their batch with its last prompt token, and gets the tokens it gets alone."""
    hook = BatchSizes()
    engine = engine_with(llama_model, hook, max_running=4)
    first = engine.submit(GenerationRequest("a", GenerationParams(PROMPTS["a"], 30)))
    for _ in range(4):
        engine.run_once()
    later = [
        engine.submit(GenerationRequest(rid, GenerationParams(PROMPTS[rid], 12)))
        for rid in ("b", "d")
    ]
    for _ in range(1000):
        if not engine.run_once():
            break
    solo = [step.request_ids for step, _ in hook.steps if step.kind == "decode"]
    assert ("b",) not in solo and ("d",) not in solo
    assert any({"a", "b"} <= set(ids) for ids in solo)
    assert collect(first)[0] == reference_greedy(llama_model, PROMPTS["a"], 30)
    for rid, stream in zip(("b", "d"), later, strict=True):
        assert collect(stream)[0] == reference_greedy(llama_model, PROMPTS[rid], 12), rid
