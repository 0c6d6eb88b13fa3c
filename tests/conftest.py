"""Session-wide test isolation: the incident memory of a test run is its own.

Plans read the incidents remembered in `[server] state_dir` (rule
incident-pinned); a developer's real ~/.cache/mlxserve must not change what the
tests' plans decide, and the tests' incidents must not reach it.
"""

import os
from collections.abc import Iterator

import pytest

STATE_DIR_ENV = "MLXSERVE_SERVER__STATE_DIR"


@pytest.fixture(scope="session", autouse=True)
def private_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    previous = os.environ.get(STATE_DIR_ENV)
    os.environ[STATE_DIR_ENV] = str(tmp_path_factory.mktemp("state"))
    yield
    if previous is None:
        os.environ.pop(STATE_DIR_ENV, None)
    else:
        os.environ[STATE_DIR_ENV] = previous
