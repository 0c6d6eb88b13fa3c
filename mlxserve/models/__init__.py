"""Model loading for mlxserve: ``mlx_lm`` models plus the ones ``mlx_lm`` lacks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["load"]


def load(path: str | Path, **kwargs: Any) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)``; see ``mlxserve.models.loader.load``."""
    from .loader import load as _load

    return _load(path, **kwargs)
