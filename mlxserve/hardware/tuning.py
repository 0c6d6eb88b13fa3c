"""The engine's tuning: knobs that trade speed against memory, with defaults per device.

Each default was chosen from measurements on one kind of machine; docs/engine.md
(Tuning) gives them and the device that made them. `EngineTuning`'s own defaults
hold on every device, `DEVICE_DEFAULTS` replaces some on one kind of device, and a
knob set in the configuration (`[engine.tuning]`) wins over both (`tuning_for`).
The engine is built with the result, carried by its `EngineConfig`: its adapter and
the model's layers read the knobs from it (`Tunable.tune`), never from module
globals, so a benchmark or a test sets a knob by building an engine (or tuning an
adapter) with it.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from mlxserve.hardware.profile import DeviceType


@dataclass(frozen=True)
class EngineTuning:
    """The knobs (`mlxserve.config.TuningSettings` describes each one)."""

    #: A verify forward is queued for the device every this many layers (0: never).
    verify_queue_every_layers: int = 4
    #: A prefill chunk is queued for the device every this many layers (0: never).
    prefill_queue_every_layers: int = 1
    #: Forwards of at most this many rows run the compiled hyper-connections (0: none).
    compiled_hc_max_rows: int = 64
    #: Forwards of at most this many rows run DeepSeek-V4's fused layer parts (0: none).
    compiled_decode_max_rows: int = 64
    #: Forwards of 2-8 queries attend one query at a time, unmasked.
    split_attention_queries: bool = False
    #: Up to this many requests draft together, at `speculative_batch_depth`.
    speculative_batch: int = 2
    speculative_batch_depth: int = 2
    #: Positions a request joining a batch of plain KV caches reserves ahead at most.
    batch_reserve_positions: int = 1024

    def replace(self, **knobs: Any) -> "EngineTuning":
        """These knobs changed, the others kept."""
        return dataclasses.replace(self, **knobs)


#: What differs from `EngineTuning`'s defaults on one kind of device.
DEVICE_DEFAULTS: dict[DeviceType, dict[str, Any]] = {
    "cuda": {"split_attention_queries": True},
}


def tuning_for(device: DeviceType, configured: dict[str, Any] | None = None) -> EngineTuning:
    """The knobs on ``device``: its defaults, then the ``configured`` ones (unset: absent)."""
    return EngineTuning(**{**DEVICE_DEFAULTS.get(device, {}), **(configured or {})})


def default_tuning() -> EngineTuning:
    """The defaults on the device MLX computes on by default here: what an adapter or a
    model built outside an engine starts with."""
    from mlxserve.hardware.device import default_device_type

    return tuning_for(default_device_type())


@runtime_checkable
class Tunable(Protocol):
    """A model (or adapter) whose forwards read knobs of the tuning."""

    def tune(self, tuning: EngineTuning) -> None: ...


def tune_model(model: object, tuning: EngineTuning) -> None:
    """Give ``model`` the knobs if it reads any (a DeepSeek-V4 model does)."""
    if isinstance(model, Tunable):
        model.tune(tuning)
