"""The supervisor's bookkeeping: incidents are bounded; a refusing backend is never restarted."""

import asyncio

from mlxserve.config import ServerSettings
from mlxserve.server.backends.base import BackendInfo, BackendRefused
from mlxserve.server.metrics import Metrics
from mlxserve.server.progress import Console
from mlxserve.server.supervisor import INCIDENTS_KEPT, Supervisor
from tests.server.fakes import FakeBackend


class Refusing(FakeBackend):
    """Starts like an engine that exits 2 (bad settings)."""

    starts = 0

    async def start(self) -> BackendInfo:
        self.starts += 1
        raise BackendRefused("engine exited with code 2 while starting: bad setting")


def supervisor(*backends: FakeBackend) -> Supervisor:
    return Supervisor(
        list(backends),
        ServerSettings(),
        Metrics(),
        [1],
        Console(enabled=False),  # type: ignore[call-arg]
    )


def test_incidents_keep_the_newest_hundred() -> None:
    backend = FakeBackend("a").up()
    sup = supervisor(backend)
    for _ in range(INCIDENTS_KEPT + 25):
        sup._record(backend, "crash", 1)
    assert len(sup.incidents) == INCIDENTS_KEPT == 100


def test_a_refusing_backend_is_started_once() -> None:
    async def scenario() -> tuple[int, bool]:
        refusing = Refusing("a")
        sup = supervisor(refusing)
        await sup.start()
        await asyncio.wait_for(sup.all_refused.wait(), 5)
        await asyncio.sleep(0.2)
        await sup.stop()
        return refusing.starts, "a" in sup.refused

    assert asyncio.run(scenario()) == (1, True)
