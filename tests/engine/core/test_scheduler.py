"""The step scheduler: chunked prefill interleaves with decoding; admission limits."""

import itertools
import queue
import time

from mlx.nn.layers.base import Module

from mlxserve.channel.request import GenerationParams
from mlxserve.engine.core.request import FinishEvent, GenerationRequest, TokensEvent
from mlxserve.engine.core.step import Step
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.process.loop import EngineLoop
from mlxserve.engine.runner.adapter import PlainAdapter


def test_step_json_round_trip() -> None:
    step = Step(index=3, kind="speculate", request_ids=("a", "b"), num_tokens=4)
    assert Step.from_json(step.to_json()) == step


def test_decoder_keeps_streaming_while_a_long_prompt_prefills(llama_model: Module) -> None:
    steps: list[Step] = []
    engine = Engine(
        PlainAdapter(llama_model),
        EngineConfig(prefill_step=32, max_running=4),
        before_step=steps.append,
    )
    decoder = engine.submit(GenerationRequest("decoder", GenerationParams((1, 2, 3), 200)))
    for _ in range(3):
        engine.run_once()
    long_prompt = tuple(i % 90 + 1 for i in range(32 * 20 + 1))
    engine.submit(GenerationRequest("long", GenerationParams(long_prompt, 1)))
    for _ in range(1000):
        if not engine.run_once():
            break
    prefill_steps = [
        i for i, s in enumerate(steps) if s.kind == "prefill" and s.request_ids == ("long",)
    ]
    assert len(prefill_steps) == 20
    # Between two prefill chunks of the long prompt, the decoder got a step every time.
    for before, after in itertools.pairwise(prefill_steps):
        between = steps[before + 1 : after]
        assert any(s.request_ids == ("decoder",) for s in between)
    tokens = 0
    while True:
        event = decoder.get(timeout=1)
        if isinstance(event, TokensEvent):
            tokens += len(event.token_ids)
        if isinstance(event, FinishEvent):
            break
    assert tokens == 200


def test_decoder_inter_token_latency_during_long_prefill(llama_model: Module) -> None:
    """Measured with a generous bound: the worst gap while a 2k-token prompt prefills
    stays far below the time that whole prefill takes."""
    engine = Engine(PlainAdapter(llama_model), EngineConfig(prefill_step=64, max_running=4))
    crashed: list[int] = []
    loop = EngineLoop(engine, exit=crashed.append)  # the engine process's loop
    loop.start()
    try:
        decoder = engine.submit(GenerationRequest("d", GenerationParams((1, 2, 3), 400)))
        decoder.get(timeout=30)
        long_prompt = tuple(i % 90 + 1 for i in range(2048))
        started = time.monotonic()
        prefill = engine.submit(GenerationRequest("p", GenerationParams(long_prompt, 1)))
        gaps = []
        last = time.monotonic()
        prefill_done = None
        while prefill_done is None:
            try:
                decoder.get(timeout=0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now
            except queue.Empty:
                pass
            try:
                if isinstance(prefill.get(timeout=0), FinishEvent):
                    prefill_done = time.monotonic() - started
            except queue.Empty:
                pass
            assert time.monotonic() - started < 120
        # Without interleaving the decoder would wait for the whole prefill.
        assert len(gaps) >= 5
        assert max(gaps) < prefill_done / 2
    finally:
        engine.cancel("d")
        assert loop.stop(10)
    assert not crashed


def test_max_running_bounds_admission(llama_model: Module) -> None:
    engine = Engine(PlainAdapter(llama_model), EngineConfig(max_running=2))
    for name in "abc":
        engine.submit(GenerationRequest(name, GenerationParams((1, 2, 3), 50)))
    engine.run_once()
    assert engine.running == 2 and engine.queue_depth == 1


def test_speculative_depth_follows_the_batch_size() -> None:
    """Alone: its own depth; two: one `speculate` step for both at the batch depth;
    three: plain batched decoding."""
    from mlxserve.engine.core.request_state import Phase, RequestState
    from mlxserve.engine.core.scheduler import Scheduler
    from mlxserve.engine.sample.sampling import KeyStream

    scheduler = Scheduler(4, 16, max_speculative_batch=2, batch_speculative_depth=2)

    def decoding(rid: str, depth: int) -> RequestState:
        sequence = RequestState(
            GenerationRequest(rid, GenerationParams((1, 2), 50)), KeyStream(0), depth=depth
        )
        sequence.phase = Phase.DECODE
        scheduler.running.append(sequence)
        return sequence

    decoding("a", 3)
    step = scheduler.next_step()
    assert step is not None and (step.kind, step.request_ids, step.num_tokens) == (
        "speculate",
        ("a",),
        3,
    )
    decoding("b", 1)
    step = scheduler.next_step()
    assert step is not None and (step.kind, step.request_ids, step.num_tokens) == (
        "speculate",
        ("a", "b"),
        1,
    )
    decoding("c", 3)
    step = scheduler.next_step()
    assert step is not None and (step.kind, step.request_ids) == ("decode", ("a", "b", "c"))


def test_short_prompts_arriving_together_share_one_chunk_budget(llama_model: Module) -> None:
    """Five 21-token prompts arrive while a request decodes (chunk budget 64): three
    prefills (60 tokens) run back to back, then the decoding requests' turn, then the
    other two; never more than a chunk's tokens between two decode steps, and the
    newcomers' first tokens ride along a decode step, not steps of their own."""
    steps: list[Step] = []
    engine = Engine(
        PlainAdapter(llama_model),
        EngineConfig(prefill_step=64, max_running=8),
        before_step=steps.append,
    )
    engine.submit(GenerationRequest("decoder", GenerationParams((1, 2, 3), 60)))
    for _ in range(3):
        engine.run_once()
    steps.clear()
    for i in range(5):
        prompt = tuple((i * 7 + j) % 80 + 10 for j in range(21))
        engine.submit(GenerationRequest(f"n{i}", GenerationParams(prompt, 8)))
    for _ in range(1000):
        if not engine.run_once():
            break
    kinds = "".join("p" if s.kind == "prefill" else "d" for s in steps)
    assert kinds.startswith("pppd"), kinds
    prefills_between = [len(run) for run in kinds.split("d") if run]
    assert prefills_between == [3, 2], kinds
    assert all(s.num_tokens == 20 for s in steps if s.kind == "prefill")
    solo = [s.request_ids for s in steps if s.kind == "decode" and len(s.request_ids) == 1]
    assert all(ids == ("decoder",) for ids in solo), solo
