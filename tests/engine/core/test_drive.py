"""Single-shot driving of the engine (what `mlxserve generate` and benchmarks use)."""

from mlx.nn.layers.base import Module

from mlxserve.channel.request import GenerationParams
from mlxserve.engine.core.drive import run_to_completion
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.runner.adapter import PlainAdapter
from tests.engine.core.test_engine_plain import PROMPT, reference_greedy


def test_runs_to_completion_with_timings(llama_model: Module) -> None:
    engine = Engine(PlainAdapter(llama_model), EngineConfig())
    done = run_to_completion(engine, GenerationRequest("a", GenerationParams(PROMPT, 12)))
    assert done.tokens == reference_greedy(llama_model, PROMPT, 12)
    assert done.finish.finish_reason == "length"
    assert 0 < done.ttft_s <= done.total_s


def test_callback_can_cancel(llama_model: Module) -> None:
    engine = Engine(PlainAdapter(llama_model), EngineConfig())
    seen: list[int] = []

    def enough(tokens: tuple[int, ...]) -> bool:
        seen.extend(tokens)
        return len(seen) >= 3

    done = run_to_completion(engine, GenerationRequest("a", GenerationParams(PROMPT, 500)), enough)
    assert done.finish.finish_reason == "cancelled"
    assert len(done.tokens) < 10
