"""DeepSeek-V4 in a decode batch: every row at its own position, exact as alone.

Each row keeps its own sliding window, compressor (CSA/HCA) and indexer state
(``RowCaches``); requests of different lengths join and leave mid-generation, so
rows close compressor windows at different steps. Greedy tokens must equal the
request run alone, with and without the MTP module (whose requests decode in the
batch and speculate again when alone).
"""

from typing import Any, Literal

import pytest
from mlx.nn.layers.base import Module

from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.engine.core.request import FinishEvent, GenerationRequest
from mlxserve.engine.core.step import Step
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.runner.adapter import ModelAdapter, PlainAdapter
from mlxserve.engine.runner.batch import MTPRowBatch, RowBatch
from mlxserve.engine.spec.mtp import MTPAdapter
from tests.engine.drive import collect, run
from tests.engine.spec.test_speculative import plain_greedy
from tests.engine.v4_models import tiny_v4

# Lengths around the window (8) and the compression ratios (4, 16), none aligned.
PROMPTS = {
    "long": tuple((7 * i + 3) % 61 for i in range(45)),
    "short": (5, 9, 2),
    "mid": tuple((5 * i + 1) % 61 for i in range(19)),
    "odd": tuple((3 * i + 2) % 61 for i in range(33)),
}
BUDGET = {"long": 30, "short": 12, "mid": 22, "odd": 9}


@pytest.fixture(scope="module")
def v4() -> Module:
    return tiny_v4()


@pytest.fixture(scope="module")
def alone(v4: Module) -> dict[str, list[int]]:
    return {rid: plain_greedy(v4, prompt, BUDGET[rid]) for rid, prompt in PROMPTS.items()}


def staggered(
    adapter: ModelAdapter,
    depth: int | Literal["auto"],
    stacked: list[bool] | None = None,
    finishes: dict[str, FinishEvent] | None = None,
    **config: Any,
) -> tuple[dict[str, list[int]], list[Any]]:
    """Two requests start, two join mid-generation, they leave at different steps.

    ``stacked`` collects, per step, whether a batch's rows were stacked before it;
    ``finishes`` the requests' finish events, when given."""
    sizes: list[tuple[Step, list[int]]] = []
    engine: Engine

    def hook(step: Step) -> None:
        sizes.append((step, [len(b.rows) for b in engine.runner.batches]))
        if stacked is not None:
            stacked.append(any(getattr(b.state, "stacked", False) for b in engine.runner.batches))

    settings = EngineConfig(prefill_step=8, max_running=4, speculative_depth=depth, **config)
    engine = Engine(adapter, settings, before_step=hook)
    streams = [
        engine.submit(GenerationRequest(r, GenerationParams(PROMPTS[r], BUDGET[r])))
        for r in ("long", "short")
    ]
    for _ in range(12):
        engine.run_once()
    streams += [
        engine.submit(GenerationRequest(r, GenerationParams(PROMPTS[r], BUDGET[r])))
        for r in ("mid", "odd")
    ]
    for _ in range(1000):
        if not engine.run_once():
            break
    tokens = {}
    for stream in streams:
        got, finish = collect(stream)
        assert finish.finish_reason == "length"
        tokens[stream.request_id] = got
        if finishes is not None:
            finishes[stream.request_id] = finish
    assert not engine.runner.batches
    return tokens, sizes


def test_plain_v4_rows_equal_alone(v4: Module, alone: dict[str, list[int]]) -> None:
    """The rows' caches stacked for the decode steps (``stacked.py``), written back and
    stacked again as rows join and leave; every row's tokens are its own alone."""
    stacked: list[bool] = []
    tokens, sizes = staggered(PlainAdapter(v4), depth=0, stacked=stacked)
    assert tokens == alone
    assert max(n for _, batch in sizes for n in batch) >= 3
    assert sum(stacked) > len(stacked) // 2


