"""The engine's tuning: defaults per device, the configuration over them, and the knobs
reaching the adapter and every layer of the model without changing a greedy output."""

from pathlib import Path

import pytest

from mlxserve.channel.request import GenerationParams
from mlxserve.config import Settings, load_settings
from mlxserve.engine.core.build import engine_tuning
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.spec.mtp import MTPAdapter
from mlxserve.hardware import device
from mlxserve.hardware.tuning import EngineTuning, default_tuning, tuning_for
from tests.engine.drive import run
from tests.engine.v4_models import tiny_v4

PROMPT = tuple((7 * i + 3) % 61 for i in range(30))


def test_only_cuda_splits_attention_by_default() -> None:
    assert tuning_for("cuda") == EngineTuning(split_attention_queries=True)
    assert tuning_for("metal") == tuning_for("cpu") == EngineTuning()


def test_a_configured_knob_wins_over_the_devices_default() -> None:
    assert not tuning_for("cuda", {"split_attention_queries": False}).split_attention_queries
    assert tuning_for("cpu", {"speculative_batch": 4}) == EngineTuning(speculative_batch=4)


def test_the_config_file_sets_knobs_and_the_device_the_others(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[engine.tuning]\nverify_queue_every_layers = 0\nspeculative_batch = 3\n")
    tuning = engine_tuning(load_settings(path))
    assert tuning == default_tuning().replace(verify_queue_every_layers=0, speculative_batch=3)


def test_settings_handed_to_an_engine_keep_the_devices_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The front hands its settings to an engine process as JSON, unset knobs as null:
    the engine's device still chooses those."""
    handed = Settings.model_validate(load_settings().model_dump(mode="json"))
    monkeypatch.setattr(device, "default_device_type", lambda: "cuda")
    assert engine_tuning(handed) == tuning_for("cuda")


def test_the_engine_tunes_its_adapter_and_every_layer() -> None:
    model = tiny_v4(seed=1)
    tuning = EngineTuning(compiled_hc_max_rows=0, split_attention_queries=True)
    engine = Engine(MTPAdapter(model), EngineConfig(speculative_depth=2, tuning=tuning))
    assert engine.adapter.tuning is tuning
    layers = [*model.layers, *model.mtp]
    assert {layer.hc_attn.compiled_max_rows for layer in layers} == {0}
    assert {layer.attn.split_attention_queries for layer in layers} == {True}


@pytest.mark.parametrize(
    "knobs",
    [
        {"verify_queue_every_layers": 0, "prefill_queue_every_layers": 0},
        {"verify_queue_every_layers": 1, "prefill_queue_every_layers": 2},
        {"compiled_hc_max_rows": 0},
        {"split_attention_queries": True},
    ],
)
def test_no_knob_changes_a_greedy_output(knobs: dict[str, object]) -> None:
    model = tiny_v4(seed=2)
    outputs = []
    for tuning in (default_tuning(), default_tuning().replace(**knobs)):
        config = EngineConfig(prefill_step=16, speculative_depth=3, tuning=tuning)
        engine = Engine(MTPAdapter(model), config)
        tokens, _ = run(engine, GenerationRequest("r", GenerationParams(PROMPT, 12)))["r"]
        outputs.append(tokens)
    assert outputs[0] == outputs[1]
