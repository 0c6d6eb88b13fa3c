"""The probe of this machine, and what it calls the chip of an NVIDIA rank."""

import mlx.core as mx
import pytest

import mlxserve.hardware.probe as probe


def test_this_machine_is_probed_as_mlx_sees_it() -> None:
    profile = probe.probe_local()
    assert profile.device_type in ("metal", "cuda", "cpu")
    assert profile.chip and profile.mlx_version == mx.__version__


def test_an_nvidia_rank_is_named_by_its_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU here: present MLX's CUDA answers (device type, device_info) to the probe.
    monkeypatch.setattr(probe, "_device_type", lambda _: "cuda")
    monkeypatch.setattr(mx, "device_info", lambda: {"device_name": "NVIDIA H200", "memory_size": 1})
    profile = probe.probe_local()
    assert (profile.chip, profile.device_type, profile.nax) == ("NVIDIA H200", "cuda", False)


def test_a_benchmark_records_the_same_device_from_a_child_process() -> None:
    # The benchmarks that drive servers probe in a child (this Python, this mlxserve).
    here = probe.benchmark_device()
    apart = probe.benchmark_device_apart()
    assert "probe_error" not in apart, apart
    assert apart == here
    assert here["device_type"] in ("metal", "cuda", "cpu") and here["mlx"] == mx.__version__
