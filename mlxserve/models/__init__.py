"""Model loading for mlxserve: ``mlx_lm`` models plus the ones ``mlx_lm`` lacks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["load", "sharded_load"]


def load(path: str | Path, **kwargs: Any) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)``; see ``mlxserve.models.loader.load``."""
    from .loader import load as _load

    return _load(path, **kwargs)


def sharded_load(path: str | Path, group: Any = None, **kwargs: Any) -> tuple[Any, Any]:
    """Load and shard over ``group``; see ``mlxserve.models.loader.sharded_load``."""
    from .loader import sharded_load as _sharded_load

    return _sharded_load(path, group, **kwargs)
