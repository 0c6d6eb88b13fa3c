"""The parts of a DeepSeek-V4.1 checkpoint that mlxserve does not serve, by name prefix.

Kept apart from ``model.py`` (which imports mlx-lm, slowly) so the loader's checks
on the safetensors headers can name them before anything is built.
"""

from __future__ import annotations

from collections.abc import Iterable

#: checkpoint prefixes of the parts V4.1 ships that mlxserve does not serve
NOT_SERVED = {
    "vision tower": ("vision.", "aligner.", "image_"),
    "MTP draft head": ("mtp.",),
}


def not_served(names: Iterable[str]) -> dict[str, int]:
    """How many tensors of each part in ``NOT_SERVED`` the checkpoint ``names`` hold."""
    counts: dict[str, int] = {}
    for name in names:
        bare = name.removeprefix("model.")
        for part, prefixes in NOT_SERVED.items():
            if bare.startswith(prefixes):
                counts[part] = counts.get(part, 0) + 1
    return counts
