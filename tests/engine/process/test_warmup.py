"""The warm-up before serving: it runs every kind of step, then leaves no trace but
compiled kernels and the depth calibration; serving gives the same tokens after it."""

from pathlib import Path

import pytest

from mlxserve.channel.request import GenerationParams
from mlxserve.engine.core.build import adapter_for, materialize
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.process.warmup import wanted, warm_up
from tests.engine.conftest_process import EngineProcess, build_tiny_model
from tests.engine.drive import run


def test_auto_warms_up_on_a_gpu_only() -> None:
    assert wanted("auto", "cuda") and wanted("auto", "metal")
    assert not wanted("auto", "cpu")
    assert wanted(True, "cpu") and not wanted(False, "cuda")


def test_warm_up_leaves_calibration_and_no_other_trace() -> None:
    from mlxserve.models import load

    model, tokenizer = load("demo")
    materialize(model)
    prompt = tuple(tokenizer.encode("What does the with statement do?"))

    def engine() -> Engine:
        config = EngineConfig(
            speculative_depth="auto", max_speculative_batch=2, batch_speculative_depth=2
        )
        return Engine(adapter_for(model, "auto"), config)

    warmed = engine()
    steps: list[str] = []
    warmed.before_step = lambda plan: steps.append(plan.kind)
    assert warm_up(warmed, tuple(tokenizer.encode("Warm up: say hello."))) > 0
    # A lone request prefilled, decoded and speculated (the calibration ran), and a
    # pair decoded in a batch.
    assert {"prefill", "decode", "speculate"} <= set(steps)
    assert warmed.depth_picker is not None
    # Calibrated, but the warm-up's acceptance and round times are not the prior.
    assert warmed.depth_picker.history.steps_at_depth == {} and not warmed.depth_picker.observed
    assert warmed.depth_picker.seen  # its first rounds (the compiling ones) stay dropped
    assert warmed.prefix_cache is not None and len(warmed.prefix_cache) == 0
    assert warmed.step_times.expected_s(None) == 0.0
    assert not warmed.runner.batches and warmed.scheduler.idle

    warmed.before_step = None
    after, finish = run(warmed, GenerationRequest("a", GenerationParams(prompt, 24)))["a"]
    assert finish.memory is not None  # the serving peak is serving's: no warm-up in it
    assert finish.memory["peak_bytes"] == finish.memory["busy_peak_bytes"]
    fresh, _ = run(engine(), GenerationRequest("a", GenerationParams(prompt, 24)))["a"]
    assert after == fresh  # greedy: the same tokens, warmed up or not
    assert finish.usage.cached_tokens == 0


def test_a_failed_warm_up_leaves_nothing_to_serve_or_remember() -> None:
    """A step fails during the pair: the error is raised for the caller to log, and
    no warm-up request stays scheduled, nor any prefix entry or step time."""
    from mlxserve.models import load

    model, tokenizer = load("demo")
    materialize(model)
    engine = Engine(adapter_for(model, 0), EngineConfig(speculative_depth=0))
    steps: list[str] = []

    def fail_in_the_pair(plan: object) -> None:
        steps.append("step")
        if len(steps) == 30:  # the lone request takes 24 tokens: this is the pair's
            raise MemoryError("injected")

    engine.before_step = fail_in_the_pair
    with pytest.raises(RuntimeError, match="warm-up"):
        warm_up(engine, tuple(tokenizer.encode("Warm up: say hello.")))
    assert engine.scheduler.idle and not engine.warming_up
    assert engine.prefix_cache is not None and len(engine.prefix_cache) == 0
    assert engine.step_times.expected_s(None) == 0.0


def test_warm_up_refuses_an_empty_prompt() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        warm_up(None, ())  # type: ignore[arg-type]


@pytest.mark.slow
def test_engine_process_warms_up_before_its_hello(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "engine").mkdir()
    model_dir = build_tiny_model(tmp_path / "model")
    env = {"MLXSERVE_ENGINE__WARM_UP": "true"}
    process = EngineProcess(tmp_path / "engine", model_dir, env=env)
    try:
        hello = process.connect()
        assert hello["type"] == "hello"
        assert "warm-up:" in process.stderr()
    finally:
        process.close()
