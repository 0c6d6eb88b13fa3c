"""Find out which cluster this process belongs to: simulated, distributed or alone.

- `[cluster] simulate` (or `--cluster`) lists every rank: plan for that cluster.
- Under `mlx.launch` (MLX_RANK is set) the ranks probe themselves and exchange
  profiles; `[cluster] simulate_self` presents this rank as a named chip, for tests.
- Otherwise the cluster is this machine alone.
"""

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxserve.cluster.exchange import gather_profiles
from mlxserve.config import ClusterSettings
from mlxserve.errors import UsageError
from mlxserve.hardware.composition import Backend, Cluster
from mlxserve.hardware.probe import package_version, probe_local
from mlxserve.hardware.profile import RankProfile
from mlxserve.hardware.simulate import SimulatedRank, parse_cluster_spec, simulated_profile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Membership:
    """The cluster and where this process sits in it."""

    cluster: Cluster
    rank: int
    group: Any = None  # the mlx.core.distributed.Group in a real distributed run


def discover(settings: ClusterSettings) -> Membership:
    if settings.simulate:
        return Membership(simulated_cluster(settings), rank=launched_rank() or 0)
    if "MLX_RANK" in os.environ:
        return _distributed(settings)
    local = _self_profile(settings, rank=0)
    return Membership(Cluster(ranks=[local], backend="none", wires=1), rank=0)


def simulated_cluster(settings: ClusterSettings) -> Cluster:
    specs = [_as_spec(item) for item in settings.simulate]
    mlx_version, mlx_lm_version = _local_versions()
    profiles = [simulated_profile(i, s, mlx_version, mlx_lm_version) for i, s in enumerate(specs)]
    backend: Backend
    if len(profiles) == 1:
        backend = "none"
    elif settings.backend != "auto":
        backend = settings.backend
    else:
        backend = "jaccl" if all(p.device_type == "metal" for p in profiles) else "ring"
    return Cluster(ranks=profiles, backend=backend, wires=settings.wires or 1)


class GroupPortTaken(RuntimeError):
    """A rank could not bind its port (taken meanwhile): worth a restart, unlike a
    `UsageError`."""


#: How MLX's ring reports a port in use (errno 98 on Linux, 48 on macOS).
_PORT_TAKEN = re.compile(r"bind socket \(error: (98|48)\)|Address already in use")
#: How it reports a peer that is not listening yet (ECONNREFUSED: 111 on Linux, 61 on
#: macOS), after retrying for 15-30 s itself.
_PEER_NOT_UP = re.compile(r"Couldn't connect \(error: (111|61)\)|Connection refused")
#: Joins tried while a peer is not up yet. The ranks start together, but one can lag
#: by more than MLX's own wait: rank 0 may be a front that starts its engine only once
#: it is up, and on a loaded machine that took longer (seen in CI). MLX's init can be
#: called again in the same process, so a rank waits up to about 2-3 minutes. Only the
#: ring's last rank retries: it connects before it accepts, so a failed attempt has
#: made no connection; any other rank has already accepted its left neighbour, which
#: would not connect again, and a retry would wait for it forever. Not JACCL either
#: (a failed init there may hold RDMA resources until a reboot).
JOIN_ATTEMPTS = 6


def _distributed(settings: ClusterSettings) -> Membership:

    backend: Backend = "ring" if settings.backend == "auto" else settings.backend
    if settings.backend == "auto" and "MLX_JACCL_COORDINATOR" in os.environ:
        backend = "jaccl"
    group = _join(backend)
    rank = group.rank()
    profiles = gather_profiles(group, _self_profile(settings, rank))
    wires = settings.wires or _hostfile_wires(rank)
    return Membership(Cluster(ranks=profiles, backend=backend, wires=wires), rank=rank, group=group)


def _join(backend: Backend) -> Any:
    """``mx.distributed.init``, again while a peer is not up yet (`JOIN_ATTEMPTS`,
    where that is safe: `_may_join_again`)."""
    import mlx.core as mx

    attempts = JOIN_ATTEMPTS if _may_join_again(backend) else 1
    for attempt in range(1, attempts + 1):
        try:
            return mx.distributed.init(strict=True, backend=backend)
        except RuntimeError as exc:
            if _PORT_TAKEN.search(str(exc)):
                # Another process took a port between the launcher's choice and our
                # bind: a restart (new ports) helps, so this is not a settings error.
                raise GroupPortTaken(f"cannot join the {backend} cluster: {exc}") from None
            if not _PEER_NOT_UP.search(str(exc)) or attempt == attempts:
                tried = f" ({attempt} attempts)" if attempt > 1 else ""
                raise UsageError(f"cannot join the {backend} cluster{tried}: {exc}") from None
            log.warning(
                "a peer of the %s group is not up yet (%s): joining again (%d of %d)",
                backend,
                exc,
                attempt + 1,
                attempts,
            )
    raise AssertionError("unreachable")


def _may_join_again(backend: Backend) -> bool:
    """Whether a refused join may be retried here: the ring's last rank only (see
    `JOIN_ATTEMPTS`), its rank and the ring's size read from the launcher's
    environment (`launched_rank`, `launched_world_size`)."""
    rank, size = launched_rank(), launched_world_size()
    if backend != "ring" or rank is None or size is None:
        return False
    return size > 1 and rank == size - 1


def _self_profile(settings: ClusterSettings, rank: int) -> RankProfile:
    if settings.simulate_self is None:
        return probe_local()
    mlx_version, mlx_lm_version = _local_versions()
    return simulated_profile(rank, _as_spec(settings.simulate_self), mlx_version, mlx_lm_version)


def _as_spec(item: str | SimulatedRank) -> SimulatedRank:
    if isinstance(item, SimulatedRank):
        return item
    specs = parse_cluster_spec(item)
    if len(specs) != 1:
        raise UsageError(f"cluster.simulate: one rank per entry, got {item!r}")
    return specs[0]


def _local_versions() -> tuple[str, str]:
    return package_version("mlx"), package_version("mlx-lm")


def launched_rank() -> int | None:
    """This process's rank when a launcher (`mlx.launch`, or MLX_RANK by hand) set one."""
    text = os.environ.get("MLX_RANK")
    return int(text) if text and text.isdigit() else None


def launched_world_size() -> int | None:
    """The launcher's world size: MLX_WORLD_SIZE, else the ring hostfile's length."""
    text = os.environ.get("MLX_WORLD_SIZE", "")
    if text.isdigit():
        return int(text)
    hosts = _ring_hosts()
    return None if hosts is None else len(hosts)


def _ring_hosts() -> list[Any] | None:
    """The launcher's ring hostfile (MLX_HOSTFILE: a JSON list, one address list per
    rank), or None where there is none or it cannot be read."""
    path = os.environ.get("MLX_HOSTFILE")
    if not path:
        return None
    try:
        hosts = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return hosts if isinstance(hosts, list) else None


def _hostfile_wires(rank: int) -> int:
    """Links per rank in a ring hostfile (a JSON list of address lists), else 1."""
    hosts = _ring_hosts()
    try:
        return max(1, len(hosts[rank])) if hosts is not None else 1
    except (IndexError, TypeError):
        return 1
