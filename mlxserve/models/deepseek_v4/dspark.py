"""DeepSeek-V4-Flash-0731's DSpark draft head: recognised, and left out.

The -0731 release keeps V4-Flash's architecture but ships, under ``mtp.0`` .. ``mtp.2``,
a DSpark draft head instead of the single MTP block: three draft stages that denoise
a block of ``dspark_block_size`` masked positions at once, conditioned on the hidden
states of the target layers ``dspark_target_layer_ids`` (``mtp.0.main_proj`` /
``main_norm``), plus a low-rank Markov bias over the previous token
(``markov_head.markov_w1`` / ``markov_w2``) and an acceptance-confidence head. It
drafts blocks, not one token per MTP step, so mlxserve's MTP drafter cannot run it,
and its tensors do not fit an ``MTPBlock`` (public sources: mlx-vlm #2095 / PR #2097,
DeepSpec). mlxserve serves the main model with speculative decoding off and says so
once at startup (``loader``); the draft tensors are dropped before loading.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

#: config.json keys that only a checkpoint with a DSpark head carries.
CONFIG_KEYS = (
    "dspark_block_size",
    "dspark_target_layer_ids",
    "dspark_markov_rank",
    "dspark_noise_token_id",
)
#: Parts of a DSpark stage that a plain MTP block does not have.
_DSPARK_PARTS = (".main_proj.", ".main_norm.", ".markov_head.", ".confidence_head.")


def is_draft_tensor(name: str) -> bool:
    """A tensor of the draft head (``mtp.*``, with or without ``model.``)."""
    return name.removeprefix("model.").startswith("mtp.")


def has_dspark_head(config: Mapping[str, Any], names: Iterable[str] = ()) -> bool:
    """Whether ``config`` or the tensor ``names`` show a DSpark draft head."""
    sections = [config]
    if isinstance(config.get("text_config"), Mapping):
        sections.append(config["text_config"])
    if any(section.get(key) for section in sections for key in CONFIG_KEYS):
        return True
    return any(is_draft_tensor(n) and any(p in n for p in _DSPARK_PARTS) for n in names)


def drop_draft_head(weights: Mapping[str, T]) -> dict[str, T]:
    """``weights`` without the draft head's tensors."""
    return {name: value for name, value in weights.items() if not is_draft_tensor(name)}
