"""The cluster as the policy sees it: every rank's profile plus the wiring.

It lives beside the rank profile, not in `mlxserve.cluster`, because both sides need it:
`mlxserve.cluster.discover` builds it from the exchanged profiles, and the policy reads
it, and the policy imports nothing of the package that joins groups and moves bytes.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict

from mlxserve.hardware.profile import RankProfile

Composition = Literal["all_nax", "mixed_nax", "no_nax"]
Backend = Literal["none", "ring", "jaccl", "mpi", "nccl"]


class Cluster(BaseModel):
    """Identical on every rank once profiles are exchanged, so plans agree."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ranks: list[RankProfile]
    backend: Backend
    wires: int = 1

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def simulated(self) -> bool:
        return any(rank.simulated for rank in self.ranks)

    @property
    def composition(self) -> Composition:
        nax = [rank.nax for rank in self.ranks]
        if all(nax):
            return "all_nax"
        return "mixed_nax" if any(nax) else "no_nax"
