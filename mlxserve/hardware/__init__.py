"""What a rank is: its chip, GPU, OS and software, probed or simulated."""

from mlxserve.hardware.profile import RankProfile

__all__ = ["RankProfile"]
