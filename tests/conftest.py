"""Session-wide test isolation: the state a test run learns is its own.

Plans read the calibration records and the incidents remembered in `[server]
state_dir` (rules moe-calibrated-fastest and incident-pinned); a developer's real
~/.cache/mlxserve must not change what the tests' plans decide, and the tests'
records must not reach it. The variable is inherited by every server and rank a
test starts.
"""

from collections.abc import Iterator

import pytest

STATE_DIR_ENV = "MLXSERVE_SERVER__STATE_DIR"


@pytest.fixture(scope="session", autouse=True)
def private_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(STATE_DIR_ENV, str(tmp_path_factory.mktemp("state")))
        yield
