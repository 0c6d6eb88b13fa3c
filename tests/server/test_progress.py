"""The operator's startup line says how the speculative depth is chosen."""

import io

from mlxserve.server.backends.base import BackendInfo
from mlxserve.server.progress import Console


def _line(info: BackendInfo) -> str:
    out = io.StringIO()
    Console(stream=out).engine_up("primary", info, 1.25, restart=False)
    return out.getvalue().splitlines()[0]


def test_a_fixed_depth_is_shown_as_a_number() -> None:
    line = _line(BackendInfo("demo", 4096, (2,), speculative_depth=3, pid=7))
    assert line.endswith("(pid 7, model demo, context 4096, speculative depth 3)")


def test_an_automatic_depth_is_shown_with_its_ceiling() -> None:
    info = BackendInfo("demo", 4096, (2,), speculative_depth=5, speculative_auto=True)
    assert _line(info).endswith("speculative depth auto (up to 5))")
