"""A rank's hardware and software profile, and the rule for when MLX uses NAX."""

from typing import Literal

from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict

from mlxserve.hardware.catalog import parse_gpu_architecture

DeviceType = Literal["metal", "cuda", "cpu"]

# MLX only takes its Neural Accelerator (NAX) kernels from this macOS on.
NAX_MIN_MACOS = Version("26.2")


class RankProfile(BaseModel):
    """What one rank is. Probed on real ranks, built from the chip catalog when simulated.

    The profile is exchanged between ranks as JSON, so it must stay small and
    plain. `simulated` travels with it so every view of the plan can say so.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    hostname: str
    chip: str
    gpu_architecture: str | None
    device_type: DeviceType
    os_name: str
    os_version: str
    mlx_version: str
    mlx_lm_version: str
    memory_bytes: int
    mlx_nax_build: bool
    simulated: bool = False

    @property
    def gpu_generation(self) -> int | None:
        parsed = parse_gpu_architecture(self.gpu_architecture or "")
        return parsed[0] if parsed else None

    @property
    def nax(self) -> bool:
        """True exactly when MLX would dispatch its NAX kernels on this rank.

        MLX needs a Metal device, macOS 26.2 or later, a build with NAX, and a
        GPU of generation 17 or later (18 or later for phone GPUs, suffix 'p').
        """
        parsed = parse_gpu_architecture(self.gpu_architecture or "")
        if self.device_type != "metal" or self.os_name != "macOS" or parsed is None:
            return False
        if not self.mlx_nax_build or not _version_at_least(self.os_version, NAX_MIN_MACOS):
            return False
        generation, suffix = parsed
        return generation >= (18 if suffix.endswith("p") else 17)

    def summary(self) -> dict[str, object]:
        """The profile plus the derived facts, as shown to people and in plans."""
        data = self.model_dump()
        data["gpu_generation"] = self.gpu_generation
        data["nax"] = self.nax
        return data


def _version_at_least(text: str, minimum: Version) -> bool:
    try:
        return Version(text) >= minimum
    except InvalidVersion:
        return False
