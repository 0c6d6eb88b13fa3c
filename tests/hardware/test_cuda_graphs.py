"""MLX CUDA's graph settings are made before any device work, on CUDA alone, unless
the user made them."""

import os

import mlx.core as mx
import pytest

from mlxserve.cli import main
from mlxserve.hardware.cuda_graphs import CUDA_GRAPH_SETTINGS, configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device

NAME = "MLX_CUDA_GRAPH_CACHE_SIZE"
OPS = "MLX_MAX_OPS_PER_BUFFER"


def test_the_settings_are_made_where_the_user_made_none() -> None:
    env: dict[str, str] = {}
    assert configure_cuda_graphs(env, cuda=True) == CUDA_GRAPH_SETTINGS
    assert env == CUDA_GRAPH_SETTINGS
    assert int(CUDA_GRAPH_SETTINGS[NAME]) > 100  # MLX's own default thrashes (see module)
    assert int(CUDA_GRAPH_SETTINGS[OPS]) > 100  # MLX's on an H100: ~14 graphs a step


def test_a_value_the_user_exported_is_kept() -> None:
    env = {NAME: "77", OPS: "30"}
    assert configure_cuda_graphs(env, cuda=True) == {NAME: "77", OPS: "30"}
    assert env == {NAME: "77", OPS: "30"}


def test_nothing_is_set_without_cuda() -> None:
    """Metal reads the operations per command buffer from the same variable."""
    env: dict[str, str] = {}
    assert configure_cuda_graphs(env, cuda=False) == {}
    assert env == {}


@pytest.mark.skipif(mx.cuda.is_available(), reason="a CUDA machine sets them")
def test_the_cli_sets_nothing_on_a_machine_without_cuda(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in CUDA_GRAPH_SETTINGS:
        monkeypatch.setenv(name, "recorded, so that teardown restores it")
        monkeypatch.delenv(name)
    assert main(["probe", "--json"]) == 0  # this machine: MLX's CPU back-end
    capsys.readouterr()
    assert not set(CUDA_GRAPH_SETTINGS) & set(os.environ)


def test_benchmarks_record_the_mlx_settings_they_ran_with(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, "555")
    monkeypatch.setenv(OPS, "66")
    recorded = benchmark_device()["mlx_env"]
    assert recorded[NAME] == "555" and recorded[OPS] == "66"