def test_mtp_rows_decode_together_and_speculate_alone(
    v4: Module, alone: dict[str, list[int]]
) -> None:
    stacked: list[bool] = []
    finishes: dict[str, FinishEvent] = {}
    tokens, sizes = staggered(MTPAdapter(v4), depth=3, stacked=stacked, finishes=finishes)
    assert tokens == alone
    assert max(n for _, batch in sizes for n in batch) >= 3
    assert any(stacked)
    # Alone at the end ("long" outlives the others), it drafts again.
    assert any(step.kind == "speculate" for step, _ in sizes[len(sizes) // 2 :])
    # Every decode step after the first token (taken plainly before any drafting) is
    # a plain step in the batch: depths_chosen (and the depth metric) count it at 0.
    for rid, finish in finishes.items():
        assert finish.speculative is not None
        decodes = sum(rid in step.request_ids for step, _ in sizes if step.kind == "decode")
        chosen = finish.speculative["depths_chosen"]
        assert isinstance(chosen, dict) and chosen.get("0") == decodes - 1, (rid, chosen)
        if rid != "long":  # the others never leave the batch
            assert chosen == {"0": decodes - 1}, (rid, chosen)


@pytest.mark.parametrize("batch_depth", [1, 3])
def test_rows_speculate_together(v4: Module, alone: dict[str, list[int]], batch_depth: int) -> None:
    """Drafts of every row made together, verified in one forward, rolled back per row."""
    tokens, sizes = staggered(
        MTPAdapter(v4), depth=3, max_speculative_batch=4, batch_speculative_depth=batch_depth
    )
    assert tokens == alone
    together = [p for p, _ in sizes if p.kind == "speculate" and len(p.request_ids) >= 3]
    assert together and all(p.num_tokens == batch_depth for p in together)


def test_automatic_depth_alone_and_batched_speculation(
    v4: Module, alone: dict[str, list[int]]
) -> None:
    """With `depth = "auto"` a lone request drafts at the depth picker's depth per round,
    two rows draft together at the batch depth, more decode plainly; all exact."""
    tokens, sizes = staggered(
        MTPAdapter(v4), depth="auto", max_speculative_batch=2, batch_speculative_depth=2
    )
    assert tokens == alone
    speculate = [p for p, _ in sizes if p.kind == "speculate"]
    assert any(len(p.request_ids) == 1 for p in speculate)
    pairs = [p for p in speculate if len(p.request_ids) == 2]
    assert pairs and all(p.num_tokens <= 2 for p in pairs)
    assert not any(len(p.request_ids) > 2 for p in speculate)


def test_batch_forms(v4: Module) -> None:
    plain = run(
        Engine(PlainAdapter(v4), EngineConfig(max_running=2)),
        GenerationRequest("x", GenerationParams(PROMPTS["mid"], 3)),
    )
    assert plain["x"][1].finish_reason == "length"
    from mlxserve.engine.runner.batch import new_batch

    adapter = MTPAdapter(v4)
    state = adapter.new_state(0)
    adapter.prefill(state, list(PROMPTS["mid"]))
    assert isinstance(new_batch(adapter, [state]), MTPRowBatch)
    plain_adapter = PlainAdapter(v4)
    plain_state = plain_adapter.new_state(0)
    assert isinstance(new_batch(plain_adapter, [plain_state]), RowBatch)


def test_greedy_rows_speculating_beside_sampled_ones_are_exact(
    v4: Module, alone: dict[str, list[int]]
) -> None:
    """A sampled row's rejection sampling is its own: the greedy row beside it keeps its
    tokens (rejection sampling itself: tests/engine/sample/test_acceptance.py)."""
    config = EngineConfig(
        max_running=2, speculative_depth=3, max_speculative_batch=2, batch_speculative_depth=2
    )
    steps: list[Step] = []
    engine = Engine(MTPAdapter(v4), config, before_step=steps.append)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    results = run(
        engine,
        GenerationRequest("long", GenerationParams(PROMPTS["long"], BUDGET["long"])),
        GenerationRequest("s", GenerationParams(PROMPTS["mid"], 20, sampled)),
    )
    assert results["long"][0] == alone["long"]
    tokens, finish = results["s"]
    assert finish.finish_reason == "length" and len(tokens) == 20
    assert all(0 <= t < 61 for t in tokens)
    assert any(p.kind == "speculate" and len(p.request_ids) == 2 for p in steps)
