"""Whether a rule's conditions hold for a cluster (and a rank)."""

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from mlxserve.hardware.composition import Cluster
from mlxserve.hardware.profile import RankProfile
from mlxserve.policy.rules import Conditions


def conditions_hold(
    when: Conditions, cluster: Cluster, rank: int | None, incident: bool = False
) -> bool:
    """For a rank rule pass the rank; for a world rule pass None.

    `incident`: whether the incident memory has a hang of this kind of cluster.
    """
    subjects: list[RankProfile] = cluster.ranks if rank is None else [cluster.ranks[rank]]
    checks = [
        when.composition is None or cluster.composition in when.composition,
        when.world_size is None or _in_range(str(cluster.world_size), when.world_size),
        when.wires is None or _in_range(str(cluster.wires), when.wires),
        when.backend is None or cluster.backend in when.backend,
        when.rank_nax is None or (rank is not None and subjects[0].nax == when.rank_nax),
        when.mlx is None or any(_in_range(p.mlx_version, when.mlx) for p in subjects),
        when.chips is None or any(_chip_in(p.chip, when.chips) for p in subjects),
        when.device is None or any(p.device_type in when.device for p in subjects),
        when.incident is None or when.incident == incident,
    ]
    return all(checks)


def _in_range(version: str, spec: str) -> bool:
    try:
        return Version(version) in SpecifierSet(spec, prereleases=True)
    except InvalidVersion:
        return False


def _chip_in(chip: str, chips: list[str]) -> bool:
    return chip.lower() in {c.lower() for c in chips}
