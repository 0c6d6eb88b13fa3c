"""The parts of a DeepSeek-V4.1 checkpoint that mlxserve does not serve, by name prefix.

Kept apart from ``model.py`` (which imports mlx-lm, slowly) so the loader's checks
on the safetensors headers can name them before anything is built. The draft head
(``mtp.*``) is served, as a DSpark head (``dspark.py``), when the config describes
one (``dspark_block_size`` and ``dspark_target_layer_ids``); without those fields its
block and taps are unknown, and it is not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

DRAFT_HEAD = "MTP draft head"
#: checkpoint prefixes of the parts V4.1 ships that mlxserve may not serve
NOT_SERVED = {
    "vision tower": ("vision.", "aligner.", "image_"),
    DRAFT_HEAD: ("mtp.",),
}
#: why each is not served, for the loader's log line
REASONS = {
    "vision tower": "text only",
    DRAFT_HEAD: "the config has no dspark_block_size / dspark_target_layer_ids; "
    "speculative depth 0",
}


def draft_head_served(config: Mapping[str, Any] | None) -> bool:
    """Whether ``config`` (config.json, fields at the top or in ``text_config``)
    describes the DSpark head that ``mtp.*`` then holds."""
    if not config:
        return False
    text = config.get("text_config")
    fields = text if isinstance(text, Mapping) else config
    return bool(fields.get("dspark_block_size")) and bool(fields.get("dspark_target_layer_ids"))


def not_served_parts(config: Mapping[str, Any] | None) -> dict[str, tuple[str, ...]]:
    """``NOT_SERVED`` for this config (the draft head left out when it is served)."""
    served = draft_head_served(config)
    return {part: p for part, p in NOT_SERVED.items() if not (served and part == DRAFT_HEAD)}


def not_served(names: Iterable[str], config: Mapping[str, Any] | None = None) -> dict[str, int]:
    """How many tensors of each part the checkpoint ``names`` hold that are not served
    under ``config``."""
    parts = not_served_parts(config)
    counts: dict[str, int] = {}
    for name in names:
        bare = name.removeprefix("model.")
        for part, prefixes in parts.items():
            if bare.startswith(prefixes):
                counts[part] = counts.get(part, 0) + 1
    return counts
