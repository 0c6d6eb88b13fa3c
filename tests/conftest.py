"""Settings every test shares."""

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep the developer's calibration records (~/.cache/mlxserve) out of every plan."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLXSERVE_SERVER__STATE_DIR", str(tmp_path_factory.mktemp("state")))
        yield
