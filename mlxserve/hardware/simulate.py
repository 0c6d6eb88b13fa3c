"""Simulated ranks: named by chip, so every policy decision is testable anywhere."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxserve.errors import UsageError
from mlxserve.hardware.catalog import lookup_chip
from mlxserve.hardware.profile import NAX_MIN_MACOS, RankProfile

# A chip name that means "a Linux machine running MLX on its CPU".
CPU_CHIP = "cpu"
# A chip name that means "a Linux machine running MLX on an NVIDIA GPU" (mlx[cuda]).
CUDA_CHIP = "cuda"


#: The Linux ranks by chip name: the chip a probe reports, the device, the memory.
_LINUX_RANKS: dict[str, tuple[str, Literal["cpu", "cuda"], int]] = {
    CPU_CHIP: ("Linux CPU", "cpu", 64 << 30),
    CUDA_CHIP: ("NVIDIA GPU", "cuda", 141 << 30),
}


class SimulatedRank(BaseModel):
    """One simulated rank: a chip and, optionally, the macOS and mlx it runs and its
    memory in GiB (the split policy weighs it; default: the chip's common size)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chip: str
    macos: str | None = None
    mlx: str | None = None
    memory: float | None = Field(None, gt=0)


def parse_cluster_spec(text: str) -> list[SimulatedRank]:
    """Parse `--cluster`: ranks separated by commas, each
    `CHIP[:macos=V][:mlx=V][:memory=GiB]`."""
    ranks = []
    for item in text.split(","):
        parts = [part.strip() for part in item.split(":")]
        if not parts[0]:
            raise UsageError(f"--cluster: empty rank in {text!r}")
        fields: dict[str, str | float] = {"chip": parts[0]}
        for part in parts[1:]:
            key, sep, value = part.partition("=")
            if not sep or key not in ("macos", "mlx", "memory") or not value:
                raise UsageError(
                    f"--cluster: bad field {part!r} (expected macos=V, mlx=V or memory=GiB)"
                )
            fields[key] = _gib(value) if key == "memory" else value
        ranks.append(SimulatedRank.model_validate(fields))
    return ranks


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise UsageError(f"--cluster: memory={text} is not a positive number of GiB")
    return value


def _memory(spec: SimulatedRank, default_gib: int) -> int:
    return int((spec.memory or default_gib) * 2**30)


def simulated_profile(
    rank: int, spec: SimulatedRank, local_mlx: str, local_mlx_lm: str
) -> RankProfile:
    """The profile a probe would report on that chip.

    Defaults follow the common case: an Apple rank on a macOS recent enough
    for NAX, running this machine's mlx and mlx-lm.
    """
    linux = _LINUX_RANKS.get(spec.chip.strip().lower())
    if linux is not None:
        chip, device, memory_bytes = linux
        if spec.macos is not None:
            raise UsageError(f"simulated rank {rank}: a {device} rank runs Linux, not macOS")
        return RankProfile(
            hostname=f"sim-rank{rank}",
            chip=chip,
            gpu_architecture=None,
            device_type=device,
            os_name="Linux",
            os_version="6.1",
            mlx_version=spec.mlx or local_mlx,
            mlx_lm_version=local_mlx_lm,
            memory_bytes=int(spec.memory * 2**30) if spec.memory else memory_bytes,
            mlx_nax_build=False,
            simulated=True,
        )
    facts = lookup_chip(spec.chip)
    return RankProfile(
        hostname=f"sim-rank{rank}",
        chip=facts.name,
        gpu_architecture=facts.gpu_architecture,
        device_type="metal",
        os_name="macOS",
        os_version=spec.macos or str(NAX_MIN_MACOS),
        mlx_version=spec.mlx or local_mlx,
        mlx_lm_version=local_mlx_lm,
        memory_bytes=_memory(spec, 128),
        mlx_nax_build=True,
        simulated=True,
    )
