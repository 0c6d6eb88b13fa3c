"""Start real MLX ring ranks on loopback running `python -m mlxserve ARGS`."""

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.ring import RankRun, run_ring_ranks

RunRanks = Callable[[list[str], list[dict[str, str]]], list[RankRun]]


@pytest.fixture
def run_ranks(tmp_path: Path) -> RunRanks:
    """Run `python -m mlxserve ARGS` as N ring ranks with per-rank extra environment."""

    def run(args: list[str], rank_envs: list[dict[str, str]], timeout: float = 90) -> list[RankRun]:
        return run_ring_ranks(
            [sys.executable, "-m", "mlxserve", *args], rank_envs, tmp_path, timeout
        )

    return run
