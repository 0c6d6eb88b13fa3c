"""MLX CUDA's graph cache is sized before any device work, unless the user sized it."""

import os

import pytest

from mlxserve.cli import main
from mlxserve.hardware.cuda_graphs import CUDA_GRAPH_SETTINGS, configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device

NAME = "MLX_CUDA_GRAPH_CACHE_SIZE"


def test_the_cache_size_is_set_where_the_user_set_none() -> None:
    env: dict[str, str] = {}
    assert configure_cuda_graphs(env) == {NAME: CUDA_GRAPH_SETTINGS[NAME]}
    assert env == {NAME: CUDA_GRAPH_SETTINGS[NAME]}
    assert int(CUDA_GRAPH_SETTINGS[NAME]) > 100  # MLX's own default thrashes (see module)


def test_a_value_the_user_exported_is_kept() -> None:
    env = {NAME: "77"}
    assert configure_cuda_graphs(env) == {NAME: "77"}
    assert env == {NAME: "77"}


def test_the_cli_sets_it_for_the_processes_it_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(NAME, "recorded, so that teardown removes what main sets")
    monkeypatch.delenv(NAME)
    assert main(["probe", "--json"]) == 0
    capsys.readouterr()
    assert os.environ[NAME] == CUDA_GRAPH_SETTINGS[NAME]  # children inherit os.environ


def test_the_cli_keeps_the_user_s_value(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(NAME, "333")
    assert main(["probe", "--json"]) == 0
    capsys.readouterr()
    assert os.environ[NAME] == "333"


def test_benchmarks_record_the_mlx_settings_they_ran_with(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, "555")
    assert benchmark_device()["mlx_env"][NAME] == "555"
