"""The NAX rule, the chip catalog, simulated ranks and the local probe."""

import pytest

from mlxserve.errors import UsageError
from mlxserve.hardware.catalog import lookup_chip, parse_gpu_architecture
from mlxserve.hardware.probe import probe_local
from mlxserve.hardware.profile import RankProfile
from mlxserve.hardware.simulate import SimulatedRank, parse_cluster_spec, simulated_profile


def _profile(**changes: object) -> RankProfile:
    base = simulated_profile(0, SimulatedRank(chip="Apple M5 Max"), "0.32.4", "0.32.2")
    return base.model_copy(update=changes)


@pytest.mark.parametrize(
    ("changes", "nax"),
    [
        ({}, True),
        ({"os_version": "26.1"}, False),
        ({"os_version": "26.5.2"}, True),
        ({"os_version": "27.0"}, True),
        ({"os_version": "not-a-version"}, False),
        ({"gpu_architecture": "applegpu_g16s"}, False),
        ({"gpu_architecture": "applegpu_g17p"}, False),
        ({"gpu_architecture": "applegpu_g18p"}, True),
        ({"device_type": "cpu"}, False),
        ({"os_name": "Linux"}, False),
        ({"mlx_nax_build": False}, False),
        ({"gpu_architecture": None}, False),
    ],
)
def test_nax_rule(changes: dict[str, object], nax: bool) -> None:
    assert _profile(**changes).nax is nax


@pytest.mark.parametrize(
    ("name", "arch"),
    [
        ("Apple M1", "applegpu_g13g"),
        ("Apple M3 Ultra", "applegpu_g15d"),
        ("m4 pro", "applegpu_g16s"),
        ("Apple M5 Max", "applegpu_g17c"),
    ],
)
def test_catalog(name: str, arch: str) -> None:
    assert lookup_chip(name).gpu_architecture == arch


def test_unknown_chip() -> None:
    with pytest.raises(UsageError, match="unknown chip 'Apple M9'"):
        lookup_chip("Apple M9")


def test_parse_gpu_architecture() -> None:
    assert parse_gpu_architecture("applegpu_g17s") == (17, "s")
    assert parse_gpu_architecture("x86_64") is None


def test_simulated_ranks_default_to_nax_capable_macos_and_local_mlx() -> None:
    profile = simulated_profile(1, SimulatedRank(chip="Apple M5 Pro"), "0.32.4", "0.32.2")
    assert profile.simulated and profile.nax
    assert (profile.os_name, profile.os_version, profile.mlx_version) == ("macOS", "26.2", "0.32.4")
    cpu = simulated_profile(0, SimulatedRank(chip="CPU"), "0.32.4", "0.32.2")
    assert (cpu.device_type, cpu.os_name, cpu.nax) == ("cpu", "Linux", False)
    with pytest.raises(UsageError, match="cpu rank runs Linux"):
        simulated_profile(0, SimulatedRank(chip="cpu", macos="26.2"), "0.32.4", "0.32.2")
    gpu = simulated_profile(2, SimulatedRank(chip="CUDA", mlx="0.33.0"), "0.32.4", "0.32.2")
    assert (gpu.chip, gpu.device_type, gpu.nax) == ("NVIDIA GPU", "cuda", False)
    assert gpu.os_name == "Linux"
    assert (gpu.hostname, gpu.mlx_version, gpu.memory_bytes) == ("sim-rank2", "0.33.0", 141 << 30)
    with pytest.raises(UsageError, match="cuda rank runs Linux"):
        simulated_profile(0, SimulatedRank(chip="cuda", macos="26.2"), "0.32.4", "0.32.2")


def test_parse_cluster_spec() -> None:
    ranks = parse_cluster_spec("Apple M3 Ultra, Apple M5 Max:macos=26.1:mlx=0.32.1")
    assert ranks == [
        SimulatedRank(chip="Apple M3 Ultra"),
        SimulatedRank(chip="Apple M5 Max", macos="26.1", mlx="0.32.1"),
    ]
    for bad in ("Apple M5 Max,", "Apple M5 Max:os=26", "Apple M5 Max:mlx="):
        with pytest.raises(UsageError, match="--cluster"):
            parse_cluster_spec(bad)


def test_probe_local_reports_this_machine() -> None:
    import mlx.core as mx

    profile = probe_local()
    assert not profile.simulated
    assert profile.mlx_version == mx.__version__
    assert profile.memory_bytes > 0
    assert profile.chip
    if not mx.metal.is_available():
        assert profile.device_type in ("cpu", "cuda")
        assert profile.nax is False
